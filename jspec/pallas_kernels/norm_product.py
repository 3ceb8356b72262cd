"""The residual add and RMSNorm before a projection, and the projection's K-slice partials, in
one Pallas (Triton) kernel: a few rows against a bf16 weight [D, N] or a block-scaled FP8
weight [N, D] (e4m3, one float32 scale per 128 x 128 block, as published).

Why: at batch 1 a layer's input norm and its q / k / v product are two kernels, and both are
mostly fixed cost. Qwen3-30B-A3B on an H200 (BENCHMARKS.md, "The step timer's slope ...", a
layer by kernel): the add + RMSNorm 1.5-1.8 µs for 8 KB of rows; q / k / v 7.2 µs in bf16 (XLA's
GEMM, 21 MB) and 6.75 µs in FP8 (the Mosaic GPU few-row kernel, 10.5 MB: 1.55 TB/s, where a
call's launch and first loads are most of its time). Here the projection's (K slice, column
block) pairs are the grid, and every program computes the norm itself from the row it reads
whole, as the norm + router kernel (jspec.pallas_kernels.norm_router) does for the router:

  add_norm_partials(x [M, D], delta [M, D], scale [D], weight)
      -> (h = x + delta [M, D], float32 partials [S, N, M])

where partials[s] is the product of slice s of norm(h)'s columns with the weight's slice s
of rows (bf16: w[D, N]; FP8: w8[N, D] * scale8 over its blocks, transposed), and the product
is sum_s partials[s].T: the form jspec.pallas_kernels.row_norms.qkv_partials_norm_rope reads
(where S = D / 128 is a power of two, as that kernel asks).
h and norm(h) are computed as `rms_norm` computes them; norm(h) is not written (the product is
its one reader). The weight's loads are issued before the row's sum of squares, a block
reduction that later loads would wait for.

Status: built and checked on the CPU (interpret mode) against float64 NumPy; not yet timed on
a GPU nor used by the models. `benchmarks/norm_product.py` times it against the two kernels it
would replace.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform
from jspec.pallas_kernels.residual_norm import fits_kernel as norm_fits, row_chunk, scaled_norm

E4M3 = jnp.float8_e4m3fn
FP8_BLOCK = 128
SLICE_ROWS = 128   # the weight's K rows a program reads (one FP8 block)
ROW_CHUNK = 64     # K rows of one load: [64, 128] bfloat16 is 64 values a thread at 4 warps
BLOCK_COLS = 128   # the weight's columns a program reads (one FP8 block)
MAX_ROWS = 16
NUM_WARPS = 4


def fits(rows: int, width: int, cols: int) -> bool:
  """Shapes the kernel takes: up to MAX_ROWS rows, D in whole slices, N in whole blocks."""
  return (1 <= rows <= MAX_ROWS and norm_fits(width) and width % SLICE_ROWS == 0
          and cols % BLOCK_COLS == 0)


def _kernel(x_ref, delta_ref, scale_ref, w_ref, *rest, eps: float, zero_centered: bool,
            fp8: bool):
  if fp8:
    w_scale_ref, h_ref, parts_ref = rest
  else:
    h_ref, parts_ref = rest
  m, s, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  width = x_ref.shape[1]
  chunk = row_chunk(width)
  cols_n = pl.ds(nb * BLOCK_COLS, BLOCK_COLS)
  steps = [pl.ds(s * SLICE_ROWS + i * ROW_CHUNK, ROW_CHUNK)
           for i in range(SLICE_ROWS // ROW_CHUNK)]

  def added(cols):  # x + delta rounded to the stream's dtype, as rms_norm's add
    x = x_ref[m, cols]
    return (x.astype(jnp.float32) + delta_ref[m, cols].astype(jnp.float32)).astype(x.dtype)

  # The weight's tiles first (the bytes this kernel is for), then the slice's scale and h, then
  # the whole row for its sum of squares: loads placed after that reduction would wait for it.
  if fp8:
    tiles = [w_ref[cols_n, cols] for cols in steps]             # [BLOCK_COLS, ROW_CHUNK] e4m3
    block_scale = w_scale_ref[nb, s].astype(jnp.float32)         # one 128 x 128 block
  else:
    tiles = [w_ref[cols, cols_n] for cols in steps]             # [ROW_CHUNK, BLOCK_COLS]
  scales = [scale_ref[cols] for cols in steps]
  slice_h = [added(cols) for cols in steps]
  pieces = [added(pl.ds(c * chunk, chunk)) for c in range(width // chunk)]
  squares = jnp.float32(0.0)
  for piece in pieces:  # in rms_norm's pieces and order
    h32 = piece.astype(jnp.float32)
    squares += jnp.sum(h32 * h32)
  inv_rms = jax.lax.rsqrt(squares / width + eps)
  acc = jnp.zeros((BLOCK_COLS, ROW_CHUNK) if fp8 else (ROW_CHUNK, BLOCK_COLS), jnp.float32)
  for tile, scale, h in zip(tiles, scales, slice_h):
    out32 = scaled_norm(h, scale, inv_rms, zero_centered).astype(jnp.float32)
    if fp8:
      acc = acc + tile.astype(jnp.float32) * (out32 * block_scale)[None, :]
    else:
      acc = acc + out32[:, None] * tile.astype(jnp.float32)
  parts_ref[s, cols_n, m] = jnp.sum(acc, axis=1 if fp8 else 0)

  @pl.when(nb == 0)  # one program of each slice writes its columns of h
  def _():
    for cols, h in zip(steps, slice_h):
      h_ref[m, cols] = h


@functools.partial(jax.jit, static_argnames=("eps", "zero_centered", "interpret"))
def add_norm_partials(x_MD: jax.Array, delta_MD: jax.Array, scale_D: jax.Array,
                      weight: jax.Array, weight_scale: jax.Array | None = None, *, eps: float,
                      zero_centered: bool = False, interpret: bool | None = None):
  """(h [M, D], partials [D / SLICE_ROWS, N, M] float32) for h = x + delta and the product of
  norm(h) with `weight` (see the module docstring): bf16 (any float) weight [D, N] with
  weight_scale None, or e4m3 weight [N, D] with weight_scale [N / 128, D / 128]."""
  rows, width = x_MD.shape
  fp8 = weight_scale is not None
  cols = weight.shape[0] if fp8 else weight.shape[1]
  k_rows = weight.shape[1] if fp8 else weight.shape[0]
  if (delta_MD.shape != x_MD.shape or delta_MD.dtype != x_MD.dtype or scale_D.shape != (width,)
      or k_rows != width or not fits(rows, width, cols)
      or (fp8 and (weight.dtype != E4M3 or weight_scale.shape != (cols // FP8_BLOCK,
                                                                    width // FP8_BLOCK)))):
    raise ValueError(
        f"add_norm_partials takes x and delta [M <= {MAX_ROWS}, D] of one dtype, scale [D] "
        f"and a weight [D, N] (or e4m3 [N, D] with block scales [N/{FP8_BLOCK}, "
        f"D/{FP8_BLOCK}]), D a multiple of {SLICE_ROWS} and N of {BLOCK_COLS}; got "
        f"{x_MD.shape} {x_MD.dtype}, {delta_MD.shape} {delta_MD.dtype}, {scale_D.shape}, "
        f"{weight.shape} {weight.dtype}, "
        f"{None if weight_scale is None else weight_scale.shape}")
  if interpret is None:
    interpret = not platform.on_gpu()
  slices = width // SLICE_ROWS
  operands = (x_MD, delta_MD, scale_D, weight) + ((weight_scale,) if fp8 else ())
  return pl.pallas_call(
      functools.partial(_kernel, eps=eps, zero_centered=zero_centered, fp8=fp8),
      out_shape=(jax.ShapeDtypeStruct((rows, width), x_MD.dtype),
                 jax.ShapeDtypeStruct((slices, cols, rows), jnp.float32)),
      grid=(rows, slices, cols // BLOCK_COLS),
      compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret, name="add_norm_fp8_partials" if fp8 else "add_norm_partials",
  )(*operands)
