"""The pieces several kernels share: SMEM tile layouts, the SwiGLU product, float16 rows, and
block-scaled FP8 weights dequantized (the checkpoints' format, jspec.models.quantization).

Beside `platform` (what the kernels know about the device), the one module the kernels import
from one another for their common parts; nothing here reaches above jspec.pallas_kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

# float16_rows scales x's rows so that |x| < 2^14, under float16's largest finite value (65504).
FLOAT16_MAX_EXPONENT = 14


def smem_transforms(minor_elems: int, dtype) -> tuple:
  """Tiling + swizzle for an SMEM tile whose contiguous dimension has `minor_elems`."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def silu_mul(gate, up):
  """SwiGLU's product: silu(gate) * up."""
  return gate * jax.nn.sigmoid(gate) * up


def float16_rows(x_MK):
  """(x / 2^e as float16, 2^e per row): e puts each row's largest |x| under 2^14."""
  x32 = x_MK.astype(jnp.float32)
  _, exponent_M = jnp.frexp(jnp.max(jnp.abs(x32), axis=-1))  # amax < 2^exponent
  shift_M = exponent_M - FLOAT16_MAX_EXPONENT
  return jnp.ldexp(x32, -shift_M[:, None]).astype(jnp.float16), jnp.ldexp(1.0, shift_M)


def expand_scale(scale, stored, in_axes: int, block: tuple[int, int], xp=np):
  """A block scale (scale_shape's grid) repeated to the stored weight's shape."""
  last_out = len(stored) - in_axes - 1
  scale = xp.repeat(scale, block[0], axis=last_out)
  scale = xp.repeat(scale, block[1], axis=-1)
  return scale[(slice(None),) * last_out + (slice(0, stored[last_out]),) + (slice(None),) * (
      in_axes - 1) + (slice(0, stored[-1]),)]


def dequantize(weight, scale, in_axes: int, block: tuple[int, int], dtype, xp=np):
  """The stored FP8 weight times its block scales, in float32, cast to `dtype`."""
  full = expand_scale(scale, weight.shape, in_axes, block, xp)
  return (weight.astype(xp.float32) * full).astype(dtype)
