"""The row-wise steps of decode and verify steps in one kernel each (LLM(norm_backend)):
jspec.pallas_kernels.residual_norm's residual add + RMSNorm and jspec.pallas_kernels.row_norms'
q / k norms + RoPE, per shard.

  "xla"     XLA's fusions everywhere.
  "pallas"  the kernels for steps of up to MAX_ROWS rows (interpreted off GPU); XLA for
            prefill chunks and for shapes they do not take.
  "auto"    "pallas" on a GPU, "xla" elsewhere.

A step's new keys and values go into the KV cache through one kernel too
(jspec.pallas_kernels.kv_write), in place of XLA's two scatters, and a softmax MoE layer's
routing through two (jspec.pallas_kernels.router_topk) in place of XLA's eight. Where
jspec.models.mlp.SWIGLU_KERNEL is on, a dense MLP's gate / up product and SiLU x up are one
kernel (jspec.pallas_kernels.swiglu_gemm).

The kernels work on whole rows, so they run under `shard_map` with the rows split over the
batch axes as the activations are, and heads over tp for q and k; a norm whose width the mesh
splits keeps XLA's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jspec.sharding.rules import ShardingRules, axis_size

NORM_BACKENDS = ("auto", "xla", "pallas")
# The most rows (tokens of a step) that go to the kernels: decode, verify and draft steps.
# Prefill chunks keep XLA's fusions, which read their many rows at full bandwidth.
MAX_ROWS = 256
# A fused q / k / v product of QKV_SLICE_MIN_ROWS to QKV_SLICE_ROWS rows a shard (decode and
# verify steps) as QKV_K_SLICES K slices' float32 partials, which the q / k kernel sums as it
# reads them, on GPUs (qkv_k_slices): XLA's GEMM splits K at few rows there and adds the
# slices in a kernel of its own, a launch and a gap a layer. Measured on H200s (BENCHMARKS.md,
# 2026-11-30): Qwen3-8B at 8 rows 1.0-2.4% faster at tp = 2 and 0.5-1.0% on one GPU, at 4 rows
# (MTP k = 3, batch 1) equal; one row 0.5% slower at tp = 2 (its product is the one-row
# kernel's) and 32 rows 1.5% slower (Qwen3-30B-A3B, batch 32), so both keep one product
# there (one row on one GPU: below).
QKV_K_SLICES = 4
QKV_SLICE_MIN_ROWS = 2
# One row a shard takes the slices too where the mesh splits no KV heads (one GPU, dp): its
# one-row product is then XLA's (at Qwen3-30B-A3B's shapes cuBLAS's GEMM of the row padded to
# an 8-row tile), and the slices' batched product of the row twice made that model's step
# 2.6-3.5% faster on an H200, Qwen3-8B's equal (BENCHMARKS.md, "One row's q / k / v product
# as K slices on one GPU ..."). tp shards keep the 2-row minimum above.
QKV_SLICE_ONE_ROW_WHOLE_HEADS = True
QKV_SLICE_ROWS = 16
QKV_SLICE_K = 64  # each slice whole 64-row tiles of the weight


def resolve_norm_backend(backend: str) -> str:
  """"auto" -> "pallas" on a GPU, else "xla"; the others as they are (jspec.build's
  EngineOptions.check refuses any other name)."""
  from jspec.pallas_kernels import platform
  if backend == "auto":
    return "pallas" if platform.on_gpu() else "xla"
  return backend


def takes_rows(x, ndim: int, above: int = 0) -> bool:
  """Whether x is a [B, T, ...] activation of `ndim` axes with few enough rows for the
  kernels (and more than `above`)."""
  return x.ndim == ndim and above < x.shape[0] * x.shape[1] <= MAX_ROWS


def sharded_rms_norm(mesh: Mesh, rules: ShardingRules, eps: float, zero_centered: bool,
                     interpret: bool):
  """(x [B, T, D], scale [D], residual [B, T, D] or None; quantize) -> norm(x), or (x +
  residual, norm(x + residual)) with a residual; D whole on every shard. quantize (at most
  fp8_gemm.MAX_ROWS rows a shard): norm(...) as a linear.E4m3Rows, its e4m3 form written by
  the same kernel, each batch shard's scales one row of its lanes."""
  from jspec.models.linear import E4m3Rows
  from jspec.models.projections import e4m3_rows_spec
  from jspec.pallas_kernels.residual_norm import rms_norm
  rows = rules.spec(("batch", "seq", None))

  def per_shard(x_BTD, scale_D, residual_BTD, quantize):
    b, t, d = x_BTD.shape
    flat = lambda a: None if a is None else a.reshape(b * t, d)
    out = rms_norm(flat(x_BTD), scale_D, flat(residual_BTD), eps=eps,
                   zero_centered=zero_centered, interpret=interpret, quantize=quantize)
    out = [out] if residual_BTD is None and not quantize else list(out)
    if quantize:
      *out, x8, lanes = out
    out = [a.reshape(b, t, d) for a in out]  # (h,) norm(h)
    if quantize:
      out[-1] = E4m3Rows(out[-1], x8.reshape(b, t, d), lanes[None])
    return tuple(out) if residual_BTD is not None else out[0]

  @functools.cache
  def sharded(added: bool, quantize: bool):
    out = e4m3_rows_spec(rules) if quantize else rows
    if added:
      return jax.shard_map(functools.partial(per_shard, quantize=quantize), mesh=mesh,
                           in_specs=(rows, PartitionSpec(), rows), out_specs=(rows, out),
                           check_vma=False)
    return jax.shard_map(lambda x, s: per_shard(x, s, None, quantize), mesh=mesh,
                         in_specs=(rows, PartitionSpec()), out_specs=out, check_vma=False)

  def call(x, scale, residual=None, quantize: bool = False):
    if residual is None:
      return sharded(False, quantize)(x, scale)
    return sharded(True, quantize)(x, scale, residual)
  return call


