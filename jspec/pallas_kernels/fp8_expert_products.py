"""FP8 experts as checkpoints store them (Fp8Experts) and the decode path's product kernel over
the slots of a decode plan (slot_products, Pallas Mosaic GPU): each picked expert's e4m3 tiles
and block scales streamed by the TMA into the FP8 product kernel's pipeline
(jspec.pallas_kernels.fp8_block_kernel), for jspec.pallas_kernels.fp8_experts (decode and
verify steps) and fp8_experts_grouped (prefill).

Shape letters: E experts, S slots, N padded tokens (wgmma's N), W weights in one call, P K
slices, L lanes of a repeated scale.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import decode_gemm, decode_routing
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3, scaled_block_sums
from jspec.pallas_kernels.fp8_gemm import SCALE_LANES
from jspec.pallas_kernels.shared import dequantize, smem_transforms


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Experts:
  """One projection of every expert as an FP8 checkpoint stores it: w8 [E, out, in]
  float8_e4m3fn, scale [E, ceil(out / 128), ceil(in / 128)] float32 (`weight_scale_inv`,
  which multiplies). Passed to the expert backends in place of a [E, in, out] array. lanes:
  fp8_gemm.scale_lanes(scale), made once before a loop of steps (jspec.models.projections.
  with_loop_constants) so that a decode step's kernel reads its slots' scales as they are,
  with no gather and repeat of its own; or None."""

  w8: jax.Array
  scale: jax.Array
  lanes: jax.Array | None = None

  @property
  def shape(self) -> tuple[int, int, int]:
    """[E, in, out]: the layout of the bf16 experts this stands for."""
    num_experts, out, inner = self.w8.shape
    return num_experts, inner, out

  def dequantized(self, dtype) -> jax.Array:
    """[E, in, out] in `dtype`: each e4m3 value times its block's scale, in float32."""
    scaled = dequantize(self.w8, self.scale, 1, (BLOCK, BLOCK), dtype, jnp)
    return jnp.swapaxes(scaled, 1, 2)


