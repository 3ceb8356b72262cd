"""The few-row FP8 product kernel (jspec.pallas_kernels.fp8_block_kernel.partials) with its
loads and its products in different warpgroups: one warpgroup issues the TMA loads, two widen
and multiply 64 of each item's 128 output columns each.

Why: on an H200 the one-warpgroup kernel's steps wait on nothing past the first (0.03 µs a
step) while a two-block step's products take 0.68 µs of the ~1.07 µs a step lasts, so what
holds its stream is the warpgroup's own work (widening, products, index arithmetic and the
next loads' issue, in turn), not the bytes (BENCHMARKS.md, "Inside the FP8 few-row kernel").
Here the loads are issued as soon as a stage is free, and each compute warpgroup widens half
the tile. A form of this on an H100 (2026-11-26, one pipeline per work item, 1 block a step)
ran within 5% of the one-warpgroup kernel: there the stream's rate, not the products, bounds
a step.

Same operands, work items, balanced runs and [S, sum of N, R] float32 partials as
fp8_block_kernel.partials (see its docstring).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import decode_gemm, platform
from jspec.pallas_kernels.fp8_block_kernel import Fp8Tiling, block_products
from jspec.pallas_kernels.fp8_work_items import BLOCK, WorkItems
from jspec.pallas_kernels.shared import smem_transforms

HALF = BLOCK // 2  # each compute warpgroup's output columns (wgmma's M)
COMPUTE_WGS = 2
# Registers a thread of the load warpgroup keeps (Pallas's warp-specialized pipeline's value
# for an H100 / H200); the compute warpgroups share the rest of the SM's 64k.
MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = int(min(256, (512 - MEMORY_REGISTERS) / COMPUTE_WGS)) // 8 * 8


def partials(x_RK, w8s_NK, scale_rows_NbX, act_scale_X, splits: int, tiling: Fp8Tiling,
             balanced: bool = False):
  """fp8_block_kernel.partials, its loads issued by a warpgroup of their own."""
  work = WorkItems.of(x_RK, w8s_NK, scale_rows_NbX, act_scale_X, splits, tiling, balanced)
  rows, per_step, lanes, stages = work.rows, work.per_step, work.lanes, work.stages
  fp8_x = act_scale_X is not None
  segments, runs, locate = work.segments, work.runs, work.locate

  def body(*refs, x_smem, w_smem, s_smem, o_smem, loaded, consumed, a_smem=None, z_smem=None,
           tiles_smem=None):
    x_ref, *weight_refs, out_ref = refs
    act_ref = weight_refs.pop() if fp8_x else None
    w_refs, s_refs = weight_refs[0::2], weight_refs[1::2]
    sm, wg = lax.axis_index("sm"), lax.axis_index("wg")
    steps = work.steps(sm)
    fetch = functools.partial(work.fetch, sm, x_ref, w_refs, s_refs, act_ref, x_smem, w_smem,
                              s_smem, a_smem, loaded)

    def memory():
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
      for step in range(stages):
        pl.when(step < steps)(functools.partial(fetch, jnp.int32(step), step))

      def refill(step, carry):  # once the compute warpgroups are done with step's stage
        slot = lax.rem(step, jnp.int32(stages))
        plgpu.barrier_wait(consumed.at[slot])
        fetch(step + stages, slot)
        return carry

      last_refill = jnp.maximum(steps - stages, 0)
      lax.fori_loop(jnp.int32(0), last_refill, refill, None)
      # The last stages' releases awaited too, so that every barrier ends a whole phase.
      lax.fori_loop(last_refill, steps, lambda step, carry: (
          plgpu.barrier_wait(consumed.at[lax.rem(step, jnp.int32(stages))]), carry)[1], None)

    def compute():
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
      my_o, my_columns = o_smem.at[wg], pl.ds(wg * HALF, HALF)
      my_tiles = None if tiles_smem is None else tiles_smem.at[wg]
      if balanced:
        z_smem.at[wg][...] = decode_gemm._zeros(1, (HALF, rows))[0]
        plgpu.commit_smem()

      def run_step(step, total):
        slot = lax.rem(step, jnp.int32(stages))
        plgpu.barrier_wait(loaded.at[slot])
        _, split, col, k_step = locate(sm, step)
        for j, part in enumerate(block_products(w_smem.at[slot, my_columns], x_smem.at[slot],
                                                per_step, rows, fp8_x, interleaved=True,
                                                tiles_smem=my_tiles)):
          total = total + part * work.step_scale(s_smem, a_smem, slot, j, part.shape)
        plgpu.barrier_arrive(consumed.at[slot])  # the stage's tiles are read
        last = k_step == work.k_steps - 1
        if balanced:
          slot_out, store = runs.segment(sm, step), last | (step == steps - 1)
        else:
          slot_out, store = split, last
        out_columns = pl.ds(col * BLOCK + wg * HALF, HALF)

        @pl.when(store)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store read it
          my_o[...] = total
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(my_o, out_ref.at[slot_out, out_columns])

        for later in range(1, segments if balanced else 1):
          @pl.when(last & (slot_out + later < segments))
          def _(later=later):
            plgpu.copy_smem_to_gmem(z_smem.at[wg], out_ref.at[slot_out + later, out_columns])

        restart = lax.broadcast_in_dim(last, total.shape, ())
        return lax.select(restart, jnp.zeros_like(total), total)

      lax.fori_loop(jnp.int32(0), steps, run_step, decode_gemm._zeros(1, (HALF, rows))[0])
      plgpu.wait_smem_to_gmem(0)

    lax.cond(wg == COMPUTE_WGS, memory, compute)

  out_tile = plgpu.SMEM((COMPUTE_WGS, HALF, rows), jnp.float32,
                        transforms=smem_transforms(rows, jnp.float32))
  scratch = dict(**work.stage_buffers(), o_smem=out_tile,
                 loaded=plgpu.Barrier(num_arrivals=work.loads_a_step, num_barriers=stages),
                 consumed=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages))
  if balanced:
    scratch["z_smem"] = out_tile
  if not platform.on_gpu() and not fp8_x:  # the interpreter's widened tiles, per warpgroup
    scratch["tiles_smem"] = plgpu.SMEM((COMPUTE_WGS, per_step, HALF, BLOCK), x_RK.dtype,
                                       transforms=smem_transforms(BLOCK, x_RK.dtype))
  inputs = (x_RK, *[a for pair in zip(w8s_NK, scale_rows_NbX) for a in pair])
  inputs += (act_scale_X,) if fp8_x else ()
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((segments, work.total_n, rows), jnp.float32),
      grid=(work.num_sms,), grid_names=("sm",), num_threads=COMPUTE_WGS + 1, thread_name="wg",
      scratch_types=scratch, interpret=platform.interpret_params(),
      kernel_name=f"fp8_block_gemm_ws_{work.k}x{work.total_n}")(*inputs)
