"""FP8 experts' gate / up at decode sizes with SwiGLU in the kernel's epilogue: the whole
activation of a step's slots in one Pallas Mosaic GPU kernel, stored in bfloat16,

  act [S, N, F] = bf16(silu(x @ W_gate[e_s]^T) * (x @ W_up[e_s]^T))   for the used slots s,

on block-scaled e4m3 weights [E, F, D] as published (128 x 128 blocks, one float32 scale each)
and a bfloat16 model's x [T, D] as it is.

Why: the K-sliced form (fp8_experts.slot_products, then expert_act's kernel) spreads few
slots of narrow experts over the SMs by cutting K, so each item's sums are partial: they go
to global memory in float32 (at one token of Qwen3-30B-A3B, 3 MB written and read again, 8% of
the weights' bytes) and a second kernel sums them into the activation. Here an item is a
(slot, 64-column block) over the whole of K, as the bf16 decode kernel's
(decode_gemm.gate_up_decode): 64-column items make twice the items of 128-column ones (96 at
one token of Qwen3-30B-A3B), every item's sums are whole, and its epilogue writes the
activation. A 64-column item reads half of its 128-row block scales' rows; the scale is the
block's all the same.

Each pipeline step streams an item's gate and up tiles [64, 128 x blocks] and their block
scales, widens the tiles in registers and multiplies them with x (fp8_block_kernel's
products), each 128-K block's products times its scale in float32. Slots from num_slots on
are not written (the down kernel reads the used slots only).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import decode_gemm
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3, scaled_block_sums
from jspec.pallas_kernels.fp8_gemm import SCALE_LANES
from jspec.pallas_kernels.shared import silu_mul, smem_transforms

# Two [64, N] float32 sums and a step's products of the same size in a thread's registers.
MAX_ROWS = 32


@dataclasses.dataclass(frozen=True)
class GateUpTiling:
  """block_cols: weight rows (F) per item, wgmma's M (64 or 128); blocks_per_step: 128-K
  blocks a pipeline step multiplies; num_stages: pipeline depth (0: as many as fit)."""
  block_cols: int = 64
  blocks_per_step: int = 1
  num_stages: int = 8


# The tiling the decode path runs (read at trace time: a benchmark may set another).
TILING = GateUpTiling()


def fits(w_gate, rows: int, tiling: GateUpTiling | None = None) -> bool:
  """Shapes the kernel takes: whole 128-blocks of D, whole items of F, at most MAX_ROWS rows."""
  tiling = tiling or TILING
  _, ffn, dim = w_gate.w8.shape
  return (rows <= MAX_ROWS and dim % (BLOCK * tiling.blocks_per_step) == 0
          and ffn % tiling.block_cols == 0 and BLOCK % tiling.block_cols == 0)


def item_count(num_slots: int, ffn: int, tiling: GateUpTiling | None = None) -> int:
  """Work items of a step of num_slots slots: (slot, column block) pairs."""
  return num_slots * (ffn // (tiling or TILING).block_cols)


def gate_up_act(x_ND, w_gate, w_up, slot_expert_S, num_slots_1, rows: int,
                tiling: GateUpTiling | None = None) -> jax.Array:
  """act [S, rows, F] bfloat16 for the used slots (fp8_experts.Fp8Experts w_gate / w_up,
  [E, F, D]); x_ND bfloat16, up to `rows` rows (fp8_gemm.bfloat16_rows': the TMA fills the
  missing rows of a tile with zeros, whose activations are dropped)."""
  tiling = tiling or TILING
  if x_ND.dtype != jnp.bfloat16:
    raise ValueError(f"gate_up_act takes bfloat16 x, got {x_ND.dtype}")
  if not fits(w_gate, rows, tiling) or w_up.w8.shape != w_gate.w8.shape:
    raise ValueError(f"gate_up_act takes D in whole steps of {tiling.blocks_per_step} x "
                     f"{BLOCK}, F in blocks of {tiling.block_cols} and at most {MAX_ROWS} "
                     f"rows, gate and up alike: got {w_gate.w8.shape}, {w_up.w8.shape}, "
                     f"{rows} rows")
  _, ffn, dim = w_gate.w8.shape
  num_slots_max = slot_expert_S.shape[0]
  bc, per_step = tiling.block_cols, tiling.blocks_per_step
  step_k = per_step * BLOCK
  lanes = max(rows, SCALE_LANES)
  # Each block's scale over `lanes` lanes, so that a step's scales arrive with its tiles as
  # one TMA block: made beforehand by expert (Fp8Experts.lanes), else gathered for the slots.
  by_expert = lanes == SCALE_LANES and w_gate.lanes is not None and w_up.lanes is not None
  if by_expert:
    scale_rows = [w.lanes for w in (w_gate, w_up)]
  else:
    scale_rows = [jnp.repeat(w.scale[slot_expert_S].astype(jnp.float32), lanes, axis=2)
                  for w in (w_gate, w_up)]
  stage_bytes = 2 * (bc * step_k + per_step * lanes * 4) + rows * step_k * x_ND.dtype.itemsize
  stages = decode_gemm._num_stages(decode_gemm.DecodeTiling(bc, step_k, tiling.num_stages),
                                   stage_bytes)
  decode_gemm._check_aligned(((rows, step_k), x_ND.dtype), ((bc, step_k), E4M3),
                             ((per_step * lanes,), jnp.float32))
  blocks_per_scale_row = BLOCK // bc  # items sharing one 128-row block's scales

  def body(slot_expert_ref, num_slots_ref, x_ref, wg_ref, wu_ref, sg_ref, su_ref, act_ref):
    def in_specs_for(item, delay_release):
      def expert(i):
        return slot_expert_ref[item(i)[0]]

      x_spec = plgpu.BlockSpec((rows, step_k), lambda i, k: (0, k),
                               transforms=smem_transforms(step_k, x_ND.dtype),
                               delay_release=delay_release)
      w_spec = plgpu.BlockSpec((None, bc, step_k), lambda i, k: (expert(i), item(i)[1], k),
                               transforms=smem_transforms(BLOCK, E4M3),
                               delay_release=delay_release)
      s_spec = plgpu.BlockSpec(
          (None, None, per_step * lanes),
          lambda i, k: (expert(i) if by_expert else item(i)[0],
                        jax.lax.div(item(i)[1], jnp.int32(blocks_per_scale_row)), k),
          delay_release=delay_release)
      return [x_spec, w_spec, w_spec, s_spec, s_spec]

    def accumulate(slot, col, k, sums, smem_refs):
      x_smem, *rest = smem_refs
      return scaled_block_sums(sums, x_smem, rest[:2], rest[2:], per_step, rows, lanes)

    def epilogue(slot, col, sums, smem_refs, o_smem):
      gate, up = sums
      decode_gemm._store_transposed(silu_mul(gate, up), o_smem,
                                    act_ref.at[slot, :, pl.ds(col * bc, bc)])

    decode_gemm._slot_pipeline(
        num_slots=num_slots_ref[0], col_blocks=ffn // bc, k_steps=dim // step_k,
        block_cols=bc, tokens_pad=rows, dtype=jnp.bfloat16, in_specs_for=in_specs_for,
        num_sums=2, stages=stages, epilogue=epilogue, operands_of=None, async_mma=False,
        accumulate=accumulate,
    )(x_ref, wg_ref, wu_ref, sg_ref, su_ref)

  return decode_gemm._kernel_call(body, (num_slots_max, rows, ffn), jnp.bfloat16,
                                  "fp8_experts_gate_up_act")(
      slot_expert_S, num_slots_1, x_ND, w_gate.w8, w_up.w8, *scale_rows)
