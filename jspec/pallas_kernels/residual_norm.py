"""The residual add and the RMSNorm after it, for the few rows of a decode or verify step, in one
Pallas (Triton) kernel.

Why: in a batch-1 decode step a row is a few thousand elements, and XLA runs a norm as two
kernels (the sum of squares, then the scaling) and the residual add before it as a third; a
kernel on an H200 costs 1.1-2.3 µs however little it does (BENCHMARKS.md, "FP8 and MLA decode
on an H200 against their targets; ..."). Here:

  rms_norm   the residual add (optional) and the RMSNorm after it: (h, norm(h)).

It rounds where jspec.models.norms' modules round (the sum in bfloat16, normalising in float32,
the cast, the scale), so it stands in for them; only the order of the float32 sums differs.
One program per row: the steps that call it have at most a few hundred rows.
(o_proj's and down_proj's FP8 K-slice partials summed here as they are read were slower, one
program a row reading every slice: BENCHMARKS.md, "Workspace kernels without flags (Lamport)
...". Removed.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform

MAX_CHUNK = 4096  # the widest piece of a row one load takes (Triton blocks are powers of two)
MIN_CHUNK = 64


def row_chunk(width: int) -> int:
  """The largest power of two that divides `width`, at most MAX_CHUNK: rows are read in
  pieces of this many (7168 = 7 x 1024; Triton cannot load a block of 7168)."""
  return min(width & -width, MAX_CHUNK)


def scaled_norm(h, scale, inv_rms, zero_centered: bool):
  """One piece of norm(h) in h's dtype from h, the scale's piece and the row's 1 / rms, as
  RMSNorm (cast, then the scale in the parameter's dtype) or ZeroCenteredRMSNorm ((1 + w) in
  float32, one cast) computes it, in the kernels that hold h in its dtype (this module's, the
  norm + router kernel's)."""
  normed = h.astype(jnp.float32) * inv_rms
  scale = scale.astype(jnp.float32)
  if zero_centered:
    return (normed * (1.0 + scale)).astype(h.dtype)
  return (scale * normed.astype(h.dtype).astype(jnp.float32)).astype(h.dtype)


def fits_kernel(width: int) -> bool:
  """Whether a row of `width` is read in pieces of at least MIN_CHUNK elements."""
  return width > 0 and row_chunk(width) >= MIN_CHUNK


def _norm_kernel(*refs, eps: float, chunk: int, zero_centered: bool, has_residual: bool):
  """Program m: row m, read once and held in registers (7168 bfloat16 values are 28 a thread
  at 8 warps) between the sum of its squares and its scaling. All loads come before any store,
  which they could alias: a 7168-wide row's 7 pieces were read one after another (BENCHMARKS.md,
  "Norm kernels' loads before their stores")."""
  if has_residual:
    x_ref, delta_ref, scale_ref, h_ref, out_ref = refs
  else:
    x_ref, scale_ref, out_ref = refs
  m = pl.program_id(0)
  width = x_ref.shape[1]
  pieces = [pl.ds(c * chunk, chunk) for c in range(width // chunk)]
  loaded = [(x_ref[m, cols], delta_ref[m, cols] if has_residual else None) for cols in pieces]
  scales = [scale_ref[cols] for cols in pieces]
  rows, squares = [], jnp.float32(0.0)
  for cols, (x, delta) in zip(pieces, loaded):
    if has_residual:  # x + delta rounded to the stream's dtype, as XLA's add does
      x = (x.astype(jnp.float32) + delta.astype(jnp.float32)).astype(x.dtype)
      h_ref[m, cols] = x
    x32 = x.astype(jnp.float32)
    squares += jnp.sum(x32 * x32)
    rows.append((cols, x))
  inv_rms = jax.lax.rsqrt(squares / width + eps)
  for (cols, x), scale in zip(rows, scales):
    out_ref[m, cols] = scaled_norm(x, scale, inv_rms, zero_centered)


@functools.partial(jax.jit, static_argnames=("eps", "zero_centered", "interpret"))
def rms_norm(x_MD: jax.Array, scale_D: jax.Array, residual_MD: jax.Array | None = None, *,
             eps: float, zero_centered: bool = False, interpret: bool | None = None):
  """RMSNorm of the rows of x [M, D] by scale [D] (jspec.models.norms.RMSNorm, or
  ZeroCenteredRMSNorm's (1 + w) with `zero_centered`), in x's dtype. With `residual_MD`, the
  rows normalised are h = x + residual: returns (h, norm(h)). `interpret` None: interpret off
  GPU."""
  rows, width = x_MD.shape
  if scale_D.shape != (width,) or (residual_MD is not None and residual_MD.shape != x_MD.shape):
    raise ValueError(f"rms_norm takes x [M, D], scale [D] and a residual like x, got "
                     f"{x_MD.shape}, {scale_D.shape}, "
                     f"{None if residual_MD is None else residual_MD.shape}")
  has_residual = residual_MD is not None
  inputs = (x_MD, residual_MD, scale_D) if has_residual else (x_MD, scale_D)
  return _norm_call("add_rms_norm" if has_residual else "rms_norm", inputs, x_MD.dtype,
                    interpret, row_chunk(width), eps=eps, zero_centered=zero_centered,
                    has_residual=has_residual)


def _norm_call(name: str, inputs, dtype, interpret, chunk: int, **form):
  """The pallas_call of _norm_kernel (its `form`) over `inputs`, a program per row of x (the
  first), after the width check both forms share."""
  rows, width = inputs[0].shape
  if not fits_kernel(width):
    raise ValueError(f"{name} reads rows in power-of-two pieces of >= {MIN_CHUNK}; "
                     f"D={width} has none")
  if interpret is None:
    interpret = not platform.on_gpu()
  row = jax.ShapeDtypeStruct((rows, width), dtype)
  return pl.pallas_call(
      functools.partial(_norm_kernel, chunk=chunk, **form),
      out_shape=(row, row) if form["has_residual"] else row, grid=(rows,),
      compiler_params=pltriton.CompilerParams(num_warps=8 if width >= 4096 else 4,
                                              num_stages=1),
      interpret=interpret, name=name,
  )(*inputs)