def sharded_qk_norm_rope(mesh: Mesh, rules: ShardingRules, kv_axis: str | None, eps: float,
                         theta: float, interpret: bool):
  """(q [B, T, N, H], k [B, T, K, H], positions [B, T], q and k norm scales [H] or None) ->
  (q, k) normed and rotated; heads split over the mesh as the projections leave them
  (`kv_axis`: the keys' logical head axis, None where every shard computes all K heads)."""
  from jspec.pallas_kernels.row_norms import qk_norm_rope
  q = rules.spec(("batch", "seq", "q_heads", None))
  k = rules.spec(("batch", "seq", kv_axis, None))
  positions = rules.spec(("batch", "seq"))

  def per_shard(q_BTNH, k_BTKH, positions_BT, q_scale, k_scale):
    b, t, n, h = q_BTNH.shape
    q_out, k_out = qk_norm_rope(q_BTNH.reshape(b * t, n, h), k_BTKH.reshape(b * t, -1, h),
                                positions_BT.reshape(b * t), q_scale, k_scale, eps=eps,
                                theta=theta, interpret=interpret)
    return q_out.reshape(q_BTNH.shape), k_out.reshape(k_BTKH.shape)

  whole = PartitionSpec()
  return jax.shard_map(per_shard, mesh=mesh, in_specs=(q, k, positions, whole, whole),
                       out_specs=(q, k), check_vma=False)


def qkv_k_slices() -> int:
  """QKV_K_SLICES on a GPU, where XLA's GEMM splits K for few rows and sums the slices in a
  kernel of its own; 0 (one product) elsewhere."""
  from jspec.pallas_kernels import platform
  return QKV_K_SLICES if platform.on_gpu() else 0


