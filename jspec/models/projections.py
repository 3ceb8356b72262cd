"""How attention layers multiply a few rows by their projection weights (LLM(projection_backend)).

  "xla"     XLA's dot everywhere.
  "pallas"  jspec.pallas_kernels.skinny_gemm wherever it takes the shapes (<= 64 rows: decode,
            verify and draft steps; interpreted off GPU), XLA's dot for prefill.
  "auto"    on Hopper, the kernel for the products XLA's GPU compiler would rewrite into a
            multiply and a reduction (one row, operands under 10 M elements: e.g. a 2048 x 4096
            projection in a batch-1 decode step); XLA's dot elsewhere and on other devices.

The kernel needs the weights whole on every shard: with tensor parallelism over heads or the
hidden size, "auto" keeps XLA's dot and "pallas" is refused.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import Mesh, PartitionSpec

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


def sharded_fp8_projection(mesh: Mesh, rules: ShardingRules, block: tuple[int, int]):
  """(x [B, T, K], w8 [N, K], scale [N/128, K/128], optional lanes: the scale repeated by
  fp8_gemm.scale_lanes) -> [B, T, N] per batch shard, the FP8 weight and its scales
  replicated, with 128 x 128 blocks: jspec.pallas_kernels.fp8_gemm for steps of up to 64 rows
  (float16 activations, read-bound), jspec.pallas_kernels.fp8_prefill past that (prefill chunks,
  wide verify windows: e4m3 activations on the FP8 tensor cores, the checkpoints' "dynamic"
  activation scheme); another block size: the weight multiplied by its scale before XLA's dot."""
  from jspec.models.linear import project
  from jspec.pallas_kernels import fp8_gemm, fp8_prefill

  def product(x_BTK, w8_NK, scale, lanes=None):
    *lead, k = x_BTK.shape
    rows, n = math.prod(lead), w8_NK.shape[0]
    if fp8_gemm.fits_kernel(rows, k, n, block):
      return fp8_gemm.fp8_matmul(x_BTK.reshape(rows, k), w8_NK, scale,
                                 lanes_NbX=lanes).reshape(*lead, n)
    if fp8_prefill.fits_kernel(k, n, block):
      return fp8_prefill.fp8_prefill_matmul(x_BTK.reshape(rows, k), w8_NK,
                                            scale).reshape(*lead, n)
    return project(x_BTK, w8_NK, scale, "", fp8_block=block)  # scaled, then XLA's dot

  x, whole = rules.spec(("batch", "seq", None)), PartitionSpec()
  without_lanes = jax.shard_map(product, mesh=mesh, in_specs=(x, whole, whole), out_specs=x,
                                check_vma=False)
  with_lanes = jax.shard_map(product, mesh=mesh, in_specs=(x, whole, whole, whole),
                             out_specs=x, check_vma=False)
  return lambda x_BTK, w8_NK, scale, lanes=None: (
      without_lanes(x_BTK, w8_NK, scale) if lanes is None
      else with_lanes(x_BTK, w8_NK, scale, lanes))


def with_kernel_scales(module):
  """`module` (merged inside a traced program) with each layer whose FP8 projections go to the
  kernel (`fp8_projection` set) given their block scales repeated over the kernel's lanes
  (`fp8_lanes`, by weight name): computed here, before a loop of steps, they are constants of
  the loop instead of a repeat in every step. Layers read them in linear.project_named."""
  from flax import nnx
  from jspec.pallas_kernels import fp8_gemm
  if module is None:
    return module
  for _, node in nnx.iter_graph(module):
    if getattr(node, "fp8_projection", None) is None:
      continue
    node.fp8_lanes = {
        name.removesuffix("_scale"): fp8_gemm.scale_lanes(value[...])
        for name, value in vars(node).items()
        if name.endswith("_scale") and isinstance(value, nnx.Variable)}
  return module
