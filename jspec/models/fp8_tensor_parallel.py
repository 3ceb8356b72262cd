"""FP8 projections whose weights tp splits, each shard's share through the FP8 kernels.

Without this, a layer's FP8 weights split over tp took XLA's path: each step scaled its shard
of the weight into bf16 before XLA's dot, writing and reading the widened weight (a few-row
product 2-3x the bf16 one on an H200, BENCHMARKS.md, "FP8 block-scaled products"). Here, as
jspec.sharding.tensor_parallel does for bf16 weights, each product is a `shard_map` whose
shards multiply their share as it is stored, e4m3 with its 128 x 128 block scales
(jspec.models.projections.fp8_products: the few-row kernel for decode and verify steps, the
prefill kernel for chunks):

  column   x whole on every shard, the weights split over an output axis: q / k / v in one
           kernel call, MLA's q_b_proj, gate / up; no collective.
  row      x and the weight split over the contracted axis: each shard's partial product,
           then the tp products' one all-reduce (o_proj, down_proj); or, where the output
           goes to a residual add and norm (`defer`), the partials as a PartialSum, which
           that norm sums in its own kernel with the all-reduce, as bf16's row products (a
           MoE layer's norm + router kernel and a norm writing e4m3 rows sum it first and
           keep their kernels: PartialSum.optional).

  whole    x and the weights whole on every shard (MLA's q_a_proj and kv_a_proj, which tp
           does not split): each shard's rows by the whole weights, as one device's.

A shard's share must keep whole blocks: a split output axis of whole heads (the block on the
head's width) or of whole 128-column groups, a split input axis likewise (`takes`).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec

from jspec.models.linear import as_values, flat_grid, fp8_operands
from jspec.models.projections import fp8_product, fp8_products
from jspec.pallas_kernels import platform
from jspec.sharding.tensor_parallel import PartialSum, TensorParallelProducts

# On a Hopper GPU, layers whose FP8 weights tp splits take these products (the LLM's "auto"
# projection backend); False keeps XLA's path there, to time the two against each other.
ON_HOPPER = True


def block_for(fp8_block, projection_backend: str):
  """The FP8 block for the products of layers that tp splits, or None where they keep XLA's
  path: projection backend "xla", a GPU that is not a Hopper (the FP8 kernels need wgmma and
  the TMA), or "auto" with ON_HOPPER off. "pallas" off a GPU: the interpreted kernels."""
  if fp8_block is None or projection_backend == "xla":
    return None
  if platform.on_hopper():
    return fp8_block if projection_backend == "pallas" or ON_HOPPER else None
  return fp8_block if projection_backend == "pallas" and not platform.on_gpu() else None


class Fp8TensorParallel:
  """`column`, `row` and `whole` (layer_whole) FP8 products over the mesh axis of `products`
  (whose all-reduce the row products share), for weights stored output-first with their block
  scales (jspec.models.linear)."""

  def __init__(self, products: TensorParallelProducts, block: tuple[int, int]):
    self.products, self.block = products, tuple(block)
    self.size = products.mesh.shape[products.axis]

  def takes(self, weights, dim: int, in_axes: int = 1) -> bool:
    """Whether each of `weights` ((w8, scale) pairs, stored, `in_axes` input axes) splits over
    its axis `dim` into shares of whole blocks: that axis of the weight and of its scale divide
    by the shards, and a share's inner output axis and last input axis are whole blocks (so
    its scale grid is its flattened [N, K] form's, linear._whole_blocks)."""
    for w8, scale in weights:
      if w8.shape[dim] % self.size or scale.shape[dim] % self.size:
        return False
      local = list(w8.shape)
      local[dim] //= self.size
      if local[-in_axes - 1] % self.block[0] or local[-1] % self.block[1]:
        return False
    return True

  def layer_column(self, layer, x_BTK, names, dim: int):
    """`column` of `layer`'s projections `names` (with their scales' kernel lanes where the
    layer holds them, `fp8_lanes`), or None where one is unquantized or a share would not keep
    whole blocks (the layer's own product then)."""
    pairs = self._pairs(layer, names)
    if not pairs or not self.takes(pairs, dim):
      return None
    return self.column(as_values(x_BTK), pairs, dim, self._lanes(layer, names))

  def layer_whole(self, layer, x_BTK, names):
    """`layer`'s projections `names` (one input axis each), whole on every shard: a tuple of
    [B, T, *out] in one kernel call per shard, or None where one is unquantized or not in
    whole blocks (linear.fp8_operands)."""
    k = x_BTK.shape[-1]
    operands = fp8_operands(layer, names, k)
    if operands is None:
      return None
    weights, scales, lanes = operands
    outs = self.column(as_values(x_BTK), list(zip(weights, scales)), None, lanes)
    return tuple(out.reshape(*x_BTK.shape[:-1], *getattr(layer, name).shape[:-1])
                 for out, name in zip(outs, names))

  def layer_row(self, layer, x_BTI, name: str, in_axes: int = 1, defer: bool = False):
    """`row` of `layer`'s projection `name`, its first input axis split, or None (as
    layer_column)."""
    pairs = self._pairs(layer, (name,))
    if not pairs or not self.takes(pairs, pairs[0][0].ndim - in_axes, in_axes):
      return None
    (lanes,) = self._lanes(layer, (name,))
    return self.row(as_values(x_BTI), *pairs[0], in_axes=in_axes, lanes=lanes, defer=defer)

  @staticmethod
  def _pairs(layer, names):
    scales = [getattr(layer, name + "_scale") for name in names]
    if any(scale is None for scale in scales):
      return None
    return [(getattr(layer, name)[...], scale[...]) for name, scale in zip(names, scales)]

  @staticmethod
  def _lanes(layer, names):
    """Each scale repeated over the kernel's lanes before the loop (projections.
    with_loop_constants; split as the scale is), or None: repeated in the step."""
    lanes = getattr(layer, "fp8_lanes", None) or {}
    return tuple(lanes.get(name) for name in names)

  def column(self, x_BTK, weights, dim: int | None, lanes=None):
    """x [B, T, K] (whole on every shard) times each FP8 weight of `weights` ((w8 [*out, K],
    scale) pairs, one input axis), each split over its stored output axis `dim` (None: whole
    on every shard): a tuple of [B, T, *out], that axis split; one kernel call per shard for
    all of them, no collective.
    The K-slice sums are left to the readers' fusions (norms, RoPE, SwiGLU). `lanes`: per
    weight its scale's kernel lanes or None."""
    lead = self.products.lead_spec()
    w8s, scales = zip(*weights)
    lanes = tuple(lanes or (None,) * len(w8s))

    def local(x, w8s, scales, lanes):
      k = x.shape[-1]
      outs = fp8_products(x, [w.reshape(-1, k) for w in w8s], [flat_grid(s) for s in scales],
                          tuple(None if l is None else flat_grid(l) for l in lanes),
                          sum_apart=False, block=self.block)
      return tuple(out.reshape(*x.shape[:-1], *w.shape[:-1]) for out, w in zip(outs, w8s))

    specs = tuple(PartitionSpec(*(None,) * w.ndim) if dim is None
                  else self.products.split_spec(w.ndim, dim) for w in w8s)
    out_specs = tuple(PartitionSpec(*lead, *spec[:-1]) for spec in specs)
    return jax.shard_map(local, mesh=self.products.mesh,
                         in_specs=(PartitionSpec(*lead, None), specs, specs, specs),
                         out_specs=out_specs, check_vma=False)(x_BTK, w8s, scales, lanes)

  def row(self, x_BTI, w8, scale, in_axes: int = 1, lanes=None, defer: bool = False):
    """x [B, T, *in] times an FP8 weight stored [*out, *in] over the `in_axes` input axes, the
    first of them split over the mesh axis in both: each shard's partial product (its K
    slices summed), then the all-reduce; [B, T, *out] whole on every shard. `lanes`: the
    scale's kernel lanes or None. `defer`: a PartialSum of the shards' partials [A, B, T, D]
    instead, where the tp products defer sums (TensorParallelProducts.defers), so that the
    norm after the residual add sums them with the all-reduce in one kernel."""
    lead = self.products.lead_spec()
    reduce, table, table_spec = self.products.reduce_operands()
    out_axes = w8.ndim - in_axes
    defer = defer and self.products.defers(out_axes)

    def local(x, w, s, lanes, row):
      b, t = x.shape[:2]
      k = math.prod(x.shape[2:])
      lanes = None if lanes is None else flat_grid(lanes, in_axes)
      partial = fp8_product(x.reshape(b, t, k), w.reshape(-1, k), flat_grid(s, in_axes),
                            lanes, block=self.block)
      if defer:
        return partial[None]
      return reduce(partial, row).reshape(b, t, *w.shape[:out_axes])

    split = self.products.split_spec(w8.ndim, out_axes)
    x_spec = PartitionSpec(*lead, self.products.axis, *(None,) * (in_axes - 1))
    out_spec = PartitionSpec(*lead, *(None,) * out_axes)
    result = jax.shard_map(local, mesh=self.products.mesh,
                           in_specs=(x_spec, split, split, split, table_spec),
                           out_specs=PartitionSpec(self.products.axis, *out_spec) if defer
                           else out_spec, check_vma=False)(x_BTI, w8, scale, lanes, table)
    return PartialSum(result, self.products, x_BTI.dtype, optional=True) if defer else result
