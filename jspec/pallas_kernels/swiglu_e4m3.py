"""A dense FP8 MLP's activation for its down_proj on the FP8 tensor cores, in one Pallas (Triton)
kernel: gate / up's K-slice partials (one FP8 call, rows first) summed, SiLU(gate) x up, and
the result in e4m3 with its scales in the FP8 kernel's lanes (linear.E4m3Rows):

  act [M, F] = dtype(silu(g) * u),  g, u = dtype(row_scale x sum_s parts[s, :, :F or F:])
  act8, lanes = fp8_gemm.quantize_activations(act), laid out as fp8_gemm.act_lanes

Why: XLA's fusion of the sum and the activation wrote act in bf16 for down_proj's kernel to
widen its e4m3 tiles against; quantizing act there would be XLA passes of their own (15 µs a
Qwen3-8B layer for its four products' inputs, BENCHMARKS.md, "e4m3 activations for the FP8
few-row products ..."). g and u are rounded to the model's dtype as fp8_gemm.fp8_matmul gives
gate / up, act once more; the quantization is residual_norm.store_e4m3's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3
from jspec.pallas_kernels.fp8_gemm import MAX_ROWS, act_lanes_size
from jspec.pallas_kernels.residual_norm import store_e4m3

# Partial values a program holds per weight (slices x columns): with 2 slices, 128 columns of
# F (96 programs a row at Qwen3-8B's 12288, where 2048 values gave 24 programs: 2.5 against
# 2.9 µs a call on an H100, BENCHMARKS.md, "down_proj on e4m3 rows ...").
VALUES_PER_PROGRAM = 512


def columns_per_program(splits: int, ffn: int) -> int:
  """The widest power-of-two block of F (whole 128-groups, dividing F) whose partials fit
  VALUES_PER_PROGRAM, or one group."""
  cols = BLOCK
  while ffn % (2 * cols) == 0 and pl.next_power_of_2(splits) * 2 * cols <= VALUES_PER_PROGRAM:
    cols *= 2
  return cols


def _kernel(*refs, splits: int, cols: int, ffn: int, row_scaled: bool, interpret: bool):
  parts_ref, *refs = refs
  row_scale_ref = refs.pop(0) if row_scaled else None
  act_ref, x8_ref, lanes_ref = refs
  m, f = pl.program_id(0), pl.program_id(1)
  padded = pl.next_power_of_2(splits)
  real_P = jnp.arange(padded) < splits
  start = pl.multiple_of(f * cols, cols)

  def summed(offset):  # [cols] float32: gate's (offset 0) or up's (F) columns, as fp8_matmul
    parts_PC = pltriton.load(parts_ref.at[pl.ds(0, padded), m, pl.ds(offset + start, cols)],
                             mask=real_P[:, None], other=0.0)
    total = jnp.sum(parts_PC, axis=0)
    if row_scaled:
      total = total * row_scale_ref[m]
    return total.astype(act_ref.dtype).astype(jnp.float32)

  gate, up = summed(0), summed(ffn)
  act = (jax.nn.silu(gate) * up).astype(act_ref.dtype)
  block = pl.ds(start, cols)
  act_ref[m, block] = act
  store_e4m3(act, block, m, x8_ref, lanes_ref, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("rows", "dtype", "interpret"))
def swiglu_e4m3(parts_SRC: jax.Array, row_scale_M: jax.Array | None = None, *, rows: int,
                dtype, interpret: bool | None = None):
  """(act [M, F] in `dtype`, act in e4m3 [M, F], its scales [F/128 x L] as fp8_gemm.act_lanes)
  from gate / up's float32 partials rows first ([S, R, 2F], R >= M rows: gate's F columns,
  then up's; fp8_gemm.fp8_partials_many(rows_first=True)) and the rows' scales of the
  float16 route (or None)."""
  splits, padded_rows, width = parts_SRC.shape
  ffn = width // 2
  if (parts_SRC.dtype != jnp.float32 or width % (2 * BLOCK) or not 0 < rows <= padded_rows
      or rows > MAX_ROWS or (row_scale_M is not None and row_scale_M.shape != (rows,))):
    raise ValueError(f"swiglu_e4m3 takes float32 partials [S, R, 2F] of F in whole {BLOCK}-"
                     f"groups and up to {MAX_ROWS} rows <= R, and row scales [M] or None; got "
                     f"{parts_SRC.shape} {parts_SRC.dtype}, {rows} rows, "
                     f"{None if row_scale_M is None else row_scale_M.shape}")
  if interpret is None:
    interpret = not platform.on_gpu()
  cols = columns_per_program(splits, ffn)
  row_scaled = row_scale_M is not None
  lanes = act_lanes_size(rows, ffn) // (ffn // BLOCK)
  act, x8, lanes_2d = pl.pallas_call(
      functools.partial(_kernel, splits=splits, cols=cols, ffn=ffn, row_scaled=row_scaled,
                        interpret=interpret),
      out_shape=(jax.ShapeDtypeStruct((rows, ffn), dtype),
                 jax.ShapeDtypeStruct((rows, ffn), E4M3),
                 jax.ShapeDtypeStruct((ffn // BLOCK, lanes), jnp.float32)),
      grid=(rows, ffn // cols),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="swiglu_e4m3",
  )(parts_SRC, *((row_scale_M.astype(jnp.float32),) if row_scaled else ()))
  return act, x8, lanes_2d.reshape(-1)
