"""FP8 experts at decode sizes: the decode expert path on block-scaled e4m3 weights, read as
published (Pallas Mosaic GPU).

DeepSeek-V3 / R1 and the Qwen MoE FP8 releases store each expert projection [out, in] in
float8_e4m3fn with one float32 scale per 128 x 128 block. A decode or verify step reads the
weights of the experts its few tokens picked, once each (scaled into bf16 copies for the bf16
kernels, 4-13x slower than bf16 weights on an H200, BENCHMARKS.md). Here the TMA streams each
picked expert's e4m3 tiles and block scales into the FP8 product kernel's pipeline
(jspec.pallas_kernels.fp8_block_kernel: the tile widened to x's 16-bit type in registers, each
128-K block's products scaled in float32), over the slots of the decode plan
(jspec.pallas_kernels.decode_routing: one slot per picked expert, all T tokens multiplied, a
token that did not pick the expert weighted 0):

  gate, up  [S, F, N] = W_gate[e_s] @ x^T, W_up[e_s] @ x^T      (one kernel, two sums)
  act       [S, N, F] = silu(gate) * up       (float32; bfloat16 x: jspec.pallas_kernels.expert_act)
  out       [S, D, N] = W_down[e_s] @ act_s^T                     (one kernel)
  y         [T, D]    = sum over each token's slots of weight x out   (XLA, float32)

A bfloat16 model's x and act go in as bfloat16, x as it is (no XLA pass over it before the
kernel; act is rounded to bfloat16 as the model's own MLP would), or x as the norm before the
layer wrote it in e4m3 (x_e4m3), multiplied on the FP8 tensor cores. Other x and act go in as
float16 with a power-of-two scale per row (exact for bf16 values, float16's 11 bits for the
rest; the products are undone by the inverse), as in fp8_gemm's two routes.

Shape letters: T tokens, K experts per token, E experts, D hidden size, F expert intermediate
size, S slots, N padded tokens (wgmma's N), R lanes of a repeated scale.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import decode_gemm, decode_routing, expert_act, fp8_layout, platform
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3, scaled_block_sums
from jspec.pallas_kernels.fp8_gemm import (MAX_ROWS, SCALE_LANES, act_lanes, bfloat16_rows,
                                           quantize_activations)
from jspec.pallas_kernels.shared import dequantize, float16_rows, smem_transforms


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
                  splits: int = 1, summed: bool = True, act_lanes_X=None):
  """[W, S, out, N] float32 (summed False: the K slices' partials [W, P, S, out, N], the sum
  left to the reader): for weight j and each used slot s, W_j[e_s] @ x_s^T with each
  128-K block's products times its scale. x: [N, in] float16, bfloat16 or e4m3 shared by
  every slot (fp8_gemm.bfloat16_rows' rows: the TMA fills the padded N's missing rows), or
  [S, N, in] one per slot, float16, bfloat16 or e4m3. e4m3 x multiplies on the FP8 tensor
  cores with its rows' scales per 128-K group: shared x's as act_lanes_X [in/128 x L]
  (fp8_gemm.act_lanes', as a norm kernel writes them), which the kernel multiplies into the
  weights' block scales as it reads them; per-slot x's as act_scale_SKbN [S, in/128, N]
  (quantize_activations'). Slots past num_slots are not written (nor summed where K is
  split).

  splits: K slices per (slot, 128-column block) item, each its own work item, their float32
  partials summed after the kernel: a step with few slots of narrow experts (one token, 8 of
  Qwen3-30B-A3B's 768-wide ones: 48 items) would otherwise leave most SMs idle."""
  per_slot_x = x.ndim == 3
  fp8_x = x.dtype == E4M3
  per_slot_fp8, shared_fp8 = fp8_x and per_slot_x, fp8_x and not per_slot_x
  if per_slot_fp8 != (act_scale_SKbN is not None) or shared_fp8 != (act_lanes_X is not None):
    raise ValueError("e4m3 x goes per slot ([S, N, in]) with its act_scale_SKbN, or shared "
                     "([N, in]) with its act_lanes_X; 16-bit x with neither")
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
  # Each slot's block scales over `lanes` lanes, so that a step's scales arrive with its tiles
  # as one TMA block (fp8_block_kernel.partials says why); gathered for the slots only, or
  # read by expert where made beforehand (Fp8Experts.lanes). A lane holds the weight block's
  # scale, times row n's scale of that K group where x is e4m3 per slot.
  by_expert = (not per_slot_fp8 and lanes == SCALE_LANES
               and all(w.lanes is not None for w in weights))
  if by_expert:
    for w in weights:
      if w.lanes.shape != (*w.scale.shape[:2], w.scale.shape[2] * SCALE_LANES):
        raise ValueError(f"Fp8Experts.lanes has shape {w.lanes.shape}, not scale_lanes("
                         f"scale)'s for a scale of {w.scale.shape}")
    scale_rows = [w.lanes for w in weights]
  elif per_slot_fp8:
    act_SKbR = jnp.pad(act_scale_SKbN.astype(jnp.float32),
                       ((0, 0), (0, 0), (0, lanes - rows)))
    scale_rows = [(w.scale[slot_expert_S].astype(jnp.float32)[..., None]
                   * act_SKbR[:, None]).reshape(num_slots_max, out // BLOCK, -1)
                  for w in weights]
  else:
    scale_rows = [jnp.repeat(w.scale[slot_expert_S].astype(jnp.float32), lanes, axis=2)
                  for w in weights]
  stage_bytes = (num_weights * (BLOCK * step_k + blocks_per_step * lanes * 4)
                 + rows * step_k * x.dtype.itemsize + shared_fp8 * blocks_per_step * lanes * 4)
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
      a_spec = plgpu.BlockSpec((blocks_per_step * lanes,), lambda i, k: (k_step(i, k),),
                               delay_release=delay_release)
      return [x_spec] + [w_spec] * num_weights + [s_spec] * num_weights + [a_spec] * shared_fp8

    def accumulate(slot, col, k, sums, smem_refs):
      x_smem, *rest = smem_refs
      return scaled_block_sums(sums, x_smem, rest[:num_weights],
                               rest[num_weights:2 * num_weights], blocks_per_step, rows, lanes,
                               fp8_x, a_smem=rest[2 * num_weights] if shared_fp8 else None)

    def epilogue(part, col, sums, smem_refs, o_smem):
      slot, split = slot_and_split(part)
      for j, total in enumerate(sums):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the tile's previous store read it
        o_smem[...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[j, split, slot, pl.ds(col * BLOCK, BLOCK)])

    decode_gemm._slot_pipeline(
        num_slots=num_slots_ref[0] * splits, col_blocks=out // BLOCK, k_steps=k_steps,
        block_cols=BLOCK, tokens_pad=rows, dtype=jnp.float32, in_specs_for=in_specs_for,
        num_sums=num_weights, stages=stages, epilogue=epilogue, operands_of=None,
        async_mma=False, accumulate=accumulate,
        out_smem=plgpu.SMEM((BLOCK, rows), jnp.float32,
                            transforms=smem_transforms(rows, jnp.float32)),
    )(*in_refs)

  parts_WPSON = decode_gemm._kernel_call(
      body, (num_weights, splits, num_slots_max, out, rows), jnp.float32, "fp8_experts_decode")(
          slot_expert_S, num_slots_1, x, *[w.w8 for w in weights], *scale_rows,
          *([act_lanes_X.astype(jnp.float32)] if shared_fp8 else []))
  if not summed:
    return parts_WPSON
  return parts_WPSON[:, 0] if splits == 1 else jnp.sum(parts_WPSON, axis=1)


def _to_float16_slots(act_SNF):
  """float16_rows over every (slot, token) row: (act16 [S, N, F], 2^e [S, N])."""
  s, n, f = act_SNF.shape
  act16, scale = float16_rows(act_SNF.reshape(s * n, f))
  return act16.reshape(s, n, f), scale.reshape(s, n)


# Where no e4m3 rows of x are given, the decode path quantizes x itself (XLA's pass,
# fp8_gemm.quantize_activations) for gate / up: the same products as on a norm kernel's rows
# (a reference for them, and a benchmark setting); off, x goes in as it is.
X_E4M3 = False
# A bfloat16 step's activation from the gate / up partials in one kernel
# (jspec.pallas_kernels.expert_act), where XLA runs two.
ACT_KERNEL = True
# Tokens (wgmma's N) up to which gate and up share one kernel: each adds a [128, N] float32 sum
# and a step's products of the same size to a thread's registers.
TWO_SUMS_MAX_ROWS = 32
# The most tokens one decode-path call multiplies per slot (fp8_gemm's float32 sums of a
# 128-column item in registers); larger steps go in chunks of this many.
CHUNK_TOKENS = MAX_ROWS
# Up to this many tokens a step takes the decode path (one chunk); larger steps group their
# token copies by expert (jspec.pallas_kernels.fp8_experts_grouped), reading each routed expert
# about once where chunks would read it once each: 0.53x / 0.35x the time of 2 / 4 chunks at
# DeepSeek-V3's shapes on an H100, 0.69x the decode path's at 64 tokens of Qwen3-30B-A3B
# (BENCHMARKS.md, "FP8 experts at prefill sizes"; where the two cross below 64: not measured).
DECODE_PATH_MAX_TOKENS = CHUNK_TOKENS


def experts_fp8(x_TD, topk_ids_TK, topk_weights_TK, w_gate: Fp8Experts, w_up: Fp8Experts,
                w_down: Fp8Experts, plan: decode_routing.DecodePlan | None = None,
                x_e4m3=None) -> jax.Array:
  """experts_fp8_decode over chunks of at most CHUNK_TOKENS tokens, at DECODE_TILING; `plan`
  (made beforehand) that of one chunk's tokens, `x_e4m3` (x8, lanes) x's e4m3 rows where one
  chunk holds them all (experts_fp8_decode's)."""
  num_tokens = x_TD.shape[0]
  if (plan is not None or x_e4m3 is not None) and num_tokens > CHUNK_TOKENS:
    raise ValueError(f"a decode plan or e4m3 rows cover one chunk of {CHUNK_TOKENS} tokens, "
                     f"not {num_tokens}")
  parts = [experts_fp8_decode(x_TD[start:start + CHUNK_TOKENS],
                              topk_ids_TK[start:start + CHUNK_TOKENS],
                              topk_weights_TK[start:start + CHUNK_TOKENS], w_gate, w_up, w_down,
                              tiling=DECODE_TILING, plan=plan, x_e4m3=x_e4m3)
           for start in range(0, num_tokens, CHUNK_TOKENS)]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


@dataclasses.dataclass(frozen=True)
class Fp8ExpertsTiling:
  """128-K blocks per pipeline step and pipeline depth (0: as many as fit) of the gate/up
  kernel (two weights: each block widens two tiles in registers) and of the down kernel; K
  slices of each (None: fp8_layout.choose_splits' for the step's largest slot count)."""
  gate_up_blocks: int = 1
  down_blocks: int = 2
  num_stages: int = 4
  gate_up_splits: int | None = None
  down_splits: int | None = None


# The tiling the expert backend runs (read at trace time: a benchmark may set another before
# it builds a model, e.g. whole K for a before / after comparison).
DECODE_TILING = Fp8ExpertsTiling()


def _splits(chosen: int | None, k: int, num_slots_max: int, out: int) -> int:
  """K slices that fill the SMs' rounds with the step's (slot, column block) items."""
  return chosen or fp8_layout.choose_splits(k, num_slots_max * out, platform.num_sms())


def experts_fp8_decode(x_TD, topk_ids_TK, topk_weights_TK, w_gate: Fp8Experts,
                       w_up: Fp8Experts, w_down: Fp8Experts,
                       tiling: Fp8ExpertsTiling = Fp8ExpertsTiling(),
                       plan: decode_routing.DecodePlan | None = None,
                       x_e4m3=None) -> jax.Array:
  """y[t] = sum_k w[t,k] * down_e(silu(x[t] @ gate_e) * (x[t] @ up_e)), the experts in FP8;
  ids outside [0, E) add nothing. Same semantics as moe_backends.experts_reference on the
  dequantized weights. `plan`: as experts.experts_decode's. x_e4m3: (x8 [T, D] e4m3, lanes
  [D/128 x L]), x's rows as the norm before the layer quantized them (fp8_gemm.act_lanes'
  layout; norm_router's `quantize`): gate / up multiply them on the FP8 tensor cores, with no
  pass over x before the kernel."""
  num_tokens, _ = topk_ids_TK.shape
  num_experts = w_gate.w8.shape[0]
  plan = decode_routing.plan_unless_given(plan, topk_ids_TK, topk_weights_TK, num_experts)
  rows = decode_routing.padded_tokens(num_tokens)
  num_slots_max = plan.slot_expert_S.shape[0]
  _, ffn, dim = w_gate.w8.shape  # [E, F, D]; w_down's [E, D, F]
  gate_up_splits = _splits(tiling.gate_up_splits, dim, num_slots_max, ffn)
  down_splits = _splits(tiling.down_splits, ffn, num_slots_max, dim)
  bfloat16 = x_TD.dtype == jnp.bfloat16
  act_lanes_X = None
  if x_e4m3 is None and X_E4M3:
    x8_TD, x_scale_TKb = quantize_activations(x_TD)
    x_e4m3 = (x8_TD, act_lanes(x_scale_TKb))
  if x_e4m3 is not None:  # the norm's e4m3 rows, their scales applied inside the kernel
    (x_ND, act_lanes_X), x_scale_N = x_e4m3, 1.0
    if x_ND.shape != x_TD.shape or x_ND.dtype != E4M3:
      raise ValueError(f"x_e4m3's rows are {x_ND.shape} {x_ND.dtype}, not x's {x_TD.shape} "
                       f"in e4m3")
  elif bfloat16:  # as it is: no pass over x before the kernel
    x_ND, x_scale_N = bfloat16_rows(x_TD), 1.0
  else:
    x16_TD, x_scale_T = float16_rows(x_TD)
    x_ND = jnp.pad(x16_TD, ((0, rows - num_tokens), (0, 0)))
    x_scale_N = jnp.pad(x_scale_T, (0, rows - num_tokens), constant_values=1.0)
  one_call = rows <= TWO_SUMS_MAX_ROWS
  if one_call and bfloat16 and ACT_KERNEL and expert_act.fits(ffn, rows):
    # The sums, the activation and its rounding in one kernel (expert_act says why).
    parts_WPSFN = slot_products(x_ND, (w_gate, w_up), plan.slot_expert_S, plan.num_slots_1,
                                tiling.gate_up_blocks, tiling.num_stages,
                                splits=gate_up_splits, summed=False, act_lanes_X=act_lanes_X)
    act_in_SNF, act_scale_SN = expert_act.gate_up_act(parts_WPSFN, plan.num_slots_1), 1.0
  else:
    if one_call:
      gate_up = slot_products(x_ND, (w_gate, w_up), plan.slot_expert_S, plan.num_slots_1,
                              tiling.gate_up_blocks, tiling.num_stages, splits=gate_up_splits,
                              act_lanes_X=act_lanes_X)
    else:  # one sum per kernel: two [128, N] float32 sums and their products overflow registers
      gate_up = [slot_products(x_ND, (w,), plan.slot_expert_S, plan.num_slots_1,
                               tiling.gate_up_blocks, tiling.num_stages,
                               splits=gate_up_splits, act_lanes_X=act_lanes_X)[0]
                 for w in (w_gate, w_up)]
    gate_SFN, up_SFN = gate_up[0] * x_scale_N, gate_up[1] * x_scale_N
    act_SNF = jnp.swapaxes(jax.nn.silu(gate_SFN) * up_SFN, 1, 2)
    # Slots past the used ones were not written: zeros keep their (unused) rows finite.
    used_S = jnp.arange(act_SNF.shape[0]) < plan.num_slots_1[0]
    act_SNF = jnp.where(used_S[:, None, None], act_SNF, 0.0)
    if bfloat16:  # rounded as the model's own MLP rounds it
      act_in_SNF, act_scale_SN = act_SNF.astype(jnp.bfloat16), 1.0
    else:
      act_in_SNF, act_scale_SN = _to_float16_slots(act_SNF)
  token_scale_SN = act_scale_SN * plan.weight_SR[:, :rows]
  (down_SDN,) = slot_products(act_in_SNF, (w_down,), plan.slot_expert_S, plan.num_slots_1,
                              tiling.down_blocks, tiling.num_stages, splits=down_splits)
  out_SND = jnp.swapaxes(down_SDN * token_scale_SN[:, None, :], 1, 2)
  # Materialized, as fp8_gemm's sums of partials (it says why): fused into the residual add and
  # norm after this layer, each output could gather its slots, across the kernel's [S, D, N]
  # order, inside one thread block.
  return jax.lax.optimization_barrier(decode_routing.combine_slots(out_SND, plan, x_TD.dtype))
