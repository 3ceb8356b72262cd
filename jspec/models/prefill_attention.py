"""Attention for prefill chunks through a fused flash-attention kernel (cuDNN on a GPU).

Why: XLA runs a chunk's attention as two batched products with the float32 scores
[B, N, T, S] written out between them, against every slot of the prompt's bucket. On an H100
a 4096-token prompt in the default chunks of 256 spent 148 ms of its 277 ms there (Qwen3-8B
shapes); cuDNN's fused kernel, which never writes the scores, took 77 ms for the same chunks
(BENCHMARKS.md, "Prefill attention through cuDNN's fused kernel").

What it computes is exactly `Attention._attend`'s XLA path: query t of sequence b, at
position p, sees the cache slots j <= p of the first `kv_window`; the chunk's own keys and
values are already written there. The positions come in as a boolean mask (a chunk of a long
prompt starts mid-cache, where a causal mask aligned at slot 0 would be wrong); fully masked
rows cannot occur, since every position sees slot 0. Off the GPU, and for dtypes cuDNN does
not take (float32), the same call runs through XLA's implementation of
`jax.nn.dot_product_attention`, which the CPU tests check against NumPy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec.sharding.rules import ShardingRules

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 256  # on Hopper (128 before it)


def fits_cudnn(head_dim: int, hopper: bool) -> bool:
  """Whether cuDNN's flash attention takes heads of this width (a multiple of 8, at most 256
  on Hopper and 128 before)."""
  return head_dim % 8 == 0 and head_dim <= (CUDNN_MAX_HEAD_DIM if hopper else 128)


def prefill_attention(q_BTNH, keys_BKSH, values_BKSH, positions_BT, *, implementation: str):
  """Causal attention of a chunk's queries [B, T, N, H] (N = K * G heads in KV-group order)
  against the cache's first S slots [B, K, S, H], by position [B, T]. Returns [B, T, N, H]."""
  slots = keys_BKSH.shape[2]
  if implementation == "cudnn" and q_BTNH.dtype not in CUDNN_DTYPES:
    implementation = "xla"
  # cuDNN's layout is [B, S, K, H]: XLA transposes the window once per call (a few MB).
  keys_BSKH = jnp.swapaxes(keys_BKSH, 1, 2)
  values_BSKH = jnp.swapaxes(values_BKSH, 1, 2)
  visible_B1TS = (jnp.arange(slots)[None, None, :] <= positions_BT[:, :, None])[:, None]
  return jax.nn.dot_product_attention(q_BTNH, keys_BSKH, values_BSKH, mask=visible_B1TS,
                                      scale=q_BTNH.shape[-1] ** -0.5,
                                      implementation=implementation)


def sharded_prefill_attention(mesh: Mesh, rules: ShardingRules, implementation: str):
  """`prefill_attention` per shard of `mesh`, laid out as the caches are (sequences over the
  batch axes, heads over tp): a custom call XLA cannot partition itself, and no collective
  is needed."""
  q = rules.spec(("batch", "seq", "q_heads", "head_dim"))
  cache = rules.spec(("batch", "kv_heads", "cache_seq", "head_dim"))
  positions = rules.spec(("batch", "seq"))
  return jax.shard_map(functools.partial(prefill_attention, implementation=implementation),
                       mesh=mesh, in_specs=(q, cache, cache, positions), out_specs=q,
                       check_vma=False)
