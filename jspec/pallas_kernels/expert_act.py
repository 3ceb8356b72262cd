"""The FP8 expert path's activation in one Pallas (Triton) kernel: the gate / up kernel's K-slice
partials summed, SiLU(gate) x up, each slot's rows turned to the down kernel's [N, F] order and
rounded to bfloat16:

  act [S, N, F] = bf16(silu(sum_p gate[p, s]) * sum_p up[p, s])^T,  parts [2, P, S, F, N]

Why: XLA ran these few hundred KiB as two kernels between the expert kernels of a
Qwen3-30B-A3B layer at batch 1 (1.6 + 1.4 µs on an H200); this one cut the FP8 TPOT by 2.5%
(BENCHMARKS.md, "Norm kernels' loads before their stores ..."). Slots from num_slots on were
not written by the gate / up kernel: their rows are zeros here, as the XLA form's `where`
makes them.

Each value is what the XLA form computes (float32 sums, the same SiLU, one rounding to
bfloat16) but for the order of the P float32 additions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform

# Partial values a program holds per weight (P x its columns x N): 16 float32 a thread at 4
# warps, so that the two sums and their loads stay in registers.
VALUES_PER_PROGRAM = 2048
MIN_COLUMNS = 16


def columns_per_program(splits: int, ffn: int, rows: int) -> int:
  """The widest power-of-two block of F (at least MIN_COLUMNS, dividing F) whose partials fit
  VALUES_PER_PROGRAM, or MIN_COLUMNS."""
  cols = MIN_COLUMNS
  while (ffn % (2 * cols) == 0
         and pl.next_power_of_2(splits) * 2 * cols * rows <= VALUES_PER_PROGRAM):
    cols *= 2
  return cols


def fits(ffn: int, rows: int) -> bool:
  """Shapes the kernel takes: F in whole blocks of MIN_COLUMNS, N a power of two."""
  return ffn % MIN_COLUMNS == 0 and rows & (rows - 1) == 0


def _kernel(num_slots_ref, parts_ref, act_ref, *, splits: int, cols: int):
  s, f = pl.program_id(0), pl.program_id(1)
  padded = pl.next_power_of_2(splits)
  real_P = jnp.arange(padded) < splits
  block = pl.ds(pl.multiple_of(f * cols, cols), cols)

  def summed(w):  # [cols, N] float32: the slices' partials of weight w (0 gate, 1 up)
    parts_PCN = pltriton.load(parts_ref.at[jnp.int32(w), pl.ds(0, padded), s, block, :],
                              mask=real_P[:, None, None], other=0.0)
    return jnp.sum(parts_PCN, axis=0)

  gate_CN, up_CN = summed(0), summed(1)
  act_CN = jax.nn.silu(gate_CN) * up_CN
  act_CN = jnp.where(s < num_slots_ref[0], act_CN, 0.0)
  act_ref[s, :, block] = act_CN.T.astype(act_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def gate_up_act(parts_WPSFN: jax.Array, num_slots_1: jax.Array,
                interpret: bool | None = None) -> jax.Array:
  """act [S, N, F] bfloat16 from the gate / up kernel's float32 partials [2, P, S, F, N]
  (fp8_experts.slot_products(..., summed=False)) and the used slots' count [1]."""
  weights, splits, slots, ffn, rows = parts_WPSFN.shape
  if weights != 2 or parts_WPSFN.dtype != jnp.float32 or not fits(ffn, rows):
    raise ValueError(f"gate_up_act takes float32 partials [2, P, S, F, N] with F a multiple "
                     f"of {MIN_COLUMNS} and N a power of two, got {parts_WPSFN.shape} "
                     f"{parts_WPSFN.dtype}")
  if interpret is None:
    interpret = not platform.on_gpu()
  cols = columns_per_program(splits, ffn, rows)
  return pl.pallas_call(
      functools.partial(_kernel, splits=splits, cols=cols),
      out_shape=jax.ShapeDtypeStruct((slots, rows, ffn), jnp.bfloat16),
      grid=(slots, ffn // cols),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="expert_gate_up_act",
  )(num_slots_1.astype(jnp.int32), parts_WPSFN)
