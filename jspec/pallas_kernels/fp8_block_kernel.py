"""The Mosaic GPU kernel of jspec.pallas_kernels.fp8_gemm: the float32 partial products of a
few rows of x against block-scaled FP8 weights, per K slice, on Hopper.

How: a persistent pipeline (one program per SM, work items round-robin) on the
transposed product out^T[N, M] = W[N, K] @ x^T, so the weight's output rows are wgmma's M
dimension and the few rows of x its N. The TMA streams each [128-column, 128-K] e4m3 tile of
the weight as it is stored (K contiguous); the warpgroup widens it in registers to x's 16-bit
type (exact: e4m3 fits the range and mantissa of both) and multiplies it with x, which waits in
shared memory. wgmma has no e4m3 x 16-bit form. bfloat16 x (a model's) goes in as it is, the
tile widened through float16 and float32 (Hopper converts e4m3 only to float16 in one
instruction). Other x goes in as float16, each row first scaled by a power of two into
float16's range (exact for bf16 values), the output row by its inverse: that needs each row's
largest |x|, XLA passes before the kernel that at decode sizes cost about as much as a small
weight's bytes. Each 128-K step's products land in fresh float32 accumulators and are
multiplied by that block's scale, so the scale is applied where it is one number. The
weight's K is cut into S slices so that S x N/128 work items fill the SMs, or, where no
slice count fills them, the items' K steps are cut into equal runs, one a program
(jspec.pallas_kernels.balanced_runs); the S float32 partials are summed outside (with the
row scales of float16 x).
Off the GPU (interpret mode, the CPU tests) the widened tile goes through shared memory, as
the interpreter's wgmma takes no operand in registers; the GPU tests run the register form.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
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
# Set (by benchmarks/fp8_kernel_inside.py) to a plgpu.CompilerParams with profile_space and
# profile_dir: each new build of the kernel then writes its first call's timeline of the named
# scopes below (per program: the prologue, each step's wait and products, the final store).
PROFILE = None


@dataclasses.dataclass(frozen=True)
class Fp8Tiling:
  """blocks_per_step: 128-K blocks each pipeline step multiplies (each with its own
  accumulator and scale; more per step spreads a step's fixed latency over more bytes).
  num_stages: the pipeline's depth (0: as many as fit its shared-memory budget)."""
  blocks_per_step: int = 2
  num_stages: int = 4


def block_products(w_smem, x_smem, per_step: int, rows: int, fp8_x: bool,
                   interleaved: bool = False):
  """Each of a step's `per_step` 128-K blocks' W @ x^T in float32, in fresh accumulators.

  w_smem: [128 or 64 columns, per_step x 128] e4m3 as the TMA left it; x_smem: [rows, per_step x
  128], float16 or bfloat16 (the tile is widened to x's type in registers), or e4m3 (both as
  they are). interleaved (on the GPU): each block's tile widened right before its own wgmma,
  which runs while the next block's is widened; else every block's tile first. The few-row
  product kernel below uses it; jspec.pallas_kernels.fp8_experts does not (1.5% slower there,
  BENCHMARKS.md, "Norm kernels' loads before their stores ...")."""
  columns = [pl.ds(j * BLOCK, BLOCK) for j in range(per_step)]
  out_cols = w_smem.shape[0]  # wgmma's M
  accs = [plgpu.ACC((out_cols, rows)) for _ in columns]
  if fp8_x:  # e4m3 x e4m3: both operands as the TMA left them
    def mma_fp8(*acc_refs):
      for acc, c in zip(acc_refs, columns):
        plgpu.wgmma(acc, w_smem.at[:, c], x_smem.at[:, c].T)
      return tuple(acc[...] for acc in acc_refs)

    return pl.run_scoped(mma_fp8, *accs)

  def widen(c):
    with jax.named_scope("widen"):
      if x_smem.dtype == jnp.bfloat16:
        # Hopper converts e4m3 to float16 only; float16 -> float32 -> bfloat16 is exact for
        # e4m3's values, subnormals included (2^-9 and up: normal in bfloat16).
        return w_smem[:, c].astype(jnp.float16).astype(jnp.float32).astype(jnp.bfloat16)
      return w_smem[:, c].astype(jnp.float16)

  # Interleaved (on the GPU only), each tile is widened inside the products' loop.
  w16 = None if interleaved and platform.on_gpu() else [widen(c) for c in columns]

  def mma(*acc_refs):
    for j, (acc, c) in enumerate(zip(acc_refs, columns)):
      plgpu.wgmma(acc, widen(c) if w16 is None else w16[j], x_smem.at[:, c].T)
    return tuple(acc[...] for acc in acc_refs)

  def mma_from_smem(*a_smem):
    for ref, a in zip(a_smem, w16):
      ref[...] = a
    plgpu.commit_smem()

    def mma(*acc_refs):
      for acc, ref, c in zip(acc_refs, a_smem, columns):
        plgpu.wgmma(acc, ref, x_smem.at[:, c].T)
      return tuple(acc[...] for acc in acc_refs)

    return pl.run_scoped(mma, *accs)

  if platform.on_gpu():
    with jax.named_scope("wgmma"):
      return pl.run_scoped(mma, *accs)
  # The interpreter's wgmma reads both operands from shared memory only.
  return pl.run_scoped(mma_from_smem, *[
      plgpu.SMEM((out_cols, BLOCK), x_smem.dtype,
                 transforms=smem_transforms(BLOCK, x_smem.dtype)) for _ in columns])


def scaled_block_sums(sums, x_smem, w_smems, s_smems, per_step: int, rows: int, lanes: int,
                      fp8_x: bool = False, a_smem=None):
  """Each sum plus its weight's step: sums[j] + sum over the step's 128-K blocks b of
  (W_j block b @ x block b^T) x that block's scale, which s_smems[j] holds over `lanes` lanes
  per block (the lanes' first `rows` read, one per row of x), times x's rows' scales of block
  b where a_smem holds them (e4m3 x, laid out alike: fp8_gemm.act_lanes)."""
  totals = []
  for total, w_smem, s_smem in zip(sums, w_smems, s_smems):
    for j, part in enumerate(block_products(w_smem, x_smem, per_step, rows, fp8_x)):
      scale_N = plgpu.load(s_smem.at[pl.ds(j * lanes, rows)],
                           layout=plgpu.Layout.WGMMA.reduce(0))
      if a_smem is not None:
        scale_N = scale_N * plgpu.load(a_smem.at[pl.ds(j * lanes, rows)],
                                       layout=plgpu.Layout.WGMMA.reduce(0))
      total = total + part * lax.broadcast_in_dim(scale_N, part.shape, [1])
    totals.append(total)
  return tuple(totals)


def partials(x_RK, w8s_NK, scale_rows_NbX, act_scale_X, splits: int, tiling: Fp8Tiling,
             balanced: bool = False, rows_first: bool = False):
  """[S, sum of N, R] float32: slice s's sum over its K blocks of (W_block @ x_block^T) *
  scale, for each weight of `w8s_NK` (a tuple of weights with the same K; the output holds
  their columns one after another).

  rows_first: [S, R, sum of N] instead, each tile stored transposed, so that one row's partials
  are contiguous for a reader of a row (in the rows-last form a row is one float of every
  32-byte sector).

  balanced: the items are (weight, 128-column block) over all of K, and each program takes an
  equal run of the items' K steps in order (`splits` is ignored). Round-robin items leave SMs
  idle in a last round the items do not fill (DeepSeek-V3's dense gate / up: 288 items on 132
  SMs, 73% of three rounds, so the product lasts 1.37x its bytes' time); equal runs keep every
  SM busy to the end (BalancedRuns). An item cut between programs leaves one partial a
  program in slots 0, 1, ... of its columns, the program that ends it zeroes the slots after
  its own: S = BalancedRuns.segments, and the sum over S is the product as with K slices.

  x_RK: float16 or bfloat16 (up to 8 rows, or a multiple of 8: the TMA fills the rest of the
  padded R rows with zeros), or e4m3 with `act_scale_X` ([K/128 x lanes]: each row's scale per
  128-K group, rows on the lanes) for FP8 x FP8 products.
  scale_rows_NbX: per weight, each block's scale repeated over `lanes` (>= R) lanes ([N/128,
  K/128 x lanes]), so that a step's scales arrive with its tiles as one TMA block each (a
  scalar read from global memory in every step would sit in the step's critical path).

  Several weights share one call and one pipeline: their work items (weight, K slice,
  128-column block) are one list, round-robin over the programs, and each step loads its tiles
  from its item's weight. Why one call: at decode sizes each call costs a launch, its first
  loads and a sum of its partials, several microseconds that weigh as much as a small weight's
  bytes (Qwen3-8B's k and v, 4 MB each in e4m3). Why one pipeline: a pipeline per weight (the
  form before, emit_pipeline's) refilled from empty at each weight: q / k / v took 1.2-1.5 µs
  a call more than one pipeline over the weights joined (one H200, BENCHMARKS.md).
  The pipeline is written out here because emit_pipeline loads every operand's tile at every
  step, and an item reads one weight of several."""
  # wgmma's N: x may have fewer rows (the TMA fills the rest of each tile with zeros).
  rows, k = decode_routing.padded_tokens(x_RK.shape[0]), x_RK.shape[1]
  ns = [w.shape[0] for w in w8s_NK]
  x_dtype = x_RK.dtype
  fp8_x = act_scale_X is not None
  per_step = tiling.blocks_per_step
  step_k = per_step * BLOCK
  if balanced:
    splits = 1
  k_steps = k // splits // step_k
  lanes = scale_rows_NbX[0].shape[1] // (k // BLOCK)
  scale_bytes = per_step * lanes * 4 * (2 if fp8_x else 1)
  stages = decode_gemm._num_stages(
      decode_gemm.DecodeTiling(BLOCK, step_k, tiling.num_stages),
      BLOCK * step_k + rows * step_k * x_dtype.itemsize + scale_bytes)
  decode_gemm._check_aligned(((rows, step_k), x_dtype), ((BLOCK, step_k), E4M3),
                             ((per_step * lanes,), jnp.float32))
  num_sms = platform.num_sms()
  col_blocks = [n // BLOCK for n in ns]
  # The work items, weight after weight: (weight j, K slice, column block), slices outer.
  item_starts = np.cumsum([0] + [splits * c for c in col_blocks]).tolist()
  col_offsets = np.cumsum([0] + col_blocks).tolist()
  runs = BalancedRuns(item_starts[-1], k_steps, num_sms) if balanced else None
  if balanced and runs.total_steps * (runs.busy_programs + 1) >= 2 ** 31:
    raise ValueError(f"{runs.total_steps} K steps over {num_sms} programs overflow int32 "
                     f"indices")
  segments = runs.segments if balanced else splits

  def locate(sm, step):
    """(weight, K slice, output column block, K step in the slice) of this program's step."""
    if balanced:
      item, step = runs.item_and_step(sm, step)
    else:
      item = sm + lax.div(step, jnp.int32(k_steps)) * num_sms
    weight, start, blocks, offset = (jnp.int32(0), jnp.int32(0), jnp.int32(col_blocks[0]),
                                     jnp.int32(0))
    for j in range(1, len(ns)):
      later = item >= item_starts[j]
      weight = jnp.where(later, j, weight)
      start = jnp.where(later, item_starts[j], start)
      blocks = jnp.where(later, col_blocks[j], blocks)
      offset = jnp.where(later, col_offsets[j], offset)
    local = item - start
    return (weight, lax.div(local, blocks), offset + lax.rem(local, blocks),
            lax.rem(step, jnp.int32(k_steps)))

  def store_tile(tile_smem, value_CR):
    """A [128, R] float32 WGMMA-layout value into the output tile, transposed where rows come
    first (32-bit values store transposed from WGMMA's transposed layout only)."""
    if rows_first:
      tile_smem.T[...] = plgpu.layout_cast(value_CR, plgpu.Layout.WGMMA_TRANSPOSED)
    else:
      tile_smem[...] = value_CR

  def body(*refs):
    x_ref, *weight_refs, out_ref = refs
    act_ref = weight_refs.pop() if fp8_x else None

    def out_tile(segment, col):
      columns = pl.ds(col * BLOCK, BLOCK)
      return out_ref.at[segment, :, columns] if rows_first else out_ref.at[segment, columns]
    w_refs, s_refs = weight_refs[0::2], weight_refs[1::2]

    def scoped(x_smem, w_smem, s_smem, o_smem, loaded, *extra):
      a_smem = extra[0] if fp8_x else None
      sm = lax.axis_index("sm")
      if balanced:
        steps = runs.run_length(sm)
        z_smem = extra[-1]  # zeros for the slots after an item's last partial
        store_tile(z_smem, decode_gemm._zeros(1, (BLOCK, rows))[0])
        plgpu.commit_smem()
      else:
        steps = lax.div(item_starts[-1] - sm + (num_sms - 1), jnp.int32(num_sms)) * k_steps

      def fetch(step, slot):
        weight, split, col, k_step = locate(sm, step)
        k_block = split * k_steps + k_step  # in steps of step_k
        barrier = loaded.at[slot]
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, rows), pl.ds(k_block * step_k, step_k)],
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
        if fp8_x:
          plgpu.copy_gmem_to_smem(act_ref.at[lanes_k], a_smem.at[slot], barrier)

      with jax.named_scope("prologue"):  # the first `stages` steps' loads
        for step in range(stages):
          pl.when(step < steps)(functools.partial(fetch, jnp.int32(step), step))

      def run_step(step, total):
        slot = lax.rem(step, jnp.int32(stages))
        with jax.named_scope("wait"):
          plgpu.barrier_wait(loaded.at[slot])
        _, split, col, k_step = locate(sm, step)
        with jax.named_scope("products"):
          # Each tile widened before its own product: every tile first made a Qwen3-8B FP8
          # step 2.1-2.8% slower on an H200 (BENCHMARKS.md, "Inside the FP8 few-row kernel").
          for j, part in enumerate(block_products(w_smem.at[slot], x_smem.at[slot], per_step,
                                                  rows, fp8_x, interleaved=True)):
            lanes_j = pl.ds(j * lanes, rows)
            scale_R = plgpu.load(s_smem.at[slot, lanes_j],
                                 layout=plgpu.Layout.WGMMA.reduce(0))
            if fp8_x:
              scale_R = scale_R * plgpu.load(a_smem.at[slot, lanes_j],
                                             layout=plgpu.Layout.WGMMA.reduce(0))
            total = total + part * lax.broadcast_in_dim(scale_R, part.shape, [1])
        last = k_step == k_steps - 1
        if balanced:  # an item's end, or this program's run's end inside an item
          slot_out = runs.segment(sm, step)
          store = last | (step == steps - 1)
        else:
          slot_out, store = split, last

        @pl.when(store)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store read it
          store_tile(o_smem, total)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem, out_tile(slot_out, col))

        for later in range(1, segments if balanced else 1):
          @pl.when(last & (slot_out + later < segments))
          def _(later=later):
            plgpu.copy_smem_to_gmem(z_smem, out_tile(slot_out + later, col))

        # The slot's products are done (block_products waits for them): refill it.
        pl.when(step + stages < steps)(functools.partial(fetch, step + stages, slot))
        restart = lax.broadcast_in_dim(last, total.shape, ())
        return lax.select(restart, jnp.zeros_like(total), total)

      lax.fori_loop(jnp.int32(0), steps, run_step, decode_gemm._zeros(1, (BLOCK, rows))[0])
      with jax.named_scope("final_store"):
        plgpu.wait_smem_to_gmem(0)

    lanes_smem = plgpu.SMEM((stages, per_step * lanes), jnp.float32)
    tile = (plgpu.SMEM((rows, BLOCK), jnp.float32, transforms=smem_transforms(BLOCK, jnp.float32))
            if rows_first else
            plgpu.SMEM((BLOCK, rows), jnp.float32, transforms=smem_transforms(rows, jnp.float32)))
    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, rows, step_k), x_dtype, transforms=smem_transforms(step_k, x_dtype)),
        plgpu.SMEM((stages, BLOCK, step_k), E4M3, transforms=smem_transforms(BLOCK, E4M3)),
        lanes_smem,
        tile,
        plgpu.Barrier(num_arrivals=4 if fp8_x else 3, num_barriers=stages),
        *([lanes_smem] if fp8_x else []),
        *([tile] if balanced else []),
    )

  inputs = (x_RK, *[a for pair in zip(w8s_NK, scale_rows_NbX) for a in pair])
  inputs += (act_scale_X,) if fp8_x else ()
  # Named by shape, so that a profile tells a step's products apart.
  out_shape = (segments, rows, sum(ns)) if rows_first else (segments, sum(ns), rows)
  return decode_gemm._kernel_call(body, out_shape, jnp.float32,
                                  f"fp8_block_gemm_{k}x{sum(ns)}",
                                  compiler_params=PROFILE)(*inputs)
