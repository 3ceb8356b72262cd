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

gate_up_act_e4m3: the same act in e4m3 for the down kernel to multiply on the FP8 tensor cores
(no widening of its e4m3 tiles to bf16), each row of a slot scaled per 128 columns as
fp8_gemm.quantize_activations scales the bf16 act (DeepSeek-V3's act_quant before every FP8
product; a dense FP8 MLP's down_proj takes its act so, jspec.pallas_kernels.swiglu_e4m3), the
scales in the FP8 kernel's lanes per slot ([S, F/128 x L], fp8_gemm.act_lanes' layout).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3
from jspec.pallas_kernels.fp8_gemm import INVERSE_E4M3_MAX, SCALE_LANES
from jspec.pallas_kernels.quantize_rows import divide_rn

# Partial values a program holds per weight (P x its columns x N): 16 float32 a thread at 4
# warps, so that the two sums and their loads stay in registers.
VALUES_PER_PROGRAM = 2048
MIN_COLUMNS = 16
# Partial values per weight gate_up_act_e4m3's program holds at once (its 128 columns of a
# group, all N rows, as many slices as fit).
E4M3_VALUES = 4096
E4M3_WARPS = 4
# The most partial values a weight (slices x 128 x N) of a (slot, group) program for which the
# e4m3 form is taken (e4m3_pays): one slice of 8 rows, DeepSeek-V3's decode step (its MoE layer
# 6.6 µs shorter on an H100); Qwen3-30B-A3B's 8 slices of 8 rows (8192) made its activation
# kernel 2.5 µs longer than the down kernel saved.
E4M3_MAX_VALUES = 1024


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


def _summed_NC(parts_ref, w: int, s, block, first: int, chunk: int, splits: int,
               rows_first: bool, live_rows: int):
  """[N, C] float32: weight w's (0 gate, 1 up) partials of slices first..first+chunk summed,
  slot s, the columns of `block`; rows first, rows from live_rows on neither read nor
  summed (zeros), so that a step's padded rows cost no loads."""
  real_P = first + jnp.arange(chunk) < splits
  if rows_first:
    rows = parts_ref.shape[3]
    mask = real_P[:, None, None] & (jnp.arange(rows) < live_rows)[None, :, None]
    return jnp.sum(pltriton.load(parts_ref.at[jnp.int32(w), pl.ds(first, chunk), s, :, block],
                                 mask=mask, other=0.0), axis=0)
  parts_PCN = pltriton.load(parts_ref.at[jnp.int32(w), pl.ds(first, chunk), s, block, :],
                            mask=real_P[:, None, None], other=0.0)
  return jnp.sum(parts_PCN, axis=0).T


def _kernel(num_slots_ref, parts_ref, act_ref, *, splits: int, cols: int, rows_first: bool,
            live_rows: int):
  s, f = pl.program_id(0), pl.program_id(1)
  block = pl.ds(pl.multiple_of(f * cols, cols), cols)
  sums = [_summed_NC(parts_ref, w, s, block, 0, pl.next_power_of_2(splits), splits,
                     rows_first, live_rows) for w in (0, 1)]
  act_NC = jax.nn.silu(sums[0]) * sums[1]
  act_NC = jnp.where(s < num_slots_ref[0], act_NC, 0.0)
  act_ref[s, :, block] = act_NC.astype(act_ref.dtype)


def _layout(parts, rows_first: bool, live_rows: int | None):
  """(weights, splits, slots, F, N, live rows) of gate / up partials in either layout."""
  weights, splits, slots, *tile = parts.shape
  rows, ffn = tile if rows_first else tile[::-1]
  if live_rows is not None and (not rows_first or not 0 < live_rows <= rows):
    raise ValueError(f"live_rows ({live_rows}) bounds rows-first partials' {rows} rows")
  return weights, splits, slots, ffn, rows, rows if live_rows is None else live_rows


