"""FP8 experts at a few tokens as many small Pallas (Triton) programs over the whole of K.

The Mosaic GPU decode path (jspec.pallas_kernels.fp8_experts) runs one persistent program per
SM, each streaming its items through a TMA pipeline. At one token of Qwen3-30B-A3B the 8
picked experts' gate / up weights are 25 MB: 190 KB an SM, too little for one program's
pipeline to reach the HBM's rate, so K is sliced into 384 items whose float32 partials a
second kernel sums into the activation (BENCHMARKS.md: the two expert kernels at about half
their bytes' rate). Here each program is small (a slot's block of columns over all of K), so
several share an SM and the hardware keeps more loads in flight; no K slices, no partials:

  act [S, M, F] = bf16(silu(x W_gate[e_s]^T) * (x W_up[e_s]^T))        (one kernel)
  out [S, M, D] = weight_SR[s, :M, None] * (act_s W_down[e_s]^T)         (one kernel)
  y   [T, D]    = sum over each token's slots of out                     (decode_routing)

M = 16 rows (Triton's least dot), the T tokens and zeros. Each e4m3 tile is widened to
bfloat16 in registers and each 128-K block's float32 product times its block's scale, as the
Mosaic path does; the activation is rounded to bfloat16 as the model's own MLP rounds it.
Slots and shapes follow decode_routing's plan: a slot multiplies every token, a token that
did not pick its expert weighted 0.

Shape letters: T tokens, E experts, D hidden size, F expert intermediate size, S slots,
M padded rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import decode_routing, platform
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3

ROWS = 16  # Triton's dot takes at least 16 rows


@dataclasses.dataclass(frozen=True)
class TritonExpertsTiling:
  """Columns a program (dividing 128), 128-K blocks a loop step, warps and pipeline stages, of
  the gate / up kernel and of the down kernel."""
  gate_up_columns: int = 32
  gate_up_blocks: int = 2
  down_columns: int = 32
  down_blocks: int = 2
  num_warps: int = 4
  num_stages: int = 3


TILING = TritonExpertsTiling()


def fits(x_TD: jax.Array, *weights) -> bool:
  """bfloat16 x of at most ROWS tokens, experts in whole 128 x 128 blocks."""
  return (x_TD.dtype == jnp.bfloat16 and x_TD.shape[0] <= ROWS
          and all(w.w8.dtype == E4M3 and w.w8.shape[1] % BLOCK == 0
                  and w.w8.shape[2] % BLOCK == 0 for w in weights))


def _block_product(rows_MK, w_ref, scale_ref, expert, cols, block):
  """[M, C] float32: rows [M, 128] times the expert's e4m3 tile [C, 128] (columns `cols`, K
  block `block`) widened to bfloat16, times the tile's block scale."""
  ks = pl.ds(pl.multiple_of(block * BLOCK, BLOCK), BLOCK)
  w_CK = w_ref[expert, cols, ks].astype(jnp.bfloat16)
  scale = scale_ref[expert, cols.start // BLOCK, block]
  return pltriton.dot(rows_MK, w_CK, trans_b=True) * scale


def _gate_up_kernel(slot_expert_ref, num_slots_ref, x_ref, wg_ref, wu_ref, sg_ref, su_ref,
                    act_ref, *, tokens: int, columns: int, blocks: int, steps: int,
                    num_experts: int):
  s, j = pl.program_id(0), pl.program_id(1)
  cols = pl.ds(pl.multiple_of(j * columns, columns), columns)
  live_M = jnp.arange(ROWS) < tokens

  @pl.when(s < num_slots_ref[0])
  def _():
    # An invalid pick of one token is expert E: read expert 0 for it (its weight is 0 and no
    # token combines its slot).
    expert = jnp.minimum(slot_expert_ref[s], num_experts - 1)

    def step(i, sums):
      gate, up = sums
      for b in range(blocks):
        block = i * blocks + b
        ks = pl.ds(pl.multiple_of(block * BLOCK, BLOCK), BLOCK)
        x_MK = pltriton.load(x_ref.at[pl.ds(0, ROWS), ks], mask=live_M[:, None], other=0.0)
        gate = gate + _block_product(x_MK, wg_ref, sg_ref, expert, cols, block)
        up = up + _block_product(x_MK, wu_ref, su_ref, expert, cols, block)
      return gate, up

    zeros = jnp.zeros((ROWS, columns), jnp.float32)
    gate, up = jax.lax.fori_loop(0, steps, step, (zeros, zeros))
    act_ref[s, :, cols] = (jax.nn.silu(gate) * up).astype(act_ref.dtype)


def _down_kernel(slot_expert_ref, num_slots_ref, weight_ref, act_ref, wd_ref, sd_ref, out_ref,
                 *, columns: int, blocks: int, steps: int, num_experts: int):
  s, j = pl.program_id(0), pl.program_id(1)
  cols = pl.ds(pl.multiple_of(j * columns, columns), columns)

  @pl.when(s < num_slots_ref[0])
  def _():
    expert = jnp.minimum(slot_expert_ref[s], num_experts - 1)

    def step(i, total):
      for b in range(blocks):
        block = i * blocks + b
        ks = pl.ds(pl.multiple_of(block * BLOCK, BLOCK), BLOCK)
        total = total + _block_product(act_ref[s, :, ks], wd_ref, sd_ref, expert, cols, block)
      return total

    total = jax.lax.fori_loop(0, steps, step, jnp.zeros((ROWS, columns), jnp.float32))
    weight_M = weight_ref[s, pl.ds(0, ROWS)]
    out_ref[s, :, cols] = total * weight_M[:, None]


def _blocks_per_step(blocks: int, k_blocks: int) -> int:
  """`blocks`, or 1 where it does not divide K's blocks."""
  return blocks if k_blocks % blocks == 0 else 1


def _check_columns(columns: int, width: int):
  if not platform.triton_block(columns) or BLOCK % columns or width % columns:
    raise ValueError(f"{columns} columns a program must be a power of two from 16 dividing "
                     f"{BLOCK} and the projection's {width}")


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def gate_up_act(x_TD, w_gate, w_up, slot_expert_S, num_slots_1,
                tiling: TritonExpertsTiling = TILING, interpret: bool | None = None):
  """act [S, ROWS, F] bfloat16: silu(x W_gate^T) * (x W_up^T) of each used slot's expert
  (fp8_experts.Fp8Experts weights), rows past T zero; slots from num_slots on unwritten."""
  tokens, dim = x_TD.shape
  num_experts, ffn, _ = w_gate.w8.shape
  _check_columns(tiling.gate_up_columns, ffn)
  blocks = _blocks_per_step(tiling.gate_up_blocks, dim // BLOCK)
  slots = slot_expert_S.shape[0]
  if interpret is None:
    interpret = not platform.on_gpu()
  kernel = functools.partial(_gate_up_kernel, tokens=tokens, columns=tiling.gate_up_columns,
                             blocks=blocks, steps=dim // BLOCK // blocks,
                             num_experts=num_experts)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((slots, ROWS, ffn), jnp.bfloat16),
      grid=(slots, ffn // tiling.gate_up_columns),
      compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps,
                                              num_stages=tiling.num_stages),
      interpret=interpret, name="fp8_experts_gate_up_triton",
  )(slot_expert_S.astype(jnp.int32), num_slots_1.astype(jnp.int32), x_TD, w_gate.w8,
    w_up.w8, w_gate.scale.astype(jnp.float32), w_up.scale.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def down_weighted(act_SMF, w_down, slot_expert_S, num_slots_1, weight_SR,
                  tiling: TritonExpertsTiling = TILING, interpret: bool | None = None):
  """out [S, ROWS, D] float32: each used slot's act times its expert's W_down^T, row m times
  weight_SR[s, m]; slots from num_slots on unwritten."""
  slots, rows, ffn = act_SMF.shape
  num_experts, dim, _ = w_down.w8.shape
  if rows != ROWS or weight_SR.shape[1] < ROWS:
    raise ValueError(f"down_weighted takes act [S, {ROWS}, F] and weights of at least {ROWS} "
                     f"columns, got {act_SMF.shape} and {weight_SR.shape}")
  _check_columns(tiling.down_columns, dim)
  blocks = _blocks_per_step(tiling.down_blocks, ffn // BLOCK)
  if interpret is None:
    interpret = not platform.on_gpu()
  kernel = functools.partial(_down_kernel, columns=tiling.down_columns, blocks=blocks,
                             steps=ffn // BLOCK // blocks, num_experts=num_experts)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((slots, ROWS, dim), jnp.float32),
      grid=(slots, dim // tiling.down_columns),
      compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps,
                                              num_stages=tiling.num_stages),
      interpret=interpret, name="fp8_experts_down_triton",
  )(slot_expert_S.astype(jnp.int32), num_slots_1.astype(jnp.int32),
    weight_SR.astype(jnp.float32), act_SMF, w_down.w8, w_down.scale.astype(jnp.float32))


def experts_fp8_triton(x_TD, topk_ids_TK, topk_weights_TK, w_gate, w_up, w_down,
                       plan: decode_routing.DecodePlan | None = None,
                       tiling: TritonExpertsTiling = TILING,
                       interpret: bool | None = None) -> jax.Array:
  """y[t] = sum_k w[t,k] * down_e(silu(x[t] @ gate_e) * (x[t] @ up_e)) in x's dtype, the
  experts in FP8; fp8_experts.experts_fp8_decode's semantics for bfloat16 x of at most ROWS
  tokens (`fits`)."""
  if not fits(x_TD, w_gate, w_up, w_down):
    raise ValueError(f"the Triton FP8 expert path takes bfloat16 x of at most {ROWS} tokens "
                     f"and experts in whole {BLOCK}-blocks, got x {x_TD.shape} {x_TD.dtype}")
  plan = decode_routing.plan_unless_given(plan, topk_ids_TK, topk_weights_TK,
                                          w_gate.w8.shape[0])
  weight_SR = plan.weight_SR
  if weight_SR.shape[1] < ROWS:
    weight_SR = jnp.pad(weight_SR, ((0, 0), (0, ROWS - weight_SR.shape[1])))
  act_SMF = gate_up_act(x_TD, w_gate, w_up, plan.slot_expert_S, plan.num_slots_1, tiling,
                        interpret)
  out_SMD = down_weighted(act_SMF, w_down, plan.slot_expert_S, plan.num_slots_1, weight_SR,
                          tiling, interpret)
  return decode_routing.combine_slots(out_SMD, plan, x_TD.dtype)
