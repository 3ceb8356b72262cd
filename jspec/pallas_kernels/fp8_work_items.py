"""The work of a few-row FP8 product call (jspec.pallas_kernels.fp8_block_kernel.partials and
its warp-specialized form, jspec.pallas_kernels.fp8_ws_kernel): which item and K step each
program's pipeline step takes, the stages' shared memory, and the loads a step issues.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import decode_gemm, decode_routing, platform
from jspec.pallas_kernels.balanced_runs import BalancedRuns
from jspec.pallas_kernels.shared import smem_transforms

BLOCK = 128        # the published weight_block_size, both axes
E4M3 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class WorkItems:
  """A few-row FP8 call's work items, pipeline stages and loads, as `partials` and the
  warp-specialized form (jspec.pallas_kernels.fp8_ws_kernel) run them: items (weight, K
  slice, 128-column block) round-robin over the programs, or equal runs of their K steps
  (balanced); a step loads x's, the item's weight's and its block scales' tiles (and the rows'
  scales of e4m3 x) behind one barrier."""
  k: int
  ns: tuple
  rows: int
  x_dtype: object
  fp8_x: bool
  per_step: int
  splits: int
  k_steps: int
  lanes: int
  stages: int
  num_sms: int
  runs: BalancedRuns | None

  @classmethod
  def of(cls, x_RK, w8s_NK, scale_rows_NbX, act_scale_X, splits, tiling, balanced):
    # wgmma's N: x may have fewer rows (the TMA fills the rest of each tile with zeros).
    rows, k = decode_routing.padded_tokens(x_RK.shape[0]), x_RK.shape[1]
    fp8_x = act_scale_X is not None
    per_step = tiling.blocks_per_step
    step_k = per_step * BLOCK
    splits = 1 if balanced else splits
    k_steps = k // splits // step_k
    lanes = scale_rows_NbX[0].shape[1] // (k // BLOCK)
    scale_bytes = per_step * lanes * 4 * (2 if fp8_x else 1)
    stages = decode_gemm._num_stages(
        decode_gemm.DecodeTiling(BLOCK, step_k, tiling.num_stages),
        BLOCK * step_k + rows * step_k * x_RK.dtype.itemsize + scale_bytes)
    decode_gemm._check_aligned(((rows, step_k), x_RK.dtype), ((BLOCK, step_k), E4M3),
                               ((per_step * lanes,), jnp.float32))
    num_sms = platform.num_sms()
    ns = tuple(w.shape[0] for w in w8s_NK)
    runs = (BalancedRuns(splits * sum(ns) // BLOCK, k_steps, num_sms) if balanced else None)
    if balanced and runs.total_steps * (runs.busy_programs + 1) >= 2 ** 31:
      raise ValueError(f"{runs.total_steps} K steps over {num_sms} programs overflow int32 "
                       f"indices")
    return cls(k, ns, rows, x_RK.dtype, fp8_x, per_step, splits, k_steps, lanes, stages,
               num_sms, runs)

  @property
  def step_k(self) -> int:
    return self.per_step * BLOCK

  @property
  def total_n(self) -> int:
    return sum(self.ns)

  @property
  def segments(self) -> int:
    return self.runs.segments if self.runs else self.splits

  @property
  def loads_a_step(self) -> int:
    return 4 if self.fp8_x else 3

  @functools.cached_property
  def _bounds(self):
    """(first item, first output column block) of each weight, and past the last."""
    col_blocks = [n // BLOCK for n in self.ns]
    return (np.cumsum([0] + [self.splits * c for c in col_blocks]).tolist(),
            np.cumsum([0] + col_blocks).tolist())

  def steps(self, sm):
    """This program's steps."""
    if self.runs:
      return self.runs.run_length(sm)
    num_items = self._bounds[0][-1]
    return lax.div(num_items - sm + (self.num_sms - 1), jnp.int32(self.num_sms)) * self.k_steps

  def locate(self, sm, step):
    """(weight, K slice, output column block, K step in the slice) of this program's step."""
    item_starts, col_offsets = self._bounds
    if self.runs:
      item, step = self.runs.item_and_step(sm, step)
    else:
      item = sm + lax.div(step, jnp.int32(self.k_steps)) * self.num_sms
    weight, start, offset = jnp.int32(0), jnp.int32(0), jnp.int32(0)
    blocks = jnp.int32(self.ns[0] // BLOCK)
    for j in range(1, len(self.ns)):
      later = item >= item_starts[j]
      weight = jnp.where(later, j, weight)
      start = jnp.where(later, item_starts[j], start)
      blocks = jnp.where(later, self.ns[j] // BLOCK, blocks)
      offset = jnp.where(later, col_offsets[j], offset)
    local = item - start
    return (weight, lax.div(local, blocks), offset + lax.rem(local, blocks),
            lax.rem(step, jnp.int32(self.k_steps)))

  def stage_buffers(self) -> dict:
    """The stages' shared memory: x_smem, w_smem, s_smem (and a_smem for e4m3 x)."""
    lanes_smem = plgpu.SMEM((self.stages, self.per_step * self.lanes), jnp.float32)
    step_k = self.step_k
    buffers = dict(
        x_smem=plgpu.SMEM((self.stages, self.rows, step_k), self.x_dtype,
                          transforms=smem_transforms(step_k, self.x_dtype)),
        w_smem=plgpu.SMEM((self.stages, BLOCK, step_k), E4M3,
                          transforms=smem_transforms(BLOCK, E4M3)),
        s_smem=lanes_smem)
    if self.fp8_x:
      buffers["a_smem"] = lanes_smem
    return buffers

  def fetch(self, sm, x_ref, w_refs, s_refs, act_ref, x_smem, w_smem, s_smem, a_smem, loaded,
            step, slot):
    """Issues the loads of this program's `step` into stage `slot`."""
    item_starts, col_offsets = self._bounds
    weight, split, col, k_step = self.locate(sm, step)
    step_k, per_step, lanes = self.step_k, self.per_step, self.lanes
    k_block = split * self.k_steps + k_step  # in steps of step_k
    barrier = loaded.at[slot]
    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, self.rows), pl.ds(k_block * step_k, step_k)],
                            x_smem.at[slot], barrier)
    lanes_k = pl.ds(k_block * (per_step * lanes), per_step * lanes)
    for j, (w_ref, s_ref) in enumerate(zip(w_refs, s_refs)):
      @pl.when(weight == j)
      def _(w_ref=w_ref, s_ref=s_ref):
        plgpu.copy_gmem_to_smem(w_ref.at[pl.ds((col - col_offsets[j]) * BLOCK, BLOCK),
                                         pl.ds(k_block * step_k, step_k)],
                                w_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(s_ref.at[col - col_offsets[j], lanes_k], s_smem.at[slot],
                                barrier)
    if self.fp8_x:
      plgpu.copy_gmem_to_smem(act_ref.at[lanes_k], a_smem.at[slot], barrier)

  def step_scale(self, s_smem, a_smem, slot, j, shape):
    """Block j of the step's scale over the products' [columns, R] (times the rows' scales of
    e4m3 x)."""
    lanes_j = pl.ds(j * self.lanes, self.rows)
    scale_R = plgpu.load(s_smem.at[slot, lanes_j], layout=plgpu.Layout.WGMMA.reduce(0))
    if self.fp8_x:
      scale_R = scale_R * plgpu.load(a_smem.at[slot, lanes_j],
                                     layout=plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(scale_R, shape, [1])
