"""Projections: a weight over some input axes and its output axes, unquantized or as a
fine-grained FP8 checkpoint publishes it (float8_e4m3fn weight, output axes first, with a
float32 scale per block: jspec.models.quantization), and the product of activations with
either form (`project`), under XLA or a kernel (jspec.models.projections picks one).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.models import quantization
from jspec.models.params import param
from jspec.sharding.tensor_parallel import PartialSum

QKV_NAMES = ("q_proj", "k_proj", "v_proj")  # an attention layer's one FP8 call, in its order


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class E4m3Rows:
  """A norm's output as the FP8 products after it take it: `values` [B, T, D] in the model's
  dtype, `x8` the same rows in e4m3 (each row's 128-column groups scaled by their largest
  |value|, fp8_gemm.quantize_activations), and their scales in the FP8 kernel's lanes,
  `lanes` [batch shards, D/128 x L] (fp8_gemm.act_lanes of each shard's rows). Written by the
  norm's kernel (residual_norm.add_partials_rms_norm's `quantize`), so that no pass of its
  own quantizes the activations for the FP8 tensor cores. A consumer without an e4m3 route
  reads `values` (as_values). The attention's output for o_proj (decode_attention's
  `quantize`) has values [B, T, N, H] and x8 [B, T, N x H]: the product's input axes flat."""

  values: jax.Array
  x8: jax.Array
  lanes: jax.Array

  @property
  def shape(self):
    return self.values.shape

  @property
  def ndim(self):
    return self.values.ndim

  @property
  def dtype(self):
    return self.values.dtype


def as_values(x):
  """x as an array: an E4m3Rows' values, anything else as it is."""
  return x.values if isinstance(x, E4m3Rows) else x


def flat_rows(x, in_axes: int):
  """x [.., K] over its last `in_axes` axes: E4m3Rows' values so (its x8 is [.., K] as the
  attention writes o_proj's), an array reshaped."""
  if isinstance(x, E4m3Rows):
    return dataclasses.replace(x, values=flat_rows(x.values, in_axes))
  return x.reshape(*x.shape[:x.ndim - in_axes], -1)


def linear(rngs: nnx.Rngs, shape, dtype, logical_axes, in_axes: int = 1,
           fp8_block: tuple[int, int] | None = None, scale: float | None = None,
           lead: int = 0, flatten_out: bool = False):
  """(weight, block scale or None) of a projection: `lead` batch axes (experts), then `in_axes`
  input axes, then its output axes.

  Unquantized: a `param` of `shape`. With `fp8_block` (an FP8 checkpoint,
  jspec.models.quantization): the weight in float8_e4m3fn in the checkpoint's order, output
  axes first (quantization.stored_shape; `flatten_out` joins them into one, named by the
  first), and its block scale in float32 over the same logical axes, the last output and the
  last input axis counted in blocks (so a shard holds whole blocks)."""
  weight = param(rngs, shape, dtype, logical_axes, scale=scale)
  if fp8_block is None:
    return weight, None
  stored = quantization.stored_shape(shape, in_axes, lead, flatten_out)
  stored_axes = quantization.stored_shape(logical_axes, in_axes, lead, flatten_out)
  value = jnp.moveaxis(weight.get_value(), range(lead, lead + in_axes), range(-in_axes, 0))
  weight = nnx.Param(value.reshape(stored).astype(jnp.float8_e4m3fn), logical_axes=stored_axes,
                     init_scale=weight.get_metadata()["init_scale"])
  grid = quantization.scale_shape(stored, in_axes, fp8_block)
  return weight, nnx.Param(jnp.ones(grid, jnp.float32), logical_axes=stored_axes,
                           init_scale=None, fp8_in_axes=in_axes, fp8_lead=lead)


def project_named(layer, x, name: str, spec: str, in_axes: int = 1, product=None,
                  fp8_sum_apart: bool = True):
  """x times `layer`'s projection `name`: its weight, its `{name}_scale` (FP8 or None), and
  the layer's FP8 product (`fp8_projection`), block (`fp8_block`) and prepared scale lanes
  (`fp8_lanes`, by name), through `project`."""
  scale = getattr(layer, name + "_scale")
  lanes = None if layer.fp8_lanes is None else layer.fp8_lanes.get(name)
  return project(x, getattr(layer, name)[...], None if scale is None else scale[...], spec,
                 in_axes, product, layer.fp8_projection, layer.fp8_block, lanes, fp8_sum_apart)