def sharded_qkv_norm_rope(mesh: Mesh, rules: ShardingRules, eps: float, theta: float,
                          interpret: bool, k_slices: int = 0):
  """(x [B, T, D], qkv_proj [D, K, G + 2, H], product, positions [B, T], q and k norm scales
  [H] or None, caches=None) -> (q [B, T, N, H], k, v [B, T, K, H]): the fused q / k / v
  product's q and k normed and rotated and its v taken out, in one kernel
  (jspec.pallas_kernels.row_norms), KV heads split over the mesh as the product leaves them.
  The kernel reads `product(x)` ([B, T, K, G + 2, H]), or with `k_slices` and
  QKV_SLICE_MIN_ROWS to QKV_SLICE_ROWS rows a shard, x and the weight's product as that many
  K slices' float32 partials, which it sums as it reads them (one row a shard too where the
  mesh splits no KV heads: QKV_SLICE_ONE_ROW_WHOLE_HEADS). With `caches` (keys, values
  [B, K, S, H], laid out as the KV cache): k and v written into them at the positions
  instead, (q, keys, values)."""
  from jspec.pallas_kernels.row_norms import qkv_norm_rope, qkv_partials_norm_rope
  from jspec.sharding.tensor_parallel import k_slice_partials
  qkv = rules.spec(("batch", "seq", "kv_heads", None, None))
  q = rules.spec(("batch", "seq", "q_heads", None))
  kv = rules.spec(("batch", "seq", "kv_heads", None))
  x = rules.spec(("batch", "seq", None))
  cache = rules.spec(("batch", "kv_heads", "cache_seq", "head_dim"))
  # qkv_fusion.QKV_AXES with D and H whole, as they are where slices run (that module imports
  # this one's callers, so its name is not imported here)
  weight = rules.spec((None, "kv_heads", None, None))
  positions = rules.spec(("batch", "seq"))

  def outputs(outs, b, t, caches):
    q_out, *kv_out = outs
    q_out = q_out.reshape(b, t, -1, q_out.shape[-1])
    if caches is not None:
      return q_out, *kv_out
    return q_out, *(out.reshape(b, t, *out.shape[1:]) for out in kv_out)

  def per_shard(qkv_BTKCH, positions_BT, q_scale, k_scale, caches=None):
    b, t, k, c, h = qkv_BTKCH.shape
    return outputs(qkv_norm_rope(qkv_BTKCH.reshape(b * t, k, c, h),
                                 positions_BT.reshape(b * t), q_scale, k_scale, eps=eps,
                                 theta=theta, interpret=interpret, caches=caches), b, t, caches)

  def sliced_shard(x_BTD, w_DKCH, positions_BT, q_scale, k_scale, caches=None):
    (b, t, d), (_, k, c, h) = x_BTD.shape, w_DKCH.shape
    parts_SNR = k_slice_partials(x_BTD.reshape(b * t, d), w_DKCH.reshape(d, -1), k_slices,
                                 rows_last=True)
    return outputs(qkv_partials_norm_rope(
        parts_SNR, positions_BT.reshape(b * t), None, q_scale, k_scale, q_heads=k * (c - 2),
        kv_heads=k, group=c - 2, dtype=x_BTD.dtype, eps=eps, theta=theta,
        interpret=interpret, caches=caches), b, t, caches)

  whole = PartitionSpec()
  min_rows = (1 if QKV_SLICE_ONE_ROW_WHOLE_HEADS and axis_size(mesh, rules.kv_heads) == 1
              else QKV_SLICE_MIN_ROWS)

  @functools.cache
  def sharded(sliced: bool, cached: bool):
    inputs = (x, weight) if sliced else (qkv,)
    return jax.shard_map(sliced_shard if sliced else per_shard, mesh=mesh,
                         in_specs=(*inputs, positions, whole, whole) + (((cache, cache),)
                                                                        if cached else ()),
                         out_specs=(q, cache, cache) if cached else (q, kv, kv),
                         check_vma=False)

  def call(x_BTD, w_DKCH, product, positions_BT, q_scale, k_scale, caches=None):
    b, t = NamedSharding(mesh, x).shard_shape(x_BTD.shape)[:2]
    extra = () if caches is None else (tuple(caches),)
    if (k_slices > 1 and min_rows <= b * t <= QKV_SLICE_ROWS
        and x_BTD.shape[-1] % (k_slices * QKV_SLICE_K) == 0):
      return sharded(True, caches is not None)(x_BTD, w_DKCH, positions_BT, q_scale, k_scale,
                                               *extra)
    return sharded(False, caches is not None)(product(x_BTD), positions_BT, q_scale, k_scale,
                                              *extra)
  return call


def sharded_kv_write(mesh: Mesh, rules: ShardingRules, interpret: bool):
  """(keys, values [B, K, S, H], k, v [B, T, K, H], positions [B, T]) -> (keys, values) with
  the new rows written (jspec.pallas_kernels.kv_write), per shard: sequences over the batch
  axes and heads over tp, as the cache is stored (its slots and head_dim whole)."""
  from jspec.pallas_kernels.kv_write import write_kv
  cache = rules.spec(("batch", "kv_heads", "cache_seq", "head_dim"))
  rows = rules.spec(("batch", "seq", "kv_heads", "head_dim"))
  positions = rules.spec(("batch", "seq"))
  return jax.shard_map(functools.partial(write_kv, interpret=interpret), mesh=mesh,
                       in_specs=(cache, cache, rows, rows, positions), out_specs=(cache, cache),
                       check_vma=False)


