"""How attention layers multiply a few rows by their projection weights (LLM(projection_backend)).

  "xla"     XLA's dot everywhere.
  "pallas"  jspec.pallas_kernels.skinny_gemm wherever it takes the shapes (<= 64 rows: decode,
            verify and draft steps; interpreted off GPU), XLA's dot for prefill.
  "auto"    on Hopper, the products XLA's GPU compiler would rewrite into a multiply and a
            reduction (one row, operands under 10 M elements: e.g. a 2048 x 4096 projection in
            a batch-1 decode step) as two-row GEMMs (skinny_gemm.ONE_ROW; the kernel before
            2026-11-28); XLA's dot elsewhere and on other devices.

The kernel needs the weights whole on every shard: with tensor parallelism over heads or the
hidden size, "auto" keeps XLA's dot and "pallas" is refused.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jspec.models.linear import E4m3Rows
from jspec.sharding.rules import ShardingRules, axis_size

PROJECTION_BACKENDS = ("auto", "xla", "pallas")


def weights_replicated(mesh: Mesh, rules: ShardingRules) -> bool:
  return all(axis_size(mesh, getattr(rules, name)) == 1
             for name in ("embed", "q_heads", "kv_heads", "head_dim", "mtp_concat"))


def sharded_projection(mesh: Mesh, rules: ShardingRules, always: bool):
  """(x [B, T, K], w [K, N]) -> [B, T, N] per batch shard, w replicated: no collective."""
  from jspec.pallas_kernels.skinny_gemm import project
  x = rules.spec(("batch", "seq", None))
  return jax.shard_map(functools.partial(project, always=always), mesh=mesh,
                       in_specs=(x, PartitionSpec()), out_specs=x, check_vma=False)


class Fp8Projection:
  """The FP8 products of one mesh's layers: called as (x [B, T, K], w8 [N, K], scale [N/128,
  K/128], optional lanes: the scale repeated by fp8_gemm.scale_lanes) -> [B, T, N], and
  `many` for several weights of one x (q, k, v): a tuple of [B, T, N_i], in one kernel call
  where the step's rows fit the few-row kernel (fp8_gemm.fp8_matmul_many). `sum_apart`
  (keyword): fp8_gemm.fp8_matmul's, False where the product's consumer is elementwise."""

  takes_e4m3 = True  # x may be a norm's linear.E4m3Rows (`e4m3`)

  def __init__(self, one, many, e4m3=None):
    self._one, self._many, self._e4m3 = one, many, e4m3

  def __call__(self, x_BTK, w8_NK, scale, lanes=None, *, sum_apart: bool = True):
    if isinstance(x_BTK, E4m3Rows):
      return self._e4m3[sum_apart](x_BTK, w8_NK, scale, lanes)
    return self._one[sum_apart](x_BTK, w8_NK, scale, lanes)

  def many(self, x_BTK, w8s_NK, scales, lanes=None, *, sum_apart: bool = True):
    return self._many[sum_apart](x_BTK, tuple(w8s_NK), tuple(scales),
                                 tuple(lanes or (None,) * len(w8s_NK)))


def fp8_product(x_BTK, w8_NK, scale, lanes=None, sum_apart=True, *, block):
  """One shard's x [.., K] times an FP8 weight [N, K] with its block scales (as
  sharded_fp8_projection takes them): the few-row kernel for up to 64 rows, the prefill kernel
  past that, another block size scaled before XLA's dot; [.., N] in x's dtype."""
  from jspec.models.linear import project
  from jspec.pallas_kernels import fp8_gemm, fp8_prefill
  *lead, k = x_BTK.shape
  rows, n = math.prod(lead), w8_NK.shape[0]
  if fp8_gemm.fits_kernel(rows, k, n, block):
    return fp8_gemm.fp8_matmul(x_BTK.reshape(rows, k), w8_NK, scale, lanes_NbX=lanes,
                               sum_apart=sum_apart).reshape(*lead, n)
  if fp8_prefill.fits_kernel(k, n, block):
    return fp8_prefill.fp8_prefill_matmul(x_BTK.reshape(rows, k), w8_NK,
                                          scale).reshape(*lead, n)
  return project(x_BTK, w8_NK, scale, "", fp8_block=block)  # scaled, then XLA's dot


def fp8_products(x_BTK, w8s_NK, scales, lanes=None, sum_apart=True, *, block):
  """fp8_product of one x with several weights of its K: one few-row kernel call where it
  takes them all; a tuple of [.., N_i]."""
  from jspec.pallas_kernels import fp8_gemm
  *lead, k = x_BTK.shape
  rows = math.prod(lead)
  lanes = lanes or (None,) * len(w8s_NK)
  if all(fp8_gemm.fits_kernel(rows, k, w.shape[0], block) for w in w8s_NK):
    outs = fp8_gemm.fp8_matmul_many(x_BTK.reshape(rows, k), tuple(w8s_NK), tuple(scales),
                                    lanes_NbX=tuple(lanes), sum_apart=sum_apart)
    return tuple(out.reshape(*lead, -1) for out in outs)
  return tuple(fp8_product(x_BTK, w, s, l, sum_apart, block=block)
               for w, s, l in zip(w8s_NK, scales, lanes))


def sharded_fp8_projection(mesh: Mesh, rules: ShardingRules,
                           block: tuple[int, int]) -> Fp8Projection:
  """The FP8 products per batch shard, the FP8 weights and their scales replicated, with 128 x
  128 blocks: jspec.pallas_kernels.fp8_gemm for steps of up to 64 rows (the activations as
  they are, read-bound), jspec.pallas_kernels.fp8_prefill past that (prefill chunks, wide
  verify windows: e4m3 activations on the FP8 tensor cores, the checkpoints' "dynamic"
  activation scheme); another block size: the weight multiplied by its scale before XLA's
  dot."""
  from jspec.pallas_kernels import fp8_gemm
  product = functools.partial(fp8_product, block=block)
  products = functools.partial(fp8_products, block=block)

  def product_e4m3(x: E4m3Rows, w8_NK, scale, lanes=None, sum_apart=True):
    """The product of a norm's e4m3 rows (the few-row kernel's e4m3 route), in x's dtype."""
    *lead, k = x.shape
    rows, n = math.prod(lead), w8_NK.shape[0]
    if not fp8_gemm.fits_kernel(rows, k, n, block):
      return product(x.values, w8_NK, scale, lanes, sum_apart)
    return fp8_gemm.fp8_matmul(x.x8.reshape(rows, k), w8_NK, scale, lanes_NbX=lanes,
                               sum_apart=sum_apart, act_lanes_X=x.lanes[0],
                               out_dtype=x.dtype).reshape(*lead, n)

  x, whole = rules.spec(("batch", "seq", None)), PartitionSpec()

  def per_shard(fn, x_spec=x):  # a shard_map per value of sum_apart (static in the kernel call)
    # A None lanes argument is an empty pytree: one shard_map takes the products with or
    # without.
    return {apart: jax.shard_map(functools.partial(fn, sum_apart=apart), mesh=mesh,
                                 in_specs=(x_spec, whole, whole, whole), out_specs=x,
                                 check_vma=False)
            for apart in (True, False)}

  return Fp8Projection(per_shard(product), per_shard(products),
                       per_shard(product_e4m3, e4m3_rows_spec(rules)))