def project_many_named(layer, x, names_specs, product=None, fp8_sum_apart: bool = True):
  """x times each of `layer`'s projections in `names_specs` ((name, einsum spec) pairs, one
  input axis each: q, k and v): a tuple, as project_named gives them one by one (unquantized
  ones through `product` where given). Where all of them are FP8 in whole blocks and the
  layer's FP8 product takes several weights (`many`: jspec.models.projections.Fp8Projection),
  they are one kernel call."""
  fp8_product = layer.fp8_projection
  names = [name for name, _ in names_specs]
  operands = fp8_operands(layer, names, x.shape[-1])
  if getattr(fp8_product, "many", None) is None or operands is None:
    return tuple(project_named(layer, x, name, spec, product=product,
                               fp8_sum_apart=fp8_sum_apart) for name, spec in names_specs)
  outs = fp8_product.many(x, *operands, sum_apart=fp8_sum_apart)
  return tuple(out.reshape(*x.shape[:-1], *getattr(layer, name).shape[:-1])
               for out, name in zip(outs, names))


def fp8_operands(layer, names, k: int):
  """(weights [N_i, K], block scales [N_i/128, K/128], their kernel lanes or None) of
  `layer`'s FP8 projections `names` (one input axis each) as the FP8 kernels take them, or
  None where one is unquantized or not in whole blocks."""
  if not fp8_whole_blocks(layer, names):
    return None
  weights = [getattr(layer, name)[...] for name in names]
  scales = [getattr(layer, name + "_scale") for name in names]
  lanes = None
  if layer.fp8_lanes is not None:
    lanes = [flat_grid(layer.fp8_lanes[name]) for name in names]
  return ([w.reshape(-1, k) for w in weights], [flat_grid(s[...]) for s in scales], lanes)


def fp8_whole_blocks(layer, names) -> bool:
  """Whether each of `layer`'s projections `names` is FP8 with whole 128 x 128 blocks over
  its flattened [N, K] form (the form the FP8 kernels take)."""
  return all(getattr(layer, name + "_scale") is not None
             and _whole_blocks(getattr(layer, name), layer.fp8_block) for name in names)


def _whole_blocks(weight, block: tuple[int, int], in_axes: int = 1) -> bool:
  """The scale grid flattens to the [N, K] weight's own 128 x 128 grid only where the inner
  output and input axes are whole blocks (a block holding two heads of 64, or an intermediate
  size of 200, gives each head or half its own block row): the kernel takes the flattened form
  only then."""
  return weight.shape[-in_axes - 1] % block[0] == 0 and weight.shape[-1] % block[1] == 0


def flat_grid(scale, in_axes: int = 1):
  """A scale over the stored axes (or its kernel lanes) as the flattened [N, K] weight's grid."""
  return scale.reshape(math.prod(scale.shape[:-in_axes]), -1)


def project(x, weight, scale, spec: str, in_axes: int = 1, product=None, fp8_product=None,
            fp8_block: tuple[int, int] | None = None, fp8_lanes=None,
            fp8_sum_apart: bool = True):
  """x times a projection weight over x's last and the weight's input axes: `spec` (an einsum
  over the weight input-first) under XLA, else `product` ((x [.., K], w [K, N]) -> [.., N], on
  free reshapes). An FP8 weight (`scale` given, with its `fp8_block`; stored output-first, its
  last `in_axes` axes the input) goes to `fp8_product` ((x [.., K], w8 [N, K], scale
  [N/b, K/b]) -> [.., N]) where one is set, else is multiplied by its scale in float32 and cast
  to x's dtype before XLA's dot (prefill: the cast weight is read once per call's many rows);
  the result has the stored weight's output axes. fp8_lanes: the scale repeated over the
  kernel's lanes beforehand (jspec.models.projections.with_loop_constants), or None.
  fp8_sum_apart: the kernel's K-slice sum as a kernel of its own (fp8_gemm.fp8_matmul's
  sum_apart; False where the consumer is elementwise). x may be an E4m3Rows: its e4m3 rows go
  to an `fp8_product` that takes them, its values anywhere else."""
  lead = x.shape[:-in_axes]
  if isinstance(x, E4m3Rows) and not (
      scale is not None and getattr(fp8_product, "takes_e4m3", False)
      and _whole_blocks(weight, fp8_block, in_axes)):
    x = x.values
  if scale is not None:
    k = math.prod(weight.shape[-in_axes:])
    out_axes = weight.shape[:-in_axes]
    x_K = flat_rows(x, in_axes)
    # Off whole blocks the scaled weight is built on the stored axes.
    if fp8_product is not None and _whole_blocks(weight, fp8_block, in_axes):
      lanes = () if fp8_lanes is None else (flat_grid(fp8_lanes, in_axes),)
      out = fp8_product(x_K, weight.reshape(-1, k), flat_grid(scale, in_axes), *lanes,
                        sum_apart=fp8_sum_apart)
    else:
      scaled = quantization.dequantize(weight, scale, in_axes, fp8_block, x.dtype, jnp)
      out = jnp.einsum("...k,nk->...n", x_K, scaled.reshape(-1, k))
    return out.reshape(*lead, *out_axes)
  k = math.prod(weight.shape[:in_axes])
  if product is None:
    return jnp.einsum(spec, x, weight)
  out = product(x.reshape(*lead, k), weight.reshape(k, -1))
  return out.reshape(*lead, *weight.shape[in_axes:])


