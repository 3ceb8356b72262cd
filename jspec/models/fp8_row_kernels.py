"""The row kernels that read an FP8 product's K-slice partials as they are (LLM(norm_backend),
as jspec.models.row_kernels), per shard: one few-row FP8 kernel call (fp8_gemm.fp8_partials_many)
whose partials go straight into the kernel after it, so that their sum is no kernel of its own.

  sharded_fp8_add_rms_norm   o_proj's or down_proj's partials into the residual add + RMSNorm
  sharded_fp8_qkv_norm_rope  q, k and v's partials into the q / k norms + RoPE (and the KV write)

The norm's output may go on in e4m3 (linear.E4m3Rows), quantized by the norm's kernel, into the
FP8 products after it: the few-row kernel's e4m3 route with no pass of its own.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, PartitionSpec

from jspec.models.linear import E4m3Rows
from jspec.models.projections import e4m3_rows_spec
from jspec.models.row_kernels import sharded_kv_write
from jspec.sharding.rules import ShardingRules, mesh_axes


def sharded_fp8_add_rms_norm(mesh: Mesh, rules: ShardingRules, interpret: bool):
  """(x [B, T, K] (or its e4m3 rows, linear.E4m3Rows), w8 [D, K], its block scale, the scale's
  kernel lanes or None, residual [B, T, D], norm scale [D]; eps, zero_centered, quantize) ->
  (h, norm(h)) for h = residual + x @ w: one FP8 kernel call (fp8_gemm.fp8_partials_many, rows
  first) whose K-slice partials the residual add and RMSNorm kernel sums as it reads them
  (residual_norm.add_partials_rms_norm). Per batch shard, the weight whole on every shard (as
  the FP8 products run). quantize: norm(h) as a linear.E4m3Rows, its e4m3 form written by the
  same kernel."""
  from jspec.pallas_kernels.fp8_gemm import fp8_partials_many
  from jspec.pallas_kernels.residual_norm import add_partials_rms_norm
  rows, whole = rules.spec(("batch", "seq", None)), PartitionSpec()

  def per_shard(x_BTK, w8, scale, lanes, residual_BTD, scale_D, *, eps, zero_centered,
                quantize):
    b, t, d = residual_BTD.shape
    if isinstance(x_BTK, E4m3Rows):  # quantized by the kernel before (the attention's)
      parts_SRD, row_scale_M = fp8_partials_many(x_BTK.x8.reshape(b * t, -1), (w8,), (scale,),
                                                 (lanes,), rows_first=True,
                                                 act_lanes_X=x_BTK.lanes[0])
    else:
      parts_SRD, row_scale_M = fp8_partials_many(x_BTK.reshape(b * t, -1), (w8,), (scale,),
                                                 (lanes,), rows_first=True)
    h, normed, *quantized = add_partials_rms_norm(
        residual_BTD.reshape(b * t, d), parts_SRD, scale_D, row_scale_M, dtype=x_BTK.dtype,
        eps=eps, zero_centered=zero_centered, interpret=interpret, quantize=quantize)
    h, normed = h.reshape(b, t, d), normed.reshape(b, t, d)
    if not quantize:
      return h, normed
    x8, act_lanes = quantized
    return h, E4m3Rows(normed, x8.reshape(b, t, d), act_lanes[None])

  @functools.cache
  def for_norm(eps, zero_centered, quantize, e4m3_x):
    return jax.shard_map(
        functools.partial(per_shard, eps=eps, zero_centered=zero_centered, quantize=quantize),
        mesh=mesh, in_specs=(e4m3_rows_spec(rules) if e4m3_x else rows, whole, whole, whole,
                             rows, whole),
        out_specs=(rows, e4m3_rows_spec(rules) if quantize else rows), check_vma=False)

  def call(x, w8, scale, lanes, residual, scale_D, *, eps, zero_centered, quantize=False):
    return for_norm(eps, zero_centered, quantize, isinstance(x, E4m3Rows))(
        x, w8, scale, lanes, residual, scale_D)

  return call


def sharded_fp8_qkv_norm_rope(mesh: Mesh, rules: ShardingRules, eps: float, theta: float,
                              interpret: bool):
  """(x [B, T, D], (w8 [N_i, D] for q, k, v), their block scales, their scales' kernel lanes
  or None, positions [B, T], q and k norm scales [H] or None; q_heads, kv_heads static) ->
  (q [B, T, N, H], k, v [B, T, K, H]): one FP8 kernel call for q, k and v
  (fp8_gemm.fp8_partials_many) whose K-slice partials go straight into the q / k norm and
  RoPE kernel, which sums them as it reads them (row_norms.qkv_partials_norm_rope). Per batch
  shard, the weights whole on every shard (as the FP8 products run). With `caches` (keys,
  values [B, K, S, H]): k and v written into them instead, (q, keys, values), by the same
  kernel where the cache's KV heads are whole on every shard (else by kv_write's)."""
  from jspec.pallas_kernels.fp8_gemm import fp8_partials_many
  from jspec.pallas_kernels.row_norms import qkv_partials_norm_rope
  x = rules.spec(("batch", "seq", None))
  heads = rules.spec(("batch", "seq", None, None))
  positions = rules.spec(("batch", "seq"))
  cache = rules.spec(("batch", "kv_heads", "cache_seq", "head_dim"))
  whole = PartitionSpec()
  kv_split = any(mesh.shape[a] > 1 for a in mesh_axes(rules.kv_heads))
  write = sharded_kv_write(mesh, rules, interpret)

  def per_shard(x_BTD, w8s, scales, lanes, positions_BT, q_scale, k_scale, caches=None, *,
                q_heads, kv_heads):
    b, t, d = x_BTD.shape
    if isinstance(x_BTD, E4m3Rows):  # quantized by the norm's kernel
      parts_SNR, row_scale_M = fp8_partials_many(x_BTD.x8.reshape(b * t, d), w8s, scales,
                                                 lanes, act_lanes_X=x_BTD.lanes[0])
    else:
      parts_SNR, row_scale_M = fp8_partials_many(x_BTD.reshape(b * t, d), w8s, scales, lanes)
    q_out, *kv_out = qkv_partials_norm_rope(
        parts_SNR, positions_BT.reshape(b * t), row_scale_M, q_scale, k_scale,
        q_heads=q_heads, kv_heads=kv_heads, dtype=x_BTD.dtype, eps=eps, theta=theta,
        interpret=interpret, caches=caches)
    rows = lambda out: out.reshape(b, t, *out.shape[1:])
    return rows(q_out), *(kv_out if caches is not None else map(rows, kv_out))

  @functools.cache
  def for_heads(q_heads, kv_heads, cached: bool, e4m3: bool):
    return jax.shard_map(
        functools.partial(per_shard, q_heads=q_heads, kv_heads=kv_heads), mesh=mesh,
        in_specs=(e4m3_rows_spec(rules) if e4m3 else x, whole, whole, whole, positions, whole,
                  whole) + (((cache, cache),) if cached else ()),
        out_specs=(heads, cache, cache) if cached else (heads, heads, heads), check_vma=False)

  def call(x_BTD, w8s, scales, lanes, positions_BT, q_scale, k_scale, *, q_heads, kv_heads,
           caches=None):
    fused = caches is not None and not kv_split
    outs = for_heads(q_heads, kv_heads, fused, isinstance(x_BTD, E4m3Rows))(
        x_BTD, tuple(w8s), tuple(scales), None if lanes is None else tuple(lanes),
        positions_BT, q_scale, k_scale, *((tuple(caches),) if fused else ()))
    if caches is None or fused:
      return outs
    q_BTNH, k_BTKH, v_BTKH = outs  # whole KV heads a shard, the cache's split: kv_write's
    return q_BTNH, *write(*caches, k_BTKH, v_BTKH, positions_BT)

  return call