def fits_kernel(*weights: Fp8Experts) -> bool:
  """Whole 128 x 128 blocks on both axes (a tp shard of F always holds whole blocks: a mesh that
  would split one is refused at load)."""
  return all(w.w8.dtype == E4M3 and w.w8.shape[1] % BLOCK == 0 and w.w8.shape[2] % BLOCK == 0
             and w.scale.shape[1:] == (w.w8.shape[1] // BLOCK, w.w8.shape[2] // BLOCK)
             for w in weights)


def slot_products(x, weights: tuple[Fp8Experts, ...], slot_expert_S, num_slots_1,
                  blocks_per_step: int, num_stages: int, act_scale_SKbN=None,
                  splits: int = 1, summed: bool = True, act_lanes_X=None,
                  act_lanes_SX=None, rows_first: bool = False):
  """[W, S, out, N] float32 (summed False: the K slices' partials [W, P, S, out, N], the sum
  left to the reader): for weight j and each used slot s, W_j[e_s] @ x_s^T with each
  128-K block's products times its scale. x: [N, in] float16, bfloat16 or e4m3 shared by
  every slot (fp8_gemm.bfloat16_rows' rows: the TMA fills the padded N's missing rows), or
  [S, N, in] one per slot, float16, bfloat16 or e4m3. e4m3 x multiplies on the FP8 tensor
  cores with its rows' scales per 128-K group: shared x's as act_lanes_X [in/128 x L]
  (fp8_gemm.act_lanes', as a norm kernel writes them), which the kernel multiplies into the
  weights' block scales as it reads them; per-slot x's as act_scale_SKbN [S, in/128, N]
  (quantize_activations'), which XLA multiplies into the weights' block scales before the
  kernel, or as act_lanes_SX [S, in/128 x L] (act_lanes' layout per slot, as
  expert_act.gate_up_act_e4m3 writes them), which the kernel multiplies in as it reads them.
  Slots past num_slots are not written (nor summed where K is split).

  splits: K slices per (slot, 128-column block) item, each its own work item, their float32
  partials summed after the kernel: a step with few slots of narrow experts (one token, 8 of
  Qwen3-30B-A3B's 768-wide ones: 48 items) would otherwise leave most SMs idle.

  rows_first (with summed False): the partials as [W, P, S, N, out], each tile stored
  transposed, so that a reader of the live rows alone reads them contiguously (one token of a
  decode step: 1 row of the 8 wgmma multiplies)."""
  if rows_first and summed:
    raise ValueError("rows_first partials are left to their reader to sum (summed=False)")
  per_slot_x = x.ndim == 3
  fp8_x = x.dtype == E4M3
  per_slot_fp8, shared_fp8 = fp8_x and per_slot_x, fp8_x and not per_slot_x
  slot_lanes = act_lanes_SX is not None
  if (per_slot_fp8 != ((act_scale_SKbN is not None) != slot_lanes)
      or (slot_lanes and act_scale_SKbN is not None)
      or shared_fp8 != (act_lanes_X is not None)):
    raise ValueError("e4m3 x goes per slot ([S, N, in]) with its act_scale_SKbN or its "
                     "act_lanes_SX, or shared ([N, in]) with its act_lanes_X; 16-bit x with "
                     "none")
  rows, k = x.shape[-2:]
  if not per_slot_x:  # the shared x of a decode step: its padded rows
    rows = decode_routing.padded_tokens(rows)
  num_weights = len(weights)
  out = weights[0].w8.shape[1]
  num_slots_max = slot_expert_S.shape[0]
  if k % (splits * BLOCK):
    raise ValueError(f"K={k} does not split into {splits} slices of whole {BLOCK}-blocks")
  if k // splits % (blocks_per_step * BLOCK):
    blocks_per_step = 1  # an odd number of blocks
  step_k = blocks_per_step * BLOCK
  k_steps = k // splits // step_k
  lanes = max(rows, SCALE_LANES)
  if shared_fp8 and act_lanes_X.shape != (k // BLOCK * lanes,):
    raise ValueError(f"act_lanes_X has shape {act_lanes_X.shape}, not fp8_gemm.act_lanes' "
                     f"{(k // BLOCK * lanes,)} for {x.shape[0]} rows of {k}")
  if slot_lanes and act_lanes_SX.shape != (x.shape[0], k // BLOCK * lanes):
    raise ValueError(f"act_lanes_SX has shape {act_lanes_SX.shape}, not "
                     f"{(x.shape[0], k // BLOCK * lanes)} for {x.shape[0]} slots of {rows} "
                     f"rows of {k}")
  # Each slot's block scales over `lanes` lanes, so that a step's scales arrive with its tiles
  # as one TMA block (fp8_block_kernel.partials says why); gathered for the slots only, or
  # read by expert where made beforehand (Fp8Experts.lanes). A lane holds the weight block's
  # scale, times row n's scale of that K group where x is e4m3 per slot.
  by_expert = ((not per_slot_fp8 or slot_lanes) and lanes == SCALE_LANES
               and all(w.lanes is not None for w in weights))
  if by_expert:
    for w in weights:
      if w.lanes.shape != (*w.scale.shape[:2], w.scale.shape[2] * SCALE_LANES):
        raise ValueError(f"Fp8Experts.lanes has shape {w.lanes.shape}, not scale_lanes("
                         f"scale)'s for a scale of {w.scale.shape}")
    scale_rows = [w.lanes for w in weights]
  elif per_slot_fp8 and not slot_lanes:
    act_SKbR = jnp.pad(act_scale_SKbN.astype(jnp.float32),
                       ((0, 0), (0, 0), (0, lanes - rows)))
    scale_rows = [(w.scale[slot_expert_S].astype(jnp.float32)[..., None]
                   * act_SKbR[:, None]).reshape(num_slots_max, out // BLOCK, -1)
                  for w in weights]
  else:
    scale_rows = [jnp.repeat(w.scale[slot_expert_S].astype(jnp.float32), lanes, axis=2)
                  for w in weights]
  stage_bytes = (num_weights * (BLOCK * step_k + blocks_per_step * lanes * 4)
                 + rows * step_k * x.dtype.itemsize
                 + (shared_fp8 or slot_lanes) * blocks_per_step * lanes * 4)
  stages = decode_gemm._num_stages(decode_gemm.DecodeTiling(BLOCK, step_k, num_stages),
                                   stage_bytes)
  decode_gemm._check_aligned(((rows, step_k), x.dtype), ((BLOCK, step_k), E4M3),
                             ((blocks_per_step * lanes,), jnp.float32))

  def slot_and_split(part):
    """The pipeline's slot index `part` (slot x splits + slice) as (slot, K slice)."""
    if splits == 1:
      return part, 0
    return jax.lax.div(part, jnp.int32(splits)), jax.lax.rem(part, jnp.int32(splits))

  def body(slot_expert_ref, num_slots_ref, *refs):
    *in_refs, out_ref = refs

    def in_specs_for(item, delay_release):
      def slot(i):
        return slot_and_split(item(i)[0])[0]

      def k_step(i, k):
        return slot_and_split(item(i)[0])[1] * k_steps + k

      if per_slot_x:
        x_spec = plgpu.BlockSpec((None, rows, step_k), lambda i, k: (slot(i), 0, k_step(i, k)),
                                 transforms=smem_transforms(step_k, x.dtype),
                                 delay_release=delay_release)
      else:
        x_spec = plgpu.BlockSpec((rows, step_k), lambda i, k: (0, k_step(i, k)),
                                 transforms=smem_transforms(step_k, x.dtype),
                                 delay_release=delay_release)
      w_spec = plgpu.BlockSpec((None, BLOCK, step_k),
                               lambda i, k: (slot_expert_ref[slot(i)], item(i)[1], k_step(i, k)),
                               transforms=smem_transforms(BLOCK, E4M3),
                               delay_release=delay_release)
      s_spec = plgpu.BlockSpec((None, None, blocks_per_step * lanes),
                               lambda i, k: (slot_expert_ref[slot(i)] if by_expert else slot(i),
                                             item(i)[1], k_step(i, k)),
                               delay_release=delay_release)
      if slot_lanes:
        a_spec = plgpu.BlockSpec((None, blocks_per_step * lanes),
                                 lambda i, k: (slot(i), k_step(i, k)),
                                 delay_release=delay_release)
      else:
        a_spec = plgpu.BlockSpec((blocks_per_step * lanes,), lambda i, k: (k_step(i, k),),
                                 delay_release=delay_release)
      return ([x_spec] + [w_spec] * num_weights + [s_spec] * num_weights
              + [a_spec] * (shared_fp8 or slot_lanes))

    def accumulate(slot, col, k, sums, smem_refs):
      x_smem, *rest = smem_refs
      return scaled_block_sums(sums, x_smem, rest[:num_weights],
                               rest[num_weights:2 * num_weights], blocks_per_step, rows, lanes,
                               fp8_x,
                               a_smem=rest[2 * num_weights] if shared_fp8 or slot_lanes else None)

    def epilogue(part, col, sums, smem_refs, o_smem):
      slot, split = slot_and_split(part)
      for j, total in enumerate(sums):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the tile's previous store read it
        columns = pl.ds(col * BLOCK, BLOCK)
        if rows_first:  # 32-bit values store transposed from WGMMA's transposed layout only
          o_smem.T[...] = plgpu.layout_cast(total, plgpu.Layout.WGMMA_TRANSPOSED)
        else:
          o_smem[...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[j, split, slot, :, columns] if rows_first
                                else out_ref.at[j, split, slot, columns])

    decode_gemm._slot_pipeline(
        num_slots=num_slots_ref[0] * splits, col_blocks=out // BLOCK, k_steps=k_steps,
        block_cols=BLOCK, tokens_pad=rows, dtype=jnp.float32, in_specs_for=in_specs_for,
        num_sums=num_weights, stages=stages, epilogue=epilogue, operands_of=None,
        async_mma=False, accumulate=accumulate,
        out_smem=(plgpu.SMEM((rows, BLOCK), jnp.float32,
                             transforms=smem_transforms(BLOCK, jnp.float32)) if rows_first
                  else plgpu.SMEM((BLOCK, rows), jnp.float32,
                                  transforms=smem_transforms(rows, jnp.float32))),
    )(*in_refs)

  tile_shape = (rows, out) if rows_first else (out, rows)
  parts_WPSON = decode_gemm._kernel_call(
      body, (num_weights, splits, num_slots_max, *tile_shape), jnp.float32,
      "fp8_experts_decode")(
          slot_expert_S, num_slots_1, x, *[w.w8 for w in weights], *scale_rows,
          *([act_lanes_X.astype(jnp.float32)] if shared_fp8 else []),
          *([act_lanes_SX.astype(jnp.float32)] if slot_lanes else []))
  if not summed:
    return parts_WPSON
  return parts_WPSON[:, 0] if splits == 1 else jnp.sum(parts_WPSON, axis=1)