def sharded_router(mesh: Mesh, rules: ShardingRules, top_k: int, norm: bool, interpret: bool):
  """(x [T, D], router [D, E]) -> (expert ids [T, K], weights [T, K]): softmax routing
  (jspec.pallas_kernels.router_topk) on each shard's own tokens, the router whole on every
  shard (the tokens split as jspec.sharding.moe.per_token_shard splits them). With plan=True
  (one token: batch-1 decode) also its decode plan, written by the top-k kernel
  (route_softmax_plan), the same on every shard."""
  from jspec.pallas_kernels.router_topk import route_softmax, route_softmax_plan
  tokens = rules.spec(("batch", None))
  whole = PartitionSpec()
  kernels = dict(top_k=top_k, norm=norm, interpret=interpret)
  plain = jax.shard_map(functools.partial(route_softmax, **kernels), mesh=mesh,
                        in_specs=(tokens, whole), out_specs=(tokens, tokens), check_vma=False)
  planned = jax.shard_map(functools.partial(route_softmax_plan, **kernels), mesh=mesh,
                          in_specs=(tokens, whole), out_specs=(tokens, tokens, whole),
                          check_vma=False)
  return lambda x_TD, router_DE, plan=False: (planned if plan else plain)(x_TD, router_DE)


def sharded_norm_router(mesh: Mesh, rules: ShardingRules, top_k: int, norm: bool,
                        interpret: bool):
  """(x [B, T, D], delta [B, T, D], scale [D], router [D, E]; eps, zero_centered, plan,
  quantize) -> (h, norm(h), routing): the residual add and RMSNorm before a MoE layer and its
  softmax routing, the norm and the router product in one kernel
  (jspec.pallas_kernels.norm_router), on each shard's own rows; routing as sharded_router's
  (ids and weights [B x T, K], and with `plan` the one token's decode plan). quantize: norm(h)
  as a linear.E4m3Rows, its e4m3 form written by the same kernel."""
  from jspec.models.linear import E4m3Rows
  from jspec.models.projections import e4m3_rows_spec
  from jspec.pallas_kernels.norm_router import add_norm_route_softmax
  rows = rules.spec(("batch", "seq", None))
  tokens = rules.spec(("batch", None))
  whole = PartitionSpec()

  def call(x_BTD, delta_BTD, scale_D, router_DE, *, eps: float, zero_centered: bool,
           plan: bool = False, quantize: bool = False):
    def per_shard(x, delta, scale, router):
      b, t, d = x.shape
      h, normed, routing, *quantized = add_norm_route_softmax(
          x.reshape(b * t, d), delta.reshape(b * t, d), scale, router, eps=eps,
          zero_centered=zero_centered, top_k=top_k, norm=norm, plan=plan, interpret=interpret,
          quantize=quantize)
      normed = normed.reshape(b, t, d)
      if quantize:
        x8, lanes = quantized
        normed = E4m3Rows(normed, x8.reshape(b, t, d), lanes[None])
      return h.reshape(b, t, d), normed, routing
    routing_spec = (tokens, tokens, whole) if plan else (tokens, tokens)
    normed_spec = e4m3_rows_spec(rules) if quantize else rows
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(rows, rows, whole, whole),
                         out_specs=(rows, normed_spec, routing_spec), check_vma=False)(
        x_BTD, delta_BTD, scale_D, router_DE)
  return call


def sharded_swiglu(mesh: Mesh, rules: ShardingRules, interpret: bool):
  """(x [B, T, D], w [D, 2, F]) -> silu(x @ w[:, 0]) * (x @ w[:, 1]) [B, T, F] through
  jspec.pallas_kernels.swiglu_gemm per shard: rows split as the activations are, F over the
  mesh's "mlp" axes as the weight is (D whole on every shard). A shard with more rows than
  the kernel takes gets XLA's product and activation."""
  from jspec.pallas_kernels.shared import silu_mul
  from jspec.pallas_kernels.swiglu_gemm import fits, swiglu_gemm

  def per_shard(x_BTD, w_DCF):
    b, t, d = x_BTD.shape
    if not fits(b * t, d, w_DCF.shape[2], x_BTD.dtype.itemsize):
      gate_up = jnp.einsum("btd,dcf->btcf", x_BTD, w_DCF)
      return silu_mul(gate_up[:, :, 0], gate_up[:, :, 1])
    return swiglu_gemm(x_BTD.reshape(b * t, d), w_DCF, interpret=interpret).reshape(b, t, -1)

  return jax.shard_map(per_shard, mesh=mesh,
                       in_specs=(rules.spec(("batch", "seq", None)),
                                 rules.spec((None, None, "mlp"))),
                       out_specs=rules.spec(("batch", "seq", "mlp")), check_vma=False)
