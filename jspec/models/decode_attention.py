"""Split-S decode attention: one query token per sequence, through JAX's Pallas GPU kernel
(`jax.experimental.pallas.ops.gpu.decode_attention.gqa`, flash decoding).

Why: XLA runs decode attention as batched matrix-vector products over the whole cache bucket,
~1.7 TB/s on an H200 at context 8192 (BENCHMARKS.md). The kernel splits each (sequence, KV
head)'s slots into `k_splits` ranges processed in parallel and stops each range at the
sequence's length, so only valid slots are read. Selected with `LLM(attention_backend=
"pallas")` for one-token forwards (plain decode steps, MTP draft steps); multi-token forwards
(prefill, verify, draft extend) keep XLA's attention.

The kernel is not partitionable by XLA, so it runs under `shard_map`: sequences split over the
batch axes, heads over tp, exactly as the cache is stored; no collective is needed.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec.sharding.rules import ShardingRules

with warnings.catch_warnings():  # the module warns that its home may move; the API is stable
  warnings.simplefilter("ignore", DeprecationWarning)
  from jax.experimental.pallas.ops.gpu import decode_attention as _pallas_decode

ATTENTION_BACKENDS = ("xla", "pallas")
SLOT_MULTIPLE = 16  # the kernel's smallest block: cache buckets are multiples of it


def split_plan(num_slots: int) -> tuple[int, int]:
  """(k_splits, block_k) for a cache of `num_slots`: as many parallel ranges as possible (up
  to 16, each >= 16 slots), then the largest block (<= 128) that tiles a range."""
  if num_slots % SLOT_MULTIPLE:
    raise ValueError(f"decode attention needs a cache of a multiple of {SLOT_MULTIPLE} slots, "
                     f"got {num_slots}")
  k_splits = next(s for s in (16, 8, 4, 2, 1)
                  if num_slots % (s * SLOT_MULTIPLE) == 0 and num_slots // s >= SLOT_MULTIPLE)
  split = num_slots // k_splits
  block_k = next(b for b in (128, 64, 32, 16) if split % b == 0)
  return k_splits, block_k


def decode_attention(q_BNH, keys_BKSH, values_BKSH, lengths_B, *, interpret: bool = False):
  """softmax(q k^T / sqrt(H)) v over the first `lengths_B[b]` slots of each sequence's cache.

  q_BNH: one query per sequence, N = K * G heads in KV-group order; keys/values [B, K, S, H]
  as jspec stores them; lengths_B >= 1. Returns [B, N, H] in q's dtype.
  """
  k_splits, block_k = split_plan(keys_BKSH.shape[2])
  num_heads = q_BNH.shape[1]
  # The kernel takes [B, S, K, H] and swaps it back to [B, K, S, H] itself: XLA folds the two
  # transposes, so the cache is read in place.
  return _pallas_decode.gqa(
      q_BNH, jnp.swapaxes(keys_BKSH, 1, 2), jnp.swapaxes(values_BKSH, 1, 2),
      kv_seq_len=lengths_B.astype(jnp.int32), k_splits=k_splits, block_k=block_k,
      block_h=max(16, min(64, num_heads // keys_BKSH.shape[1])), interpret=interpret)


def sharded_decode_attention(mesh: Mesh, rules: ShardingRules, interpret: bool = False):
  """`decode_attention` per shard of `mesh`, laid out by `rules` (the target's, or a draft's
  without tp): global arrays in and out."""
  q = rules.spec(("batch", "q_heads", "head_dim"))
  cache = rules.spec(("batch", "kv_heads", "cache_seq", "head_dim"))
  lengths = rules.spec(("batch",))
  return jax.shard_map(functools.partial(decode_attention, interpret=interpret), mesh=mesh,
                       in_specs=(q, cache, cache, lengths), out_specs=q, check_vma=False)
