"""The MoE expert computation on the Pallas Mosaic GPU kernels (jspec's "pallas" backend).

    routing plan (XLA) -> permute (XLA gather) -> gate/up + SwiGLU (kernel)
      -> down x routing weight (kernel) -> unpermute + combine in float32 (XLA gather)

Same signature and semantics as `jspec.models.moe_backends.experts_reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models.moe_backends import PALLAS_EXPERT_TILE
from jspec.pallas_kernels import grouped_gemm, permute, platform, routing
from jspec.pallas_kernels.grouped_gemm import Tiling

# Average token copies per expert up to which tokens go on wgmma's N dimension.
SWAPPED_MAX_ROWS_PER_EXPERT = 32


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


# Jitted so that a model's identical MoE layers trace and lower once: the program then calls one
# lowered function per layer instead of holding (and building) a copy of the kernels per layer.
@jax.jit
def experts_pallas(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD):
  """y[t] = sum_k w[t,k] * down_e(silu(x[t] @ gate_e) * (x[t] @ up_e)); ids outside [0,E) skip."""
  num_tokens, top_k = topk_ids_TK.shape
  num_experts, dim, ffn = w_gate_EDF.shape
  dtype = x_TD.dtype
  if not (w_gate_EDF.dtype == w_up_EDF.dtype == w_down_EFD.dtype == dtype):
    raise ValueError("experts_pallas needs x and all expert weights in one dtype, got "
                     f"{dtype}, {w_gate_EDF.dtype}, {w_up_EDF.dtype}, {w_down_EFD.dtype}")
  if platform.on_gpu() and jnp.dtype(dtype).itemsize != 2:
    # Hopper wgmma reads 32-bit operands only K-major; the [E, D, F] weights are N-major.
    from jspec.models.moe_backends import experts_ragged_dot
    return experts_ragged_dot(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF,
                              w_down_EFD)
  gate_up_tiling, down_tiling = choose_tilings(num_tokens * top_k, num_experts, dim, ffn)
  plan = routing.plan_routing(topk_ids_TK, topk_weights_TK, num_experts,
                              gate_up_tiling.block_rows)
  x_PD = permute.permute_rows(x_TD, plan)
  act_PF = grouped_gemm.gate_up_swiglu(x_PD, w_gate_EDF, w_up_EDF, plan.tile_expert_N,
                                       gate_up_tiling)
  out_PD = grouped_gemm.down_weighted(act_PF, w_down_EFD, plan.row_weight_P,
                                      plan.tile_expert_N, down_tiling)
  return permute.unpermute_combine(out_PD, plan, dtype)
