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
                        act in e4m3 where it pays (DOWN_E4M3: e4m3 x e4m3 products)
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

from jspec.pallas_kernels import decode_routing, expert_act, fp8_layout, platform
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3
from jspec.pallas_kernels.fp8_expert_products import Fp8Experts, fits_kernel, slot_products
from jspec.pallas_kernels.fp8_gemm import (MAX_ROWS, act_lanes, bfloat16_rows,
                                           quantize_activations)
from jspec.pallas_kernels.shared import float16_rows

# Fp8Experts, fits_kernel and slot_products live in fp8_expert_products; the expert backends
# and tests name them here, with the decode path.
__all__ = ["BLOCK", "Fp8Experts", "fits_kernel", "slot_products", "experts_fp8",
           "experts_fp8_decode"]


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
# A bfloat16 step's down product on e4m3 act where it pays (expert_act.e4m3_pays): the
# activation kernel quantizes act per slot, row and 128 columns (gate_up_act_e4m3), and the
# down kernel multiplies e4m3 by e4m3 with no widening of its tiles, as a dense FP8 MLP's
# down_proj does.
DOWN_E4M3 = True
# The gate / up kernel's K-slice partials rows first ([2, P, S, N, F]) for the activation
# kernel, which then reads the step's live rows only (one token: 1 of 8 rows); built, not yet
# timed, so off.
GATE_UP_ROWS_FIRST = False
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
    rows_first = GATE_UP_ROWS_FIRST
    layout = dict(rows_first=rows_first, live_rows=num_tokens if rows_first else None)
    parts_WPSFN = slot_products(x_ND, (w_gate, w_up), plan.slot_expert_S, plan.num_slots_1,
                                tiling.gate_up_blocks, tiling.num_stages,
                                splits=gate_up_splits, summed=False, act_lanes_X=act_lanes_X,
                                rows_first=rows_first)
    if DOWN_E4M3 and expert_act.e4m3_pays(gate_up_splits, ffn, rows):
      act8_SNF, act_lanes_SX = expert_act.gate_up_act_e4m3(parts_WPSFN, plan.num_slots_1,
                                                           **layout)
      (down_SDN,) = slot_products(act8_SNF, (w_down,), plan.slot_expert_S, plan.num_slots_1,
                                  tiling.down_blocks, tiling.num_stages, splits=down_splits,
                                  act_lanes_SX=act_lanes_SX)
      return _combined(down_SDN, plan.weight_SR[:, :rows], plan, x_TD.dtype)
    act_in_SNF = expert_act.gate_up_act(parts_WPSFN, plan.num_slots_1, **layout)
    act_scale_SN = 1.0
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
  (down_SDN,) = slot_products(act_in_SNF, (w_down,), plan.slot_expert_S, plan.num_slots_1,
                              tiling.down_blocks, tiling.num_stages, splits=down_splits)
  return _combined(down_SDN, act_scale_SN * plan.weight_SR[:, :rows], plan, x_TD.dtype)


def _combined(down_SDN, token_scale_SN, plan: decode_routing.DecodePlan, dtype):
  """y [T, D]: each token's slots' down products times their scales (routing weight, x's row
  scale), summed."""
  out_SND = jnp.swapaxes(down_SDN * token_scale_SN[:, None, :], 1, 2)
  # Materialized, as fp8_gemm's sums of partials (it says why): fused into the residual add and
  # norm after this layer, each output could gather its slots, across the kernel's [S, D, N]
  # order, inside one thread block.
  return jax.lax.optimization_barrier(decode_routing.combine_slots(out_SND, plan, dtype))
