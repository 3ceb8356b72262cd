"""The few-row FP8 product (jspec.pallas_kernels.fp8_gemm) as a warp-specialized pipeline: one
warpgroup issues the TMA loads, two compute warpgroups widen and multiply (Pallas Mosaic GPU).

fp8_gemm's pipeline runs in one warpgroup: it waits for each step's products (fresh
accumulators, so that the block's scale multiplies a sum of one block) and scales them before
it issues the next loads, and its e4m3 tiles stream at 1.2-1.9 TB/s on an H200 (BENCHMARKS.md).
Here a memory warpgroup keeps the stages in flight while the compute warpgroups work; each
takes 64 of a work item's 128 output columns (half of a scale block's rows), widens its half
of the e4m3 tile to float16 in registers and multiplies it with the shared tile of x.

Work items are (128-column block, K slice), as fp8_gemm's; the same operands and the same
[slices, N, R] float32 partials, summed outside.

Shape letters: R padded rows of x (wgmma's N), K inner size, N output size, S K slices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import platform
from jspec.pallas_kernels.fp8_gemm import BLOCK, E4M3
from jspec.pallas_kernels.grouped_gemm import _smem_transforms

HALF = BLOCK // 2  # each compute warpgroup's output columns (wgmma's M)
NUM_STAGES = 6


def partials(x_RK, w8_NK, scale_rows_NbX, splits: int, num_stages: int = NUM_STAGES):
  """[S, N, R] float32: slice s's sum over its K blocks of (W_block @ x_block^T) * scale.

  x_RK: float16 (rows a power of two, 8 to 64); w8_NK: e4m3; scale_rows_NbX: each block's
  scale repeated over `lanes` >= R lanes ([N/128, K/128 x lanes], fp8_gemm.scale_lanes)."""
  rows, k = x_RK.shape
  n = w8_NK.shape[0]
  column_blocks = n // BLOCK
  slice_steps = k // BLOCK // splits
  slice_k = slice_steps * BLOCK
  lanes = scale_rows_NbX.shape[1] // (k // BLOCK)

  on_gpu = platform.on_gpu()

  def body(x_gmem, w_gmem, scale_gmem, out_gmem, o_smem, a_smem=None):
    wg = lax.axis_index("wg")

    def pipeline(step_body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          step_body, grid=(slice_steps,), memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((rows, BLOCK), lambda s: (0, s),
                              transforms=_smem_transforms(BLOCK, jnp.float16)),
              plgpu.BlockSpec((BLOCK, BLOCK), lambda s: (0, s),
                              transforms=_smem_transforms(BLOCK, E4M3)),
              plgpu.BlockSpec((lanes,), lambda s: (s,)),
          ],
          wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=num_stages,
          compute_context=compute_context)

    @plgpu.nd_loop((column_blocks * splits,), collective_axes="sm")
    def _item_loop(loop_info):
      (item,) = loop_info.index
      # K slices fastest: the programs running at once read neighbouring slices of one block
      # of columns, and each slice's x once.
      column, k_slice = lax.div(item, jnp.int32(splits)), lax.rem(item, jnp.int32(splits))
      my_columns = pl.ds(column * BLOCK + wg * HALF, HALF)

      def compute_context(run):
        zeros = plgpu.layout_cast(jnp.zeros((HALF, rows), jnp.float32), plgpu.Layout.WGMMA)
        total = run(zeros)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store read it
        o_smem.at[wg][...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[k_slice, my_columns])

      def step(_, x_smem, w_smem, scale_smem, total):
        w16 = w_smem[pl.ds(wg * HALF, HALF), :].astype(jnp.float16)

        def mma(acc):
          if on_gpu:
            plgpu.wgmma(acc, w16, x_smem.T)
          else:  # the interpreter's wgmma reads both operands from shared memory only
            a_smem.at[wg][...] = w16
            plgpu.commit_smem()
            plgpu.wgmma(acc, a_smem.at[wg], x_smem.T)
          return acc[...]

        part = pl.run_scoped(mma, plgpu.ACC((HALF, rows)))
        scale_R = plgpu.load(scale_smem.at[pl.ds(0, rows)], layout=plgpu.Layout.WGMMA.reduce(0))
        return total + part * lax.broadcast_in_dim(scale_R, part.shape, [1])

      ks = pl.ds(k_slice * slice_k, slice_k)
      pipeline(step, compute_context)(
          x_gmem.at[:, ks], w_gmem.at[pl.ds(column * BLOCK, BLOCK), ks],
          scale_gmem.at[column, pl.ds(k_slice * slice_steps * lanes, slice_steps * lanes)])

    plgpu.wait_smem_to_gmem(0)

  o_shape = (2, HALF, rows)
  scratch = dict(o_smem=plgpu.SMEM(o_shape, jnp.float32,
                                   transforms=_smem_transforms(rows, jnp.float32)))
  if not on_gpu:
    scratch["a_smem"] = plgpu.SMEM((2, HALF, BLOCK), jnp.float16,
                                   transforms=_smem_transforms(BLOCK, jnp.float16))
  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((splits, n, rows), jnp.float32),
      grid=(platform.num_sms(),), grid_names=("sm",), num_threads=3, thread_name="wg",
      scratch_types=scratch, interpret=platform.interpret_params(),
      kernel_name="fp8_block_gemm_ws",
  )(x_RK, w8_NK, scale_rows_NbX)