def e4m3_rows_spec(rules: ShardingRules) -> E4m3Rows:
  """The partition of a linear.E4m3Rows: its rows as the activations', its lanes one row per
  batch shard."""
  x = rules.spec(("batch", "seq", None))
  return E4m3Rows(x, x, rules.spec(("batch", None)))


def with_loop_constants(module):
  """`module` (merged inside a traced program) with the values its steps would otherwise
  recompute, computed here, before a loop of steps, so that they are constants of the loop:

  - each layer whose FP8 projections go to the kernel (`fp8_projection` or, split over tp,
    `fp8_tp` set) gets its block scales repeated over the kernel's lanes (`fp8_lanes`, by
    weight name; read in linear.project_named), and each MoE layer whose FP8 experts go to
    the expert kernels its experts' (`fp8_expert_lanes`: a decode step's kernel then reads
    its slots' scales where they lie, not a gather and repeat of them in every step);
  - on the CPU, a decoder with a tied embedding gets its lm_head as [D, V] float32
    (`tied_head_DV`, read in Decoder.logits). XLA's CPU dot wants that layout and type; left
    to the step, it is converted and transposed inside the loop, and in the continuous
    loop's nested while loops the hoisting stops one loop short: on the demo model three
    transposes and copies of it, about 40 ms, in every round. On a GPU the bf16 table is read
    as it is."""
  from flax import nnx
  from jspec.pallas_kernels import fp8_gemm, platform
  if module is None:
    return module
  on_cpu = not platform.on_gpu()
  for _, node in nnx.iter_graph(module):
    cfg = getattr(node, "cfg", None)
    if on_cpu and getattr(cfg, "tie_word_embeddings", False) and hasattr(node, "embed") and (
        hasattr(node, "logits")):
      node.tied_head_DV = node.embed[...].astype(jnp.float32).T
    if getattr(node, "fp8_to_backend", False):
      node.fp8_expert_lanes = tuple(fp8_gemm.scale_lanes(scale[...]) for scale in (
          node.w_gate_scale, node.w_up_scale, node.w_down_scale))
    if getattr(node, "fp8_projection", None) is None and getattr(node, "fp8_tp", None) is None:
      continue
    node.fp8_lanes = {
        name.removesuffix("_scale"): fp8_gemm.scale_lanes(value[...])
        for name, value in vars(node).items()
        if name.endswith("_scale") and isinstance(value, nnx.Variable)}
  return module
