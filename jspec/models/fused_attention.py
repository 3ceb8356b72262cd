"""A decode step's q / k / v kernel that attends too (jspec.pallas_kernels.rope_attention): which
steps take it, and its call per shard inside the q / k / v kernels' shard_maps
(row_kernels.sharded_qkv_norm_rope's K-slice partials, fp8_row_kernels'
sharded_fp8_qkv_norm_rope).

Why: the step's q / k norms + RoPE + KV write were a kernel of their own before the
attention's, 2.1-2.6 µs a layer on an H200 for a few thousand values (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from jspec.models.linear import E4m3Rows, as_values
from jspec.sharding.rules import ShardingRules

# Whether decode steps whose q / k / v kernel writes the cache and whose attention the
# short-context kernel takes run both in one kernel (rope_attention). Off: the two kernels.
ROPE_ATTENTION = True


class Attended(NamedTuple):
  """What a q / k / v kernel that attended returns: the attention output [B, 1, N, H] (or its
  linear.E4m3Rows for o_proj's FP8 kernel) and the caches with the step's keys and values."""
  out: Any
  keys: jax.Array
  values: jax.Array


@dataclasses.dataclass(frozen=True)
class AttendStep:
  """How the kernel attends: quantize, its output in e4m3 too (short_attention's)."""
  quantize: bool


def attend_step(attn, x_BTD, cache, kv_window: int) -> AttendStep | None:
  """The settings for `attn`'s q / k / v kernel to attend in this step, or None where the two
  kernels run: one token a sequence, the short-context kernel taking the cache (kv_window and
  its slots), one copy of the output (no doubled tp row), a cache in the model's dtype. The
  caller has checked that the kernel writes the cache (Attention._writes_kv)."""
  from jspec.pallas_kernels import row_norms
  from jspec.pallas_kernels import short_attention as short_kernel
  b, t = x_BTD.shape[:2]
  heads, h = attn.num_heads, attn.head_dim
  q_like = jax.ShapeDtypeStruct((b, t, heads, h), as_values(x_BTD).dtype)
  if not (ROPE_ATTENTION and t == 1 and attn.short_attention is not None
          and kv_window <= short_kernel.MAX_SLOTS and row_norms.fits_heads(h)
          and short_kernel.fits_kernel(cache.keys.shape[2], h, heads // attn.num_kv_heads)
          and cache.keys.dtype == q_like.dtype == cache.values.dtype
          and not attn._doubles_row(q_like)):
    return None
  return AttendStep(quantize=attn._quantizes_out(q_like))


def out_specs(rules: ShardingRules, step: AttendStep) -> Attended:
  """An Attended's partition: the output as the attention's, the caches as stored."""
  from jspec.models.projections import e4m3_rows_spec
  q = rules.spec(("batch", "seq", "q_heads", "head_dim"))
  cache = rules.spec(("batch", "kv_heads", "cache_seq", "head_dim"))
  if step.quantize:
    rows = e4m3_rows_spec(rules)
    q = E4m3Rows(q, rows.x8, rows.lanes)
  return Attended(q, cache, cache)


def attend_shard(parts_SNR, row_scale_M, positions_BT, q_scale, k_scale, caches,
                 step: AttendStep, *, q_heads: int, kv_heads: int, fused_layout: bool, dtype,
                 eps: float, theta: float, interpret: bool) -> Attended:
  """One shard's rope_attention over its q / k / v partials (row_norms.qkv_partials_norm_rope's
  operands; positions [B, 1]), its output laid out as the attention's."""
  from jspec.pallas_kernels.rope_attention import rope_attention
  b = positions_BT.shape[0]
  out, keys, values = rope_attention(
      parts_SNR, positions_BT[:, 0], *caches, row_scale_M, q_scale, k_scale, q_heads=q_heads,
      kv_heads=kv_heads, dtype=dtype, eps=eps, theta=theta,
      scale=caches[0].shape[-1] ** -0.5, fused_layout=fused_layout, quantize=step.quantize,
      interpret=interpret)
  if step.quantize:
    values_BNH, x8, lanes = out
    out = E4m3Rows(values_BNH[:, None], x8[:, None], lanes[None])
  else:
    out = out[:, None]
  return Attended(out, keys, values)
