"""FP8 experts at prefill sizes: token copies grouped by expert, each group's e4m3 weights read
once per tile of rows, on the FP8 tensor cores (Pallas Mosaic GPU).

Past a few dozen tokens the decode path (jspec.pallas_kernels.fp8_experts: every picked
expert multiplied by all the step's tokens) reads each picked expert again for every chunk of
64 tokens, and scaling every expert into a bf16 copy first writes and reads the experts again
in twice the bytes: both took FP8 MoE prefill to about twice the bf16 time on an H200
(BENCHMARKS.md). Here the step's token copies are sorted by expert into tiles of `rows` rows,
one expert each (jspec.pallas_kernels.routing, as the bf16 grouped kernels take them), and
each tile is a slot of the FP8 slot pipeline with its own rows of x:

  x8, s_x   [P, D]   e4m3 and [S, D/128, N]: the permuted rows quantized per 128 channels
                     (DeepSeek-V3's act_quant, the checkpoints' "dynamic" activation scheme;
                     jspec.pallas_kernels.quantize_rows)                           (kernel)
  gate, up  [S, F, N] = W_gate[e_s] @ x8_s^T, W_up[e_s] @ x8_s^T   (e4m3 x e4m3 wgmma, each
                     128-K block's sums times the weight block's scale and the rows' scales)
  act       [P, F]   = silu(gate) * up (XLA), quantized again per 128 channels   (kernel)
  out       [S, D, N] = W_down[e_s] @ act8_s^T                                     (kernel)
  y         [T, D]   = sum over each token's copies of routing weight x out     (XLA, float32)

An expert with g copies costs ceil(g / rows) reads of its weights, so the bytes are about
those of the experts the step routed, once; the padded rows cost arithmetic only.

Shape letters: T tokens, K experts per token, E experts, D hidden size, F expert intermediate
size, P padded rows (S tiles of N = `rows` rows), S tiles (the slots).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.pallas_kernels import permute, routing
from jspec.pallas_kernels.fp8_expert_products import Fp8Experts, slot_products
from jspec.pallas_kernels.fp8_experts import TWO_SUMS_MAX_ROWS
from jspec.pallas_kernels.quantize_rows import quantize_rows

# Rows per tile (wgmma's N): float32 sums of a 128-column item in registers bound it at 64.
MAX_TILE_ROWS = 64
MIN_TILE_ROWS = 16


def tile_rows(num_copies: int, num_experts: int) -> int:
  """Rows per tile: the average copies an expert gets, as a power of two in [MIN_TILE_ROWS,
  MAX_TILE_ROWS]. Larger tiles read a busy expert fewer times; smaller ones pad an idle
  expert's single tile by fewer rows. On an H100 this was within 6% of the best of 16, 32 and
  64 rows at DeepSeek-V3's and Qwen3-30B-A3B's expert shapes, 512 and 2048 tokens; twice the
  average was up to 24% slower on Qwen3-30B-A3B's smaller experts (BENCHMARKS.md, "FP8 experts
  at prefill sizes")."""
  wanted = -(-num_copies // num_experts)
  rows = MIN_TILE_ROWS
  while rows < min(wanted, MAX_TILE_ROWS):
    rows *= 2
  return rows


def _quantized_tiles(x_PD, num_tiles_max: int, rows: int):
  """(x8 [S, N, D] e4m3, its scales [S, D/128, N])."""
  x8_PD, scale_SKbN = quantize_rows(x_PD, x_PD.shape[0], rows)
  return x8_PD.reshape(num_tiles_max, rows, x_PD.shape[1]), scale_SKbN


def experts_fp8_grouped(x_TD, topk_ids_TK, topk_weights_TK, w_gate: Fp8Experts,
                        w_up: Fp8Experts, w_down: Fp8Experts, rows: int | None = None,
                        num_stages: int = 4) -> jax.Array:
  """y[t] = sum_k w[t,k] * down_e(silu(x[t] @ gate_e) * (x[t] @ up_e)), the experts in FP8 and
  the activations quantized per row and 128 channels; ids outside [0, E) add nothing.

  rows: the tile's rows (default tile_rows'); a multiple of 8 up to MAX_TILE_ROWS."""
  num_tokens, top_k = topk_ids_TK.shape
  num_experts = w_gate.w8.shape[0]
  rows = rows or tile_rows(num_tokens * top_k, num_experts)
  if rows % 8 or not 8 <= rows <= MAX_TILE_ROWS:
    raise ValueError(f"rows={rows} must be a multiple of 8 in [8, {MAX_TILE_ROWS}]")
  plan = routing.plan_routing(topk_ids_TK, topk_weights_TK, num_experts, rows)
  num_tiles_max = plan.tile_expert_N.shape[0]
  # Tiles past the used ones never run (the kernels' loop bound); any expert index does.
  tile_expert_S = jnp.maximum(plan.tile_expert_N, 0)
  num_tiles_1 = plan.num_tiles.reshape(1)
  used_S = jnp.arange(num_tiles_max) < plan.num_tiles

  def products(x_PD, *weights: Fp8Experts):
    """[P, out] float32 per weight, x quantized once for all of them."""
    x8_SND, scale_SKbN = _quantized_tiles(x_PD, num_tiles_max, rows)
    if rows <= TWO_SUMS_MAX_ROWS:
      sums = slot_products(x8_SND, weights, tile_expert_S, num_tiles_1, 1, num_stages,
                           scale_SKbN)
    else:  # one sum per kernel: two [128, N] float32 sums and their products overflow registers
      sums = [slot_products(x8_SND, (w,), tile_expert_S, num_tiles_1, 1, num_stages,
                            scale_SKbN)[0] for w in weights]
    # The rows of tiles past the used ones were not written: zeros keep them finite.
    return [jnp.where(used_S[:, None, None], jnp.swapaxes(out_SON, 1, 2), 0.0)
            .reshape(num_tiles_max * rows, -1) for out_SON in sums]

  gate_PF, up_PF = products(permute.permute_rows(x_TD, plan), w_gate, w_up)
  (out_PD,) = products(jax.nn.silu(gate_PF) * up_PF, w_down)
  return permute.unpermute_combine(out_PD * plan.row_weight_P[:, None], plan, x_TD.dtype)
