"""Attention for decode and verify steps through JAX's Pallas GPU flash-decoding kernel
(`jax.experimental.pallas.ops.gpu.decode_attention.gqa`).

Why: XLA runs decode attention as batched matrix-vector products over the whole cache bucket,
~1.7 TB/s on an H200 at context 8192 (BENCHMARKS.md). The kernel splits each (sequence, KV
head)'s slots into `k_splits` ranges processed in parallel and stops each range at the
sequence's length, so only valid slots are read. A step of T new tokens (1 for decode, k+1 for
verify and draft extend) attends to the cached prefix through the kernel and to itself in
XLA, and the two softmaxes are merged. Selected with `LLM(attention_backend="pallas")` for
steps of at most 64 query rows per KV head; wider prefill chunks go through cuDNN's fused
attention (jspec.models.prefill_attention).

The kernel is not partitionable by XLA, so it runs under `shard_map`: sequences split over the
batch axes, heads over tp, exactly as the cache is stored; no collective is needed. MLA layers
(jspec.models.mla) take jspec.pallas_kernels.mla_decode the same way (`sharded_mla_decode`).
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

# "auto": the Pallas kernels on a Hopper GPU (where they were measured), XLA elsewhere.
ATTENTION_BACKENDS = ("auto", "xla", "pallas")
SLOT_MULTIPLE = 16  # the kernel's smallest block of slots (Triton's dot needs 16 rows)


def split_plan(num_slots: int) -> tuple[int, int]:
  """(k_splits, block_k) for a cache of `num_slots`: the largest block (<= 128 slots) that
  tiles the cache, then the fewest splits, each a whole number of blocks, that give at least
  16 parallel ranges per (sequence, KV head) -- one per block when there are fewer blocks.

  The splits need not be a power of two: a capped bucket such as 8320 slots (65 blocks of
  128) is split 65 ways rather than falling back to one range of 16-slot blocks, which left
  most of the GPU idle.
  """
  if num_slots % SLOT_MULTIPLE:
    raise ValueError(f"decode attention needs a cache of a multiple of {SLOT_MULTIPLE} slots, "
                     f"got {num_slots}")
  block_k = next(b for b in (128, 64, 32, 16) if num_slots % b == 0)
  blocks = num_slots // block_k
  k_splits = next(d for d in range(min(blocks, 16), blocks + 1) if blocks % d == 0)
  return k_splits, block_k


MAX_ROWS_PER_KV_HEAD = 64  # G x T query rows the kernel holds at once; wider calls use XLA


def _rows_block(rows: int) -> int:
  """Triton blocks are powers of two, and its dot needs >= 16 rows (padding rows are masked)."""
  return max(16, 1 << (rows - 1).bit_length())


def window_attention(q_BTNH, k_BTKH, v_BTKH, keys_BKSH, values_BKSH, start_B, *,
                     interpret: bool = False):
  """Causal attention of T new tokens at positions start .. start+T-1 of each sequence.

  The cached prefix (slots < start) goes through the kernel, which reads only those slots and
  returns its softmax statistics; the window attends to itself causally, from the new keys
  and values (k_BTKH, v_BTKH, already written to the cache); the two are merged exactly, as
  flash attention merges blocks. q_BTNH has N = K * G heads in KV-group order; the cache is
  [B, K, S, H]. Returns [B, T, N, H] in q's dtype.
  """
  b, t, n, h = q_BTNH.shape
  kv_heads = keys_BKSH.shape[1]
  group = n // kv_heads
  k_splits, block_k = split_plan(keys_BKSH.shape[2])
  # Rows of one KV head contiguous: (head, token) -> head * T + token, so the kernel sees G*T
  # query rows per KV head, all with the same prefix.
  q_BRH = q_BTNH.transpose(0, 2, 1, 3).reshape(b, n * t, h)
  # The kernel takes [B, S, K, H] and swaps it back to [B, K, S, H] itself: XLA folds the two
  # transposes, so the cache is read in place.
  prefix_BRH, (sum_BR, max_BR) = _pallas_decode.gqa(
      q_BRH, jnp.swapaxes(keys_BKSH, 1, 2), jnp.swapaxes(values_BKSH, 1, 2),
      kv_seq_len=start_B.astype(jnp.int32), k_splits=k_splits, block_k=block_k,
      block_h=_rows_block(group * t), normalize_output=False, return_residuals=True,
      interpret=interpret)
  prefix_BKGTH = prefix_BRH.reshape(b, kv_heads, group, t, h).astype(jnp.float32)
  prefix_sum_BKGT = sum_BR.reshape(b, kv_heads, group, t)
  prefix_max_BKGT = max_BR.reshape(b, kv_heads, group, t)

  q_BKGTH = q_BTNH.transpose(0, 2, 1, 3).reshape(b, kv_heads, group, t, h)
  scores_BKGTU = jnp.einsum("bkgth,bukh->bkgtu", q_BKGTH, k_BTKH,
                            preferred_element_type=jnp.float32) * (h ** -0.5)
  causal_TU = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  scores_BKGTU = jnp.where(causal_TU, scores_BKGTU, -jnp.inf)
  top_BKGT = jnp.maximum(prefix_max_BKGT, scores_BKGTU.max(axis=-1))
  prefix_scale_BKGT = jnp.exp(prefix_max_BKGT - top_BKGT)
  probs_BKGTU = jnp.exp(scores_BKGTU - top_BKGT[..., None])
  total_BKGT = prefix_sum_BKGT * prefix_scale_BKGT + probs_BKGTU.sum(axis=-1)
  window_BKGTH = jnp.einsum("bkgtu,bukh->bkgth", probs_BKGTU, v_BTKH.astype(jnp.float32))
  out_BKGTH = (prefix_BKGTH * prefix_scale_BKGT[..., None] + window_BKGTH) / total_BKGT[..., None]
  return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_BTNH.dtype)


def sharded_window_attention(mesh: Mesh, rules: ShardingRules, interpret: bool = False):
  """`window_attention` per shard of `mesh`, laid out by `rules` (the target's, or a draft's
  without tp): global arrays in and out, no collective."""
  q = rules.spec(("batch", "seq", "q_heads", "head_dim"))
  new = rules.spec(("batch", "seq", "kv_heads", "head_dim"))
  cache = rules.spec(("batch", "kv_heads", "cache_seq", "head_dim"))
  start = rules.spec(("batch",))
  return jax.shard_map(functools.partial(window_attention, interpret=interpret), mesh=mesh,
                       in_specs=(q, new, new, cache, cache, start), out_specs=q,
                       check_vma=False)


# q and the output token by token through the short-context kernel (its `token_major`): no
# transposes around a verify window's call. False: the rows regrouped by KV head around it.
TOKEN_MAJOR = True


def sharded_short_attention(mesh: Mesh, rules: ShardingRules, interpret: bool = False):
  """jspec.pallas_kernels.short_attention per shard of `mesh`: (q [B, T, N, H], the cache's
  keys and values [B, K, S, H] with the step's rows written, first positions [B], copies=1,
  quantize=False) -> [B, copies x T, N, H], tokens c x T .. the c-th copy of the T outputs (the
  kernel's `copies`). q goes in and the output comes out as they are, token by token (the
  kernel's `token_major`; TOKEN_MAJOR off: regrouped by KV head around the kernel). quantize
  (the query heads whole on every shard): a linear.E4m3Rows, the output with its e4m3 rows
  [B, T, N x H] and their lanes (the kernel's `quantize`), for o_proj's FP8 product."""
  from jspec.models.linear import E4m3Rows
  from jspec.models.projections import e4m3_rows_spec
  from jspec.pallas_kernels.short_attention import short_attention
  q = rules.spec(("batch", "seq", "q_heads", "head_dim"))
  cache = rules.spec(("batch", "kv_heads", "cache_seq", "head_dim"))
  rows_spec = e4m3_rows_spec(rules)
  e4m3_spec = E4m3Rows(q, rows_spec.x8, rows_spec.lanes)

  def per_shard(q_BTNH, keys_BKSH, values_BKSH, start_B, copies: int, quantize: bool):
    b, t, n, h = q_BTNH.shape
    k = keys_BKSH.shape[1]
    g = n // k
    if TOKEN_MAJOR:  # a step's q and o_proj's input as they are
      q_BRH = q_BTNH.reshape(b, t * n, h)
    else:
      q_BRH = q_BTNH.reshape(b, t, k, g, h).transpose(0, 2, 1, 3, 4).reshape(b, k * t * g, h)
    out_CBRH = short_attention(q_BRH, keys_BKSH, values_BKSH, start_B, group=g,
                               scale=h ** -0.5, copies=copies, interpret=interpret,
                               quantize=quantize, token_major=TOKEN_MAJOR)
    if quantize:  # written token by token either way
      out_BRH, x8, lanes = out_CBRH
      return E4m3Rows(out_BRH.reshape(b, t, n, h), x8.reshape(b, t, n * h), lanes[None])
    if TOKEN_MAJOR:
      return out_CBRH.reshape(copies, b, t, n, h).transpose(1, 0, 2, 3, 4).reshape(
          b, copies * t, n, h)
    return out_CBRH.reshape(copies, b, k, t, g, h).transpose(1, 0, 3, 2, 4, 5).reshape(
        b, copies * t, n, h)

  def call(q_BTNH, keys_BKSH, values_BKSH, start_B, copies: int = 1, quantize: bool = False):
    return jax.shard_map(functools.partial(per_shard, copies=copies, quantize=quantize),
                         mesh=mesh, in_specs=(q, cache, cache, rules.spec(("batch",))),
                         out_specs=e4m3_spec if quantize else q,
                         check_vma=False)(q_BTNH, keys_BKSH, values_BKSH, start_B)
  return call


def resolve_attention_backend(backend: str) -> str:
  """"auto" -> "pallas" on a Hopper GPU, else "xla"; the others as they are."""
  from jspec.pallas_kernels import platform
  if backend == "auto":
    return "pallas" if platform.on_hopper() else "xla"
  return backend


def sharded_mla_decode(mesh: Mesh, rules: ShardingRules, latent_dim: int, scale: float,
                       interpret: bool = False):
  """jspec.pallas_kernels.mla_decode per shard of `mesh`: (q [B,T,N,L], the latent cache
  [B,S,L], positions [B,T]) -> the latent context [B,T,N,C]. Sequences split over the batch
  axes, query heads over tp, the latent whole on every tp shard (as MLACache is stored)."""
  from jspec.models.caches import MLACache
  from jspec.pallas_kernels.mla_decode import mla_decode
  q = rules.spec(("batch", "seq", "q_heads", "latent"))
  kernel = functools.partial(mla_decode, latent_dim=latent_dim, scale=scale,
                             interpret=interpret)
  return jax.shard_map(kernel, mesh=mesh,
                       in_specs=(q, rules.spec(MLACache.AXES), rules.spec(("batch", "seq"))),
                       out_specs=q, check_vma=False)


def grouped_attention(num_kv_heads: int, q_BTNH, cache_k, cache_v, visible_BTS, kv_window: int):
  """XLA's GQA attention of q over the first `kv_window` slots of the cache's keys and values
  [B, K, S, H] where `visible_BTS` [B, T, S] allows (jspec.models.layers.Attention's)."""
  b, t, n, h = q_BTNH.shape
  group = n // num_kv_heads
  keys_BKSH, values_BKSH = cache_k[:, :, :kv_window], cache_v[:, :, :kv_window]
  q_BKGTH = q_BTNH.reshape(b, t, num_kv_heads, group, h).transpose(0, 2, 3, 1, 4)
  scores_BKGTS = jnp.einsum("bkgth,bksh->bkgts", q_BKGTH, keys_BKSH,
                            preferred_element_type=jnp.float32) * (h ** -0.5)
  scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, -jnp.inf)
  probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(values_BKSH.dtype)
  out_BKGTH = jnp.einsum("bkgts,bksh->bkgth", probs_BKGTS, values_BKSH)
  return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
