"""The RMSNorms of the families: plain scale (Qwen3, Llama, DeepSeek-V3), (1 + w) scale
(Qwen3-Next / Qwen3.5) and the SiLU-gated one of the linear-attention output. All normalise in
float32, as transformers does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.models.linear import SlicedFp8Product
from jspec.models.params import ones_param, zeros_param
from jspec.models.row_kernels import takes_rows
from jspec.sharding.tensor_parallel import PartialSum


def _normalized_f32(x, eps):
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
  """Qwen3RMSNorm: normalise in float32, cast back, then scale in the parameter dtype.

  `row_kernel`, set by the LLM (jspec.models.row_kernels), runs a step of few rows in one
  kernel, with the residual add before it in `add_and_norm`; None: XLA's fusions."""

  zero_centered = False

  def __init__(self, dim: int, eps: float, dtype, axis_name: str = "embed"):
    self.scale = self._init_scale(dim, dtype, axis_name)
    self.eps = eps
    self.axis_name = axis_name
    self.row_kernel = None

  @staticmethod
  def _init_scale(dim, dtype, axis_name):
    return ones_param((dim,), dtype, (axis_name,))

  def _xla(self, x):
    return self.scale[...] * _normalized_f32(x, self.eps).astype(x.dtype)

  def on_kernel(self, x) -> bool:
    """The kernel takes hidden states [B, T, D] of few rows (q / k norms over heads do not)."""
    return self.row_kernel is not None and takes_rows(x, ndim=3)

  def __call__(self, x, quantize: bool = False):
    """norm(x); quantize: as a linear.E4m3Rows where the row kernel runs it (add_and_norm's)."""
    if self.on_kernel(x):
      return self.row_kernel(x, self.scale[...], quantize=quantize)
    return self._xla(x)

  def add_and_norm(self, x, delta, quantize: bool = False):
    """(h, norm(h)) for h = x + delta: the residual stream and its normalised form. A `delta`
    still to be summed over tp (a PartialSum) or over an FP8 product's K slices (a
    SlicedFp8Product) is summed in the same kernel where it fits. quantize: where the row
    kernel runs the norm on a SlicedFp8Product or an array, norm(h) as a linear.E4m3Rows, its
    e4m3 form written by that kernel (for the FP8 products that read it next); elsewhere an
    array as without."""
    if isinstance(delta, SlicedFp8Product) and quantize and self.on_kernel(x):
      return delta.add_and_norm(x, self.scale[...], self.eps, self.zero_centered,
                                quantize=True)
    if isinstance(delta, PartialSum) and delta.optional and quantize:
      delta = delta.reduced()  # summed first: the e4m3 rows are this kernel's (PartialSum's)
    if isinstance(delta, (PartialSum, SlicedFp8Product)):
      fused = (delta.add_and_norm(x, self.scale[...], self.eps, self.zero_centered)
               if self.on_kernel(x) else None)
      if fused is not None:
        return fused
      delta = delta.reduced()
    if self.on_kernel(x):
      return self.row_kernel(x, self.scale[...], delta, quantize=quantize)
    h = x + delta
    return h, self._xla(h)


class ZeroCenteredRMSNorm(RMSNorm):
  """Scale by (1 + w), in float32 before the cast (Qwen3-Next / Qwen3.5 `Qwen3NextRMSNorm`,
  Gemma3's norm): the stored weight is centred on 0, so a checkpoint's zeros mean identity."""

  zero_centered = True

  @staticmethod
  def _init_scale(dim, dtype, axis_name):
    return zeros_param((dim,), dtype, (axis_name,))

  def _xla(self, x):
    scale = 1.0 + self.scale[...].astype(jnp.float32)
    return (_normalized_f32(x, self.eps) * scale).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
  """RMSNorm(x) * silu(gate) over the last axis, plain w (Qwen3-Next `Qwen3NextRMSNormGated`,
  the linear-attention output norm): normalise in float32, cast, scale, gate in float32."""

  def __init__(self, dim: int, eps: float, dtype):
    self.scale = ones_param((dim,), dtype, (None,))
    self.eps = eps

  def __call__(self, x, gate):
    normed = self.scale[...] * _normalized_f32(x, self.eps).astype(x.dtype)
    return (normed * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
