"""The row kernels that read an FP8 product's K-slice partials as they are (LLM(norm_backend),
as jspec.models.row_kernels), per shard: one few-row FP8 kernel call (fp8_gemm.fp8_partials_many)
whose partials go straight into the kernel after it, so that their sum is no kernel of its own.

  sharded_fp8_add_rms_norm   o_proj's or down_proj's partials into the residual add + RMSNorm
  sharded_fp8_qkv_norm_rope  q, k and v's partials into the q / k norms + RoPE (and the KV write)
  sharded_fp8_swiglu         gate / up's partials into SwiGLU, quantized for down_proj

The norm's output may go on in e4m3 (linear.E4m3Rows), quantized by the norm's kernel, into the
FP8 products after it: the few-row kernel's e4m3 route with no pass of its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jspec.models.layers import Attention
from jspec.models.linear import QKV_NAMES, E4m3Rows, fp8_rows_fit, fp8_whole_blocks
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
  from jspec.pallas_kernels.residual_norm import add_partials_rms_norm
  rows, whole = rules.spec(("batch", "seq", None)), PartitionSpec()

  def per_shard(x_BTK, w8, scale, lanes, residual_BTD, scale_D, *, eps, zero_centered,
                quantize):
    b, t, d = residual_BTD.shape
    # x's e4m3 rows where the kernel before (the attention's) quantized them
    parts_SRD, row_scale_M = _partials(x_BTK, (w8,), (scale,), (lanes,), rows_first=True)
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


def takes_fp8_qkv_kernel(node) -> bool:
  """Whether an attention layer's q, k and v are one FP8 call whose partials the norm and RoPE
  kernel can read: the base class's projections (no output gate), no biases, not fused, the
  kernel's norms and RoPE, every KV head its own, whole 128 x 128 blocks."""
  if (node.fp8_projection is None or type(node)._project is not Attention._project
      or not node.takes_qk_kernel() or node.has_bias or node.fused_qkv
      or node.kv_replicas != 1 or not fp8_whole_blocks(node, QKV_NAMES)):
    return False
  one_row = jax.ShapeDtypeStruct((1, node.q_proj.shape[-1]), jnp.float32)
  return fp8_rows_fit(node, one_row, QKV_NAMES)


def _partials(x_BTK, w8s, scales, lanes, **kwargs):
  """fp8_gemm.fp8_partials_many of x's rows, an E4m3Rows' as the kernel that wrote them
  quantized them."""
  from jspec.pallas_kernels.fp8_gemm import fp8_partials_many
  b, t, k = x_BTK.shape
  if isinstance(x_BTK, E4m3Rows):
    return fp8_partials_many(x_BTK.x8.reshape(b * t, k), w8s, scales, lanes,
                             act_lanes_X=x_BTK.lanes[0], **kwargs)
  return fp8_partials_many(x_BTK.reshape(b * t, k), w8s, scales, lanes, **kwargs)


def sharded_fp8_swiglu(mesh: Mesh, rules: ShardingRules, interpret: bool):
  """(x [B, T, D] or its E4m3Rows, w8 [2F, D] (gate's rows, then up's), its block scale, the
  scale's kernel lanes or None) -> silu(x @ gate) * (x @ up) as an E4m3Rows [B, T, F] for
  down_proj: one FP8 kernel call whose K-slice partials (rows first) the SwiGLU kernel sums,
  activates and quantizes (swiglu_e4m3). Per batch shard, the weight whole on every shard."""
  from jspec.pallas_kernels.swiglu_e4m3 import swiglu_e4m3
  rows, whole = rules.spec(("batch", "seq", None)), PartitionSpec()

  def per_shard(x_BTD, w8, scale, lanes):
    b, t, _ = x_BTD.shape
    parts_SRC, row_scale_M = _partials(x_BTD, (w8,), (scale,), (lanes,), rows_first=True)
    act, x8, act_lanes = swiglu_e4m3(parts_SRC, row_scale_M, rows=b * t, dtype=x_BTD.dtype,
                                     interpret=interpret)
    return E4m3Rows(act.reshape(b, t, -1), x8.reshape(b, t, -1), act_lanes[None])

  @functools.cache
  def for_input(e4m3_x):
    return jax.shard_map(per_shard, mesh=mesh,
                         in_specs=(e4m3_rows_spec(rules) if e4m3_x else rows, whole, whole,
                                   whole), out_specs=e4m3_rows_spec(rules), check_vma=False)

  return lambda x, w8, scale, lanes: for_input(isinstance(x, E4m3Rows))(x, w8, scale, lanes)


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
    parts_SNR, row_scale_M = _partials(x_BTD, w8s, scales, lanes)
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
