"""Rows quantized to e4m3 per 128 channels and laid out for the FP8 tensor-core products, in one
Pallas (Triton) kernel:

  x8    [P, K]          e4m3, x / scale per row and 128-column group; rows M..P zeros
  scale [P/T, K/128, T] float32 max(|group|, 1e-12) / 448 (as XLA computes it), each tile of T
                        rows with its rows last (the products read one group's T scales as
                        one block); rows M..P get 1e-12 / 448, their x8 being zeros

This is fp8_gemm.quantize_activations (DeepSeek-V3's act_quant, the checkpoints' "dynamic"
activation scheme) with the padding and the scales' transpose the products need, value for
value: x / scale is an IEEE division on the GPU (`div.rn`, as XLA's), where Triton's `/` would
be an approximate one.

Why a kernel: in XLA these are about a dozen operations a product (a reduction whose result two
consumers read, the divisions, the casts, two pads, a transpose), and XLA's fusion passes over
them made an FP8 prefill program's compile nearly twice the bf16 one's (BENCHMARKS.md, "Mosaic
GPU modules emptied at their call sites: …"). As one custom call per product they are one
operation, compiled once per shape: on an H200 the FP8 prefill program of Qwen3-30B-A3B spent
11.0 s in XLA's passes against 13.9, and Qwen3-8B's FP8 prefill took 2.8% less time
(BENCHMARKS.md, "FP8 prefill: the activations' e4m3 quantisation in one kernel; …").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform
from jspec.pallas_kernels.fp8_gemm import BLOCK, E4M3, INVERSE_E4M3_MAX

MIN_SCALE = float(np.float32(1e-12) * np.float32(INVERSE_E4M3_MAX))
# Rows per program: a 32 x 128 group tile is 32 float32 values a thread at 4 warps.
MAX_PROGRAM_ROWS = 32


def divide_rn(a, b, interpret: bool):
  """a / b rounded to nearest, as XLA divides on the GPU (`div.rn.f32`); the interpreter's
  division is IEEE already."""
  if interpret:
    return a / b
  (quotient,) = pltriton.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
  return quotient


def e4m3_groups(groups_GB, interpret: bool):
  """(the rows of groups_GB [G, 128] float32 in e4m3, their scales [G]): each row one 128-group
  scaled so that its largest |x| maps to e4m3's 448, as fp8_gemm.quantize_activations scales it
  and XLA divides. The kernels that quantize (this module's, residual_norm's, the attention's)
  all round through here."""
  scale_G = jnp.maximum(jnp.max(jnp.abs(groups_GB), axis=1), 1e-12) * INVERSE_E4M3_MAX
  quotient = divide_rn(groups_GB, lax.broadcast_in_dim(scale_G, groups_GB.shape, [0]), interpret)
  return quotient.astype(E4M3), scale_G


def _kernel(x_ref, x8_ref, scale_ref, *, rows: int, program_rows: int, interpret: bool):
  r, g = pl.program_id(0), pl.program_id(1)
  row_R = r * program_rows + lax.iota(jnp.int32, program_rows)
  real_R = row_R < rows
  x_RG = pltriton.load(x_ref.at[pl.ds(r * program_rows, program_rows), pl.ds(g * BLOCK, BLOCK)],
                       mask=real_R[:, None], other=0).astype(jnp.float32)
  x8_ref[...], scale_ref[...] = e4m3_groups(x_RG, interpret)


def program_rows(tile_rows: int) -> int:
  """Rows a program quantizes: the largest power of two dividing the tile, at most
  MAX_PROGRAM_ROWS."""
  return math.gcd(tile_rows, MAX_PROGRAM_ROWS)


@functools.partial(jax.jit, static_argnames=("padded_rows", "tile_rows", "interpret"))
def quantize_rows(x_MK: jax.Array, padded_rows: int, tile_rows: int | None = None,
                  interpret: bool | None = None):
  """(x8 [P, K] e4m3, scale [P / T, K / 128, T] float32) of x [M, K] (any float dtype), P =
  padded_rows >= M, T = tile_rows (default P) dividing P, a multiple of 8."""
  m, k = x_MK.shape
  tile_rows = tile_rows or padded_rows
  if (k % BLOCK or padded_rows < m or tile_rows % 8 or padded_rows % tile_rows
      or not jnp.issubdtype(x_MK.dtype, jnp.floating)):
    raise ValueError(f"quantize_rows takes float x [M, K] with K a multiple of {BLOCK}, P >= M "
                     f"rows in tiles of T (a multiple of 8), got {x_MK.shape} {x_MK.dtype}, "
                     f"P={padded_rows}, T={tile_rows}")
  if interpret is None:
    interpret = not platform.on_gpu()
  rows_per_program = program_rows(tile_rows)
  programs_per_tile = tile_rows // rows_per_program
  groups = k // BLOCK
  return pl.pallas_call(
      functools.partial(_kernel, rows=m, program_rows=rows_per_program, interpret=interpret),
      out_shape=(jax.ShapeDtypeStruct((padded_rows, k), E4M3),
                 jax.ShapeDtypeStruct((padded_rows // tile_rows, groups, tile_rows),
                                      jnp.float32)),
      grid=(padded_rows // rows_per_program, groups),
      out_specs=(pl.BlockSpec((rows_per_program, BLOCK), lambda r, g: (r, g)),
                 pl.BlockSpec((None, None, rows_per_program),
                              lambda r, g: (r // programs_per_tile, g, r % programs_per_tile))),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="quantize_rows",
  )(x_MK)