@functools.partial(jax.jit, static_argnames=("interpret", "rows_first", "live_rows"))
def gate_up_act(parts_WPSFN: jax.Array, num_slots_1: jax.Array,
                interpret: bool | None = None, rows_first: bool = False,
                live_rows: int | None = None) -> jax.Array:
  """act [S, N, F] bfloat16 from the gate / up kernel's float32 partials [2, P, S, F, N]
  (fp8_experts.slot_products(..., summed=False)) and the used slots' count [1]. rows_first:
  the partials as [2, P, S, N, F] (slot_products' rows_first), of which only the first
  live_rows rows (None: all) are read; the act's rows past them are zeros."""
  weights, splits, slots, ffn, rows, live = _layout(parts_WPSFN, rows_first, live_rows)
  if weights != 2 or parts_WPSFN.dtype != jnp.float32 or not fits(ffn, rows):
    raise ValueError(f"gate_up_act takes float32 partials [2, P, S, F, N] (or rows first) with "
                     f"F a multiple of {MIN_COLUMNS} and N a power of two, got "
                     f"{parts_WPSFN.shape} {parts_WPSFN.dtype}")
  if interpret is None:
    interpret = not platform.on_gpu()
  cols = columns_per_program(splits, ffn, rows)
  return pl.pallas_call(
      functools.partial(_kernel, splits=splits, cols=cols, rows_first=rows_first,
                        live_rows=live),
      out_shape=jax.ShapeDtypeStruct((slots, rows, ffn), jnp.bfloat16),
      grid=(slots, ffn // cols),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="expert_gate_up_act",
  )(num_slots_1.astype(jnp.int32), parts_WPSFN)


def quantizes(ffn: int, rows: int) -> bool:
  """Shapes gate_up_act_e4m3 takes: F in whole 128-groups, N a power of two up to 64."""
  return ffn % BLOCK == 0 and rows & (rows - 1) == 0 and rows <= 64


def e4m3_pays(splits: int, ffn: int, rows: int) -> bool:
  """Where gate_up_act_e4m3 and the down kernel on its e4m3 act are measured shorter than the
  bf16 act and the widening down kernel: a program's partials within E4M3_MAX_VALUES a weight
  (its one (slot, group) program loads them all; BENCHMARKS.md, "The FP8 experts' down product
  on e4m3 act ...")."""
  return (quantizes(ffn, rows)
          and pl.next_power_of_2(splits) * BLOCK * rows <= E4M3_MAX_VALUES)


def lanes_per_group(rows: int) -> int:
  """L of the act's scales [S, F/128 x L]: fp8_gemm.act_lanes' lanes for `rows` rows."""
  return max(rows, SCALE_LANES)


def _e4m3_kernel(num_slots_ref, parts_ref, act8_ref, lanes_ref, *, splits: int, rows: int,
                 rows_first: bool, live_rows: int, interpret: bool):
  """Program (s, g): slot s's 128-column group g. Its partials are loaded a few slices at a
  time (at most E4M3_VALUES a weight in registers) and summed as gate_up_act sums them, the
  act rounded to bfloat16, each row's largest |act| giving its scale, and the quotients stored
  in the [N, F] order with the scales of the live rows on lanes 0..live-1 of the group (0 on
  the rest)."""
  s, g = pl.program_id(0), pl.program_id(1)
  block = pl.ds(pl.multiple_of(g * BLOCK, BLOCK), BLOCK)
  chunk = pl.next_power_of_2(splits)  # all slices in one load (the padded ones masked)
  while chunk > 1 and (chunk * BLOCK * rows > E4M3_VALUES or chunk < splits and splits % chunk):
    chunk //= 2  # or loads of `chunk` slices, a divisor of the slices

  def summed(w):  # [N, 128] float32: the slices' partials of weight w (0 gate, 1 up)
    parts = [_summed_NC(parts_ref, w, s, block, first, chunk, splits, rows_first, live_rows)
             for first in range(0, splits, chunk)]
    total = parts[0]
    for part in parts[1:]:
      total = total + part
    return total

  act_NC = (jax.nn.silu(summed(0)) * summed(1)).astype(jnp.bfloat16).astype(jnp.float32)
  act_NC = jnp.where(s < num_slots_ref[0], act_NC, 0.0)
  scale_N = jnp.maximum(jnp.max(jnp.abs(act_NC), axis=1), 1e-12) * INVERSE_E4M3_MAX
  quotient_NC = divide_rn(act_NC, jax.lax.broadcast_in_dim(scale_N, act_NC.shape, [0]),
                          interpret)
  act8_ref[s, :, block] = quotient_NC.astype(act8_ref.dtype)
  lanes = lanes_ref.shape[2]
  lane_NL = jax.lax.broadcasted_iota(jnp.int32, (rows, lanes), 1)
  row_NL = jax.lax.broadcasted_iota(jnp.int32, (rows, lanes), 0)
  on_lane = (lane_NL == row_NL) & (row_NL < live_rows)
  lanes_ref[s, g, :] = jnp.sum(jnp.where(on_lane, scale_N[:, None], 0.0), axis=0)


@functools.partial(jax.jit, static_argnames=("interpret", "rows_first", "live_rows"))
def gate_up_act_e4m3(parts_WPSFN: jax.Array, num_slots_1: jax.Array,
                     interpret: bool | None = None, rows_first: bool = False,
                     live_rows: int | None = None):
  """(act8 [S, N, F] e4m3, its scales [S, F/128 x L] float32) of gate_up_act's bf16 act from
  the same partials (either layout, gate_up_act's rows_first and live_rows): each row's
  128-column groups quantized as fp8_gemm.quantize_activations quantizes them, the scales laid
  out per slot as fp8_gemm.act_lanes lays out a step's (lane n of group g: row n's scale, 0
  past the live rows). Slots from num_slots on: zeros."""
  weights, splits, slots, ffn, rows, live = _layout(parts_WPSFN, rows_first, live_rows)
  if weights != 2 or parts_WPSFN.dtype != jnp.float32 or not quantizes(ffn, rows):
    raise ValueError(f"gate_up_act_e4m3 takes float32 partials [2, P, S, F, N] with F a "
                     f"multiple of {BLOCK} and N a power of two up to 64, got "
                     f"{parts_WPSFN.shape} {parts_WPSFN.dtype}")
  if interpret is None:
    interpret = not platform.on_gpu()
  groups = ffn // BLOCK
  act8, lanes = pl.pallas_call(
      functools.partial(_e4m3_kernel, splits=splits, rows=rows, rows_first=rows_first,
                        live_rows=live, interpret=interpret),
      out_shape=(jax.ShapeDtypeStruct((slots, rows, ffn), E4M3),
                 jax.ShapeDtypeStruct((slots, groups, lanes_per_group(rows)), jnp.float32)),
      grid=(slots, groups),
      compiler_params=pltriton.CompilerParams(num_warps=E4M3_WARPS, num_stages=1),
      interpret=interpret, name="expert_gate_up_act_e4m3",
  )(num_slots_1.astype(jnp.int32), parts_WPSFN)
  return act8, lanes.reshape(slots, -1)