def fp8_rows_fit(layer, x, names, in_axes: int = 1) -> bool:
  """Whether x's rows go to the few-row FP8 kernel (fp8_gemm) with each of `layer`'s
  projections `names` (FP8, `in_axes` input axes each)."""
  from jspec.pallas_kernels import fp8_gemm
  rows, k = math.prod(x.shape[:-in_axes]), math.prod(x.shape[-in_axes:])
  return layer.fp8_block is not None and all(
      fp8_gemm.fits_kernel(rows, k, math.prod(getattr(layer, name).shape[:-in_axes]),
                           layer.fp8_block) for name in names)


class SlicedFp8Product:
  """An FP8 row product's output before the sum of its K slices, for the residual add and
  RMSNorm that read it next (o_proj, down_proj): `reduced()` is the output; `+` sums first;
  the norm takes it whole (`add_and_norm`: its kernel sums the partials as it reads them,
  jspec.models.fp8_row_kernels.sharded_fp8_add_rms_norm), so that the sum is no kernel of its
  own."""

  def __init__(self, reduce, fuse, shape, dtype):
    self._reduce, self._fuse, self.shape, self.dtype = reduce, fuse, shape, dtype

  def reduced(self):
    return self._reduce()

  def add_and_norm(self, residual_BTD, scale_D, eps: float, zero_centered: bool,
                   quantize: bool = False):
    """(residual + the product, its RMSNorm) in one kernel; quantize: the RMSNorm as an
    E4m3Rows."""
    return self._fuse(residual_BTD, scale_D, eps=eps, zero_centered=zero_centered,
                      quantize=quantize)

  def __add__(self, other):
    return self.reduced() + other

  def __radd__(self, other):
    return other + self.reduced()


def reduced(delta):
  """`delta` as an array: a SlicedFp8Product or a PartialSum summed, anything else as it is."""
  return delta.reduced() if isinstance(delta, (SlicedFp8Product, PartialSum)) else delta


def project_to_norm(layer, x, name: str, spec: str, in_axes: int = 1, product=None):
  """project_named for a projection whose output a residual add and RMSNorm read next: a
  SlicedFp8Product where `layer.fp8_add_norm` is set (jspec.backends.use_row_kernels) and the
  FP8 weight, in whole blocks, takes x's rows in the few-row kernel; else the product."""
  reduce = lambda: project_named(layer, x, name, spec, in_axes, product)
  kernel, scale = layer.fp8_add_norm, getattr(layer, name + "_scale")
  weight = getattr(layer, name)
  if (kernel is None or scale is None or weight.ndim != in_axes + 1
      or not _whole_blocks(weight, layer.fp8_block, in_axes)
      or not fp8_rows_fit(layer, x, (name,), in_axes)):
    return reduce()
  lead = x.shape[:x.ndim - in_axes]
  k, n = math.prod(weight.shape[-in_axes:]), weight.shape[0]
  lanes = None if layer.fp8_lanes is None else layer.fp8_lanes.get(name)
  lanes = None if lanes is None else flat_grid(lanes, in_axes)
  operands = (flat_rows(x, in_axes), weight[...].reshape(n, k),
              flat_grid(scale[...], in_axes), lanes)
  fuse = lambda residual, scale_D, **norm: kernel(*operands, residual, scale_D, **norm)
  return SlicedFp8Product(reduce, fuse, (*lead, n), x.dtype)
