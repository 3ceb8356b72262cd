"""The MoE expert computation on the Pallas Mosaic GPU kernels (jspec's "pallas" backend).

Two paths, chosen by the static problem size:

  grouped (prefill, large verify):
    routing plan (XLA) -> permute (XLA gather) -> gate/up + SwiGLU (kernel)
      -> down x routing weight (kernel) -> unpermute + combine in float32 (XLA gather)
  decode (T * K up to DECODE_MAX_COPIES, T up to DECODE_MAX_TOKENS):
    slot plan (XLA, no sort) -> gate/up + SwiGLU over all T tokens per selected expert (kernel)
      -> down x routing weight (kernel) -> combine in float32 (XLA gather)

Same signature and semantics as `jspec.models.moe_backends.experts_reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.pallas_kernels.experts_ragged import experts_ragged_dot
from jspec.pallas_kernels import (decode_gemm, decode_routing, fp8_experts,
                                  fp8_experts_grouped, grouped_gemm, permute, platform,
                                  routing)
from jspec.pallas_kernels.decode_gemm import DecodeTiling
from jspec.pallas_kernels.grouped_gemm import Tiling

# The kernels' tile: a model built for the "pallas" backend holds expert weights with D and
# each tp shard's F padded to a multiple of it (ModelConfig.padded_for; zeros, so every
# backend computes the same layer on those arrays). The XLA backends take any size.
PALLAS_EXPERT_TILE = 64
# Average token copies per expert up to which tokens go on wgmma's N dimension.
SWAPPED_MAX_ROWS_PER_EXPERT = 32
# The decode path multiplies every selected expert by all T tokens (padded to N, a power of
# two): bytes stay those of the selected experts, arithmetic grows with N x experts used. On an
# H200 at Qwen3-30B-A3B shapes it ran whole MoE layers 1.06-1.32x faster than the grouped path
# from T = 4 to T = 32 x top-8, the largest size measured (BENCHMARKS.md, "MoE decode"); the
# copy limit stops there. N = 64 bounds the float32 sums to 64 registers a thread each.
DECODE_MAX_TOKENS = 64
DECODE_MAX_COPIES = 256


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _block(size: int) -> int:
  """128 where it divides `size`, else 64: every tiling divides a multiple of the tile."""
  return 128 if size % 128 == 0 else 64


def choose_tilings(num_copies: int, num_experts: int, dim: int, ffn: int):
  """(gate_up tiling, down tiling) for a static problem size; both share block_rows. D and F
  (per shard) must be multiples of PALLAS_EXPERT_TILE: models built for this backend hold
  their expert weights padded to it (jspec.models.moe)."""
  if dim % PALLAS_EXPERT_TILE or ffn % PALLAS_EXPERT_TILE:
    raise ValueError(f"the pallas MoE kernels take D and F in multiples of "
                     f"{PALLAS_EXPERT_TILE}, got D={dim}, F={ffn}: build the model with "
                     f"ModelConfig.expert_tile={PALLAS_EXPERT_TILE} (LLM(moe_backend='pallas') "
                     "does), which pads the expert weights with zeros")
  rows_per_expert = -(-num_copies // num_experts)
  if rows_per_expert <= SWAPPED_MAX_ROWS_PER_EXPERT:
    block_rows = min(64, max(8, _pow2_at_least(rows_per_expert)))
    return (Tiling(True, block_rows, 64, _block(dim), 4),
            Tiling(True, block_rows, 64, _block(ffn), 4))
  block_rows = 64 if rows_per_expert <= 64 else 128
  return (Tiling(False, block_rows, 64, 64, 4), Tiling(False, block_rows, _block(dim), 64, 3))


def use_decode_path(num_tokens: int, top_k: int) -> bool:
  return num_tokens <= DECODE_MAX_TOKENS and num_tokens * top_k <= DECODE_MAX_COPIES


def decode_tilings(dim: int, ffn: int) -> tuple[DecodeTiling, DecodeTiling]:
  """(gate_up, down) tilings of the decode path. D and F are multiples of 64 (the tile)."""
  return DecodeTiling(64, _block(dim)), DecodeTiling(_block(dim), _block(ffn))


def experts_decode(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
                   tilings: tuple[DecodeTiling, DecodeTiling] | None = None,
                   plan: decode_routing.DecodePlan | None = None):
  """The decode path: every selected expert's weights read once, all tokens multiplied.
  `plan`: plan_decode's of these ids and weights, made beforehand (by the router's kernel at
  batch-1 decode); None: made here."""
  num_tokens, _ = topk_ids_TK.shape
  num_experts, dim, ffn = w_gate_EDF.shape
  gate_up_tiling, down_tiling = tilings or decode_tilings(dim, ffn)
  plan = decode_routing.plan_unless_given(plan, topk_ids_TK, topk_weights_TK, num_experts)
  tokens_pad = decode_routing.padded_tokens(num_tokens)
  act_SNF = decode_gemm.gate_up_decode(x_TD, w_gate_EDF, w_up_EDF, plan.slot_expert_S,
                                       plan.num_slots_1, tokens_pad, gate_up_tiling)
  out_SND = decode_gemm.down_decode(act_SNF, w_down_EFD, plan.weight_SR, plan.slot_expert_S,
                                    plan.num_slots_1, down_tiling)
  return decode_routing.combine_slots(out_SND, plan, x_TD.dtype)


def takes_decode_plan(experts_fn) -> bool:
  """Whether a MoE layer may hand `experts_fn` the decode plan its router kernel made (plan=):
  the Pallas backend called as it is. The wrappers around it (the expert shard_map,
  moe_backends.live_tokens_only) change the ids the plan was made from."""
  return experts_fn is experts_pallas


def takes_x_e4m3(experts_fn) -> bool:
  """Whether a MoE layer may hand `experts_fn` its input's e4m3 rows as a norm kernel wrote
  them (x_e4m3=): the Pallas backend, as it is or behind a wrapper that passes them on (marked
  `takes_x_e4m3`, moe_backends.live_tokens_only)."""
  return experts_fn is experts_pallas or getattr(experts_fn, "takes_x_e4m3", False)


# Jitted so that a model's identical MoE layers trace and lower once: the program then calls one
# lowered function per layer instead of holding (and building) a copy of the kernels per layer.
@jax.jit
def experts_pallas(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
                   plan: decode_routing.DecodePlan | None = None, x_e4m3=None):
  """y[t] = sum_k w[t,k] * down_e(silu(x[t] @ gate_e) * (x[t] @ up_e)); ids outside [0,E) skip.

  The weights are [E, D, F] / [E, F, D] arrays, or `fp8_experts.Fp8Experts` as FP8
  checkpoints store them. `plan`: decode_routing.plan_decode of the ids and weights, made
  beforehand (router_topk.route_softmax_plan at batch-1 decode), which the decode paths take
  in place of their own; the other paths do not need one. x_e4m3: x's rows in e4m3 and their
  lanes, as the norm before the layer wrote them (fp8_experts.experts_fp8_decode's), which
  the FP8 decode path takes for gate / up; the other paths read x."""
  num_tokens, top_k = topk_ids_TK.shape
  num_experts, dim, ffn = w_gate_EDF.shape
  dtype = x_TD.dtype
  if isinstance(w_gate_EDF, fp8_experts.Fp8Experts):
    # FP8 experts as stored, their e4m3 bytes read by the kernels: decode and verify sizes
    # multiply each picked expert by all the step's tokens, larger steps group the token
    # copies by expert. Experts off the kernels' whole blocks are scaled into `dtype` copies.
    fp8_weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
    if fp8_experts.fits_kernel(*fp8_weights):
      if num_tokens <= fp8_experts.DECODE_PATH_MAX_TOKENS:
        return fp8_experts.experts_fp8(x_TD, topk_ids_TK, topk_weights_TK, *fp8_weights,
                                       plan=plan, x_e4m3=x_e4m3)
      return fp8_experts_grouped.experts_fp8_grouped(x_TD, topk_ids_TK, topk_weights_TK,
                                                     *fp8_weights)
    w_gate_EDF, w_up_EDF, w_down_EFD = (w.dequantized(dtype) for w in fp8_weights)
  if not (w_gate_EDF.dtype == w_up_EDF.dtype == w_down_EFD.dtype == dtype):
    raise ValueError("experts_pallas needs x and all expert weights in one dtype, got "
                     f"{dtype}, {w_gate_EDF.dtype}, {w_up_EDF.dtype}, {w_down_EFD.dtype}")
  if platform.on_gpu() and jnp.dtype(dtype).itemsize != 2:
    # Hopper wgmma reads 32-bit operands only K-major; the [E, D, F] weights are N-major.
    return experts_ragged_dot(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF,
                              w_down_EFD)
  if use_decode_path(num_tokens, top_k):
    choose_tilings(num_tokens * top_k, num_experts, dim, ffn)  # Refuses sizes off the tile.
    return experts_decode(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
                          plan=plan)
  return experts_grouped(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD)


def experts_grouped(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD):
  """The grouped path: token copies sorted by expert into padded row tiles."""
  num_tokens, top_k = topk_ids_TK.shape
  num_experts, dim, ffn = w_gate_EDF.shape
  dtype = x_TD.dtype
  gate_up_tiling, down_tiling = choose_tilings(num_tokens * top_k, num_experts, dim, ffn)
  plan = routing.plan_routing(topk_ids_TK, topk_weights_TK, num_experts,
                              gate_up_tiling.block_rows)
  x_PD = permute.permute_rows(x_TD, plan)
  act_PF = grouped_gemm.gate_up_swiglu(x_PD, w_gate_EDF, w_up_EDF, plan.tile_expert_N,
                                       gate_up_tiling)
  out_PD = grouped_gemm.down_weighted(act_PF, w_down_EFD, plan.row_weight_P,
                                      plan.tile_expert_N, down_tiling)
  return permute.unpermute_combine(out_PD, plan, dtype)
