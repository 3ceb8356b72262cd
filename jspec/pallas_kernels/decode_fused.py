"""A MoE layer's decode-sized experts as ONE persistent Pallas Mosaic GPU kernel: gate / up with
SwiGLU, then down, on the slots of a `DecodePlan` (jspec.pallas_kernels.decode_gemm's two
kernels, joined).

Why: at batch 1 the two kernels each pay a launch, their first loads' latency and a drained
pipeline at their end (Qwen3-30B-A3B: gate / up 16.8 µs and down 8.2 µs a layer for 11.4 and
5.7 µs of bytes on an H200, BENCHMARKS.md). Here every program runs one pipeline over its work
items, gate / up items first, then down items, so a program's first down weights stream in
while its gate / up steps finish, and the programs that have no gate / up item (Qwen3-30B-A3B:
96 such items on 132 SMs) load their down weights from the start.

Down needs a slot's whole activation row: its down items wait for that slot's gate / up items.
Each slot has a counter (a semaphore in global memory that the grid shares and that Pallas zeroes
before every call). Each gate / up item stores its [N, 64] activations, waits until the store
has landed, and adds one to its slot's counter (one release at the GPU's scope: Pallas's
signal of several semaphores fences each at the system's scope, 16 such fences an item made
the kernel slower than the two it replaces); a down item reads its slot's counter, at its first
step, until it holds every gate / up item of the slot, then loads the slot's activations [N, F]
into shared memory once. Only the activations wait: the
down weights' tiles are loaded ahead like any other. No program waits before its own gate / up
items are done, and every program of the persistent grid is resident, so the waits end.

Both kinds of step load the same tiles: a [K, 64] tile into each of two buffers (gate and up;
down's 128 output columns as two halves) and a third small one (x's [N, K] tile; a down step's
routing weights), so the stages, their barriers and the two float32 sums are shared.

Off the GPU the interpreter runs one program, which does every gate / up item before any down
item, so the counters are left out there (the interpreter has no semaphores in global memory).

Shape letters: T tokens, N padded tokens (wgmma's N), D model width, F expert width, S slots,
R routing-weight lanes, E experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import decode_gemm, decode_routing, platform
from jspec.pallas_kernels.shared import silu_mul, smem_transforms

# The columns each of the two weight buffers holds: a gate / up item's width (wgmma's M).
HALF = 64
# Shared memory of a program (Hopper: 227 KiB), less a margin for the barriers.
SMEM_BYTES = 224 * 1024
MAX_STAGES = 5
# Take the fused kernel (on by default); False: the two kernels.
FUSED = True


def _block_k(dim: int, ffn: int) -> int:
  return 128 if dim % 128 == 0 and ffn % 128 == 0 else 64


def _stages(tokens_pad: int, dim: int, ffn: int, lanes: int) -> int:
  """Pipeline stages that fit beside the activation row (0: the row does not fit twice)."""
  bk = _block_k(dim, ffn)
  stage = 2 * bk * HALF * 2 + tokens_pad * bk * 2 + lanes * 4
  rest = tokens_pad * ffn * 2 + 2 * tokens_pad * HALF * 2
  return min(MAX_STAGES, (SMEM_BYTES - rest) // stage)


def fits(tokens_pad: int, dim: int, ffn: int, dtype, lanes: int) -> bool:
  """Whether the fused kernel takes these sizes: 16-bit weights, D a multiple of 128 (down's
  two 64-column halves), F of 64, and at least two stages beside the activation row."""
  return (jnp.dtype(dtype).itemsize == 2 and dim % (2 * HALF) == 0 and ffn % HALF == 0
          and _stages(tokens_pad, dim, ffn, lanes) >= 2)


def _async_proxy_fence():
  """fence.proxy.async.global: orders this thread's generic-proxy accesses of global memory
  with the TMA's (the async proxy's) on either side of a semaphore. Nothing to order off the
  GPU."""
  if not platform.on_gpu():
    return
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @plgpu.inline_mgpu()
  def _(ctx):
    del ctx
    mgpu_utils.inline_ptx("fence.proxy.async.global;", result_types=[],
                          has_side_effects=True)


def experts_decode_fused(x_TD, w_gate_EDF, w_up_EDF, w_down_EFD,
                         plan: decode_routing.DecodePlan, tokens_pad: int,
                         programs: int | None = None):
  """out_SND[s] = weight_SR[s, :N] * (silu(x @ w_gate[e_s]) * (x @ w_up[e_s])) @ w_down[e_s],
  for the plan's used slots (rows of unused slots are left unwritten), as decode_gemm's
  gate_up_decode then down_decode give it. programs: the persistent grid (default: one per
  SM)."""
  num_tokens, dim = x_TD.shape
  _, _, ffn = w_gate_EDF.shape
  dtype = x_TD.dtype
  num_slots_max = plan.slot_expert_S.shape[0]
  n = tokens_pad
  lanes = plan.weight_SR.shape[1]
  if not fits(n, dim, ffn, dtype, lanes) or lanes < n:
    raise ValueError(f"experts_decode_fused does not take N={n}, D={dim}, F={ffn}, {dtype}, "
                     f"{lanes} weight lanes")
  if num_tokens > decode_gemm.ROW_TILE and num_tokens % decode_gemm.ROW_TILE:
    x_TD = jnp.pad(x_TD, ((0, -num_tokens % decode_gemm.ROW_TILE), (0, 0)))
  bk = _block_k(dim, ffn)
  stages = _stages(n, dim, ffn, lanes)
  gate_blocks, down_blocks = ffn // HALF, dim // (2 * HALF)  # items per slot
  gate_steps, down_steps = dim // bk, ffn // bk
  num_programs = programs or platform.num_sms()

  sync = platform.on_gpu()  # the counters (see the module docstring)

  def body(slot_expert_ref, num_slots_ref, weight_ref, x_ref, wg_ref, wu_ref, wd_ref,
           act_ref, out_ref):
    # One counter per slot, shared by the grid (a kernel's scratch semaphores would be each
    # program's own).
    ready = pl.get_global(plgpu.SemaphoreType.REGULAR((num_slots_max,))) if sync else None

    def scoped(a_smem, b_smem, x_smem, r_smem, act_smem, o_lo, o_hi, loaded, act_loaded):
      sm = lax.axis_index("sm")
      num_slots = num_slots_ref[0]
      gate_items = num_slots * gate_blocks
      all_items = gate_items + num_slots * down_blocks
      # sm < num_programs, so both numerators are >= 0 (lax.div truncates).
      my_gate = lax.div(gate_items - sm + (num_programs - 1), jnp.int32(num_programs))
      my_all = lax.div(all_items - sm + (num_programs - 1), jnp.int32(num_programs))
      gate_span = my_gate * gate_steps
      steps = gate_span + (my_all - my_gate) * down_steps

      def locate(step):
        """(gate / up step?, slot, item's column block, K step) of this program's step."""
        is_gate = step < gate_span
        rest = step - gate_span
        g_item = sm + lax.div(step, jnp.int32(gate_steps)) * num_programs
        d_item = (sm + (my_gate + lax.div(rest, jnp.int32(down_steps))) * num_programs
                  - gate_items)
        item = jnp.where(is_gate, g_item, d_item)
        blocks = jnp.where(is_gate, gate_blocks, down_blocks)
        k = jnp.where(is_gate, lax.rem(step, jnp.int32(gate_steps)),
                      lax.rem(rest, jnp.int32(down_steps)))
        return is_gate, lax.div(item, blocks), lax.rem(item, blocks), k

      def fetch(step, stage):
        is_gate, slot, col, k = locate(step)
        expert = slot_expert_ref[slot]
        barrier = loaded.at[stage]
        rows = pl.ds(k * bk, bk)

        @pl.when(is_gate)
        def _():
          cols = pl.ds(col * HALF, HALF)
          plgpu.copy_gmem_to_smem(wg_ref.at[expert, rows, cols], a_smem.at[stage], barrier)
          plgpu.copy_gmem_to_smem(wu_ref.at[expert, rows, cols], b_smem.at[stage], barrier)
          plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, n), rows], x_smem.at[stage], barrier)

        @pl.when(jnp.logical_not(is_gate))
        def _():
          base = col * 2 * HALF
          plgpu.copy_gmem_to_smem(wd_ref.at[expert, rows, pl.ds(base, HALF)],
                                  a_smem.at[stage], barrier)
          plgpu.copy_gmem_to_smem(wd_ref.at[expert, rows, pl.ds(base + HALF, HALF)],
                                  b_smem.at[stage], barrier)
          plgpu.copy_gmem_to_smem(weight_ref.at[slot], r_smem.at[stage], barrier)

      for step in range(stages):  # the prologue
        pl.when(step < steps)(functools.partial(fetch, jnp.int32(step), step))

      def products(stage, x_tile, sums):
        def mma(acc_a, acc_b):
          plgpu.wgmma(acc_a, a_smem.at[stage].T, x_tile.T)
          plgpu.wgmma(acc_b, b_smem.at[stage].T, x_tile.T)
          return acc_a[...], acc_b[...]

        parts = pl.run_scoped(mma, plgpu.ACC((HALF, n)), plgpu.ACC((HALF, n)))
        return tuple(s + p for s, p in zip(sums, parts))

      def store(value, o_smem, dst):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # its previous store has read it
        o_smem.T[...] = value.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, dst)

      def gate_step(stage, slot, col, k, sums):
        sums = products(stage, x_smem.at[stage], sums)

        @pl.when(k == gate_steps - 1)
        def _():
          store(silu_mul(*sums), o_lo, act_ref.at[slot, :, pl.ds(col * HALF, HALF)])
          if sync:
            plgpu.wait_smem_to_gmem(0)  # landed in global memory, then counted
            _async_proxy_fence()
            plgpu.semaphore_signal(ready.at[slot], 1, memory_scope="gpu")
        return sums

      def down_step(stage, slot, col, k, sums):
        @pl.when(k == 0)
        def _():
          if sync:
            plgpu.semaphore_wait(ready.at[slot], gate_blocks, decrement=False,
                                 memory_scope="gpu")
            _async_proxy_fence()
          for j in range(down_steps):
            plgpu.copy_gmem_to_smem(act_ref.at[slot, :, pl.ds(j * bk, bk)], act_smem.at[j],
                                    act_loaded.at[0])
          plgpu.barrier_wait(act_loaded.at[0])

        sums = products(stage, act_smem.at[k], sums)  # the step's K slice of the row

        @pl.when(k == down_steps - 1)
        def _():
          weight_N = plgpu.load(r_smem.at[stage, pl.ds(0, n)],
                                layout=plgpu.Layout.WGMMA.reduce(0))
          weight = lax.broadcast_in_dim(weight_N, (HALF, n), [1])
          base = col * 2 * HALF
          store(sums[0] * weight, o_lo, out_ref.at[slot, :, pl.ds(base, HALF)])
          store(sums[1] * weight, o_hi, out_ref.at[slot, :, pl.ds(base + HALF, HALF)])
        return sums

      def run_step(step, sums):
        stage = lax.rem(step, jnp.int32(stages))
        is_gate, slot, col, k = locate(step)
        plgpu.barrier_wait(loaded.at[stage])
        sums = lax.cond(is_gate, gate_step, down_step, stage, slot, col, k, sums)
        last = jnp.where(is_gate, k == gate_steps - 1, k == down_steps - 1)
        pl.when(step + stages < steps)(functools.partial(fetch, step + stages, stage))
        restart = lax.broadcast_in_dim(last, (HALF, n), ())
        return tuple(lax.select(restart, jnp.zeros_like(s), s) for s in sums)

      lax.fori_loop(jnp.int32(0), steps, run_step, decode_gemm._zeros(2, (HALF, n)))
      plgpu.wait_smem_to_gmem(0)

    tile = smem_transforms(HALF, dtype)
    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, bk, HALF), dtype, transforms=tile),
        plgpu.SMEM((stages, bk, HALF), dtype, transforms=tile),
        plgpu.SMEM((stages, n, bk), dtype, transforms=smem_transforms(bk, dtype)),
        plgpu.SMEM((stages, lanes), jnp.float32),
        plgpu.SMEM((down_steps, n, bk), dtype, transforms=smem_transforms(bk, dtype)),
        plgpu.SMEM((n, HALF), dtype, transforms=tile),
        plgpu.SMEM((n, HALF), dtype, transforms=tile),
        plgpu.Barrier(num_arrivals=3, num_barriers=stages),
        plgpu.Barrier(num_arrivals=down_steps, num_barriers=1),
    )

  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((num_slots_max, n, ffn), dtype),
                jax.ShapeDtypeStruct((num_slots_max, n, dim), dtype)),
      grid=(num_programs,),
      grid_names=("sm",),
      interpret=platform.interpret_params(),
      kernel_name="moe_decode_fused",
  )
  _, out_SND = kernel(plan.slot_expert_S, plan.num_slots_1, plan.weight_SR, x_TD, w_gate_EDF,
                      w_up_EDF, w_down_EFD)
  return out_SND
