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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import decode_gemm, platform
from jspec.pallas_kernels.fp8_work_items import BLOCK, E4M3, WorkItems
from jspec.pallas_kernels.shared import smem_transforms

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
                   interleaved: bool = False, tiles_smem=None):
  """Each of a step's `per_step` 128-K blocks' W @ x^T in float32, in fresh accumulators.

  w_smem: [128 or 64 columns, per_step x 128] e4m3 as the TMA left it; x_smem: [rows, per_step x
  128], float16 or bfloat16 (the tile is widened to x's type in registers), or e4m3 (both as
  they are). interleaved (on the GPU): each block's tile widened right before its own wgmma,
  which runs while the next block's is widened; else every block's tile first. The few-row
  product kernel below uses it; jspec.pallas_kernels.fp8_experts does not (1.5% slower there,
  BENCHMARKS.md, "Norm kernels' loads before their stores ...").
  tiles_smem: [per_step, columns, 128] of x's type, where the interpreter's widened tiles go
  (in interpret mode only; allocated here where None, which one warpgroup of several may not)."""
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
  if tiles_smem is not None:
    return mma_from_smem(*[tiles_smem.at[j] for j in range(per_step)])
  return pl.run_scoped(mma_from_smem, *[
      plgpu.SMEM((out_cols, BLOCK), x_smem.dtype,
                 transforms=smem_transforms(BLOCK, x_smem.dtype)) for _ in columns])


def scaled_block_sums(sums, x_smem, w_smems, s_smems, per_step: int, rows: int, lanes: int,
                      fp8_x: bool = False):
  """Each sum plus its weight's step: sums[j] + sum over the step's 128-K blocks b of
  (W_j block b @ x block b^T) x that block's scale, which s_smems[j] holds over `lanes` lanes
  per block (the lanes' first `rows` read, one per row of x)."""
  totals = []
  for total, w_smem, s_smem in zip(sums, w_smems, s_smems):
    for j, part in enumerate(block_products(w_smem, x_smem, per_step, rows, fp8_x)):
      scale_N = plgpu.load(s_smem.at[pl.ds(j * lanes, rows)],
                           layout=plgpu.Layout.WGMMA.reduce(0))
      total = total + part * lax.broadcast_in_dim(scale_N, part.shape, [1])
    totals.append(total)
  return tuple(totals)


def partials(x_RK, w8s_NK, scale_rows_NbX, act_scale_X, splits: int, tiling: Fp8Tiling,
             balanced: bool = False):
  """[S, sum of N, R] float32: slice s's sum over its K blocks of (W_block @ x_block^T) *
  scale, for each weight of `w8s_NK` (a tuple of weights with the same K; the output holds
  their columns one after another).

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
  work = WorkItems.of(x_RK, w8s_NK, scale_rows_NbX, act_scale_X, splits, tiling, balanced)
  rows, per_step, stages, fp8_x = work.rows, work.per_step, work.stages, work.fp8_x
  segments, runs = work.segments, work.runs

  def body(*refs):
    x_ref, *weight_refs, out_ref = refs
    act_ref = weight_refs.pop() if fp8_x else None
    w_refs, s_refs = weight_refs[0::2], weight_refs[1::2]

    def scoped(x_smem, w_smem, s_smem, o_smem, loaded, *extra):
      a_smem = extra[0] if fp8_x else None
      sm = lax.axis_index("sm")
      steps = work.steps(sm)
      if balanced:
        z_smem = extra[-1]  # zeros for the slots after an item's last partial
        z_smem[...] = decode_gemm._zeros(1, z_smem.shape)[0]
        plgpu.commit_smem()
      fetch = functools.partial(work.fetch, sm, x_ref, w_refs, s_refs, act_ref, x_smem,
                                w_smem, s_smem, a_smem, loaded)

      with jax.named_scope("prologue"):  # the first `stages` steps' loads
        for step in range(stages):
          pl.when(step < steps)(functools.partial(fetch, jnp.int32(step), step))

      def run_step(step, total):
        slot = lax.rem(step, jnp.int32(stages))
        with jax.named_scope("wait"):
          plgpu.barrier_wait(loaded.at[slot])
        _, split, col, k_step = work.locate(sm, step)
        with jax.named_scope("products"):
          # Each tile widened before its own product: every tile first made a Qwen3-8B FP8
          # step 2.1-2.8% slower on an H200 (BENCHMARKS.md, "Inside the FP8 few-row kernel").
          for j, part in enumerate(block_products(w_smem.at[slot], x_smem.at[slot], per_step,
                                                  rows, fp8_x, interleaved=True)):
            total = total + part * work.step_scale(s_smem, a_smem, slot, j, part.shape)
        last = k_step == work.k_steps - 1
        if balanced:  # an item's end, or this program's run's end inside an item
          slot_out = runs.segment(sm, step)
          store = last | (step == steps - 1)
        else:
          slot_out, store = split, last

        @pl.when(store)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store read it
          o_smem[...] = total
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem, out_ref.at[slot_out, pl.ds(col * BLOCK, BLOCK)])

        for later in range(1, segments if balanced else 1):
          @pl.when(last & (slot_out + later < segments))
          def _(later=later):
            plgpu.copy_smem_to_gmem(z_smem, out_ref.at[slot_out + later,
                                                       pl.ds(col * BLOCK, BLOCK)])

        # The slot's products are done (block_products waits for them): refill it.
        pl.when(step + stages < steps)(functools.partial(fetch, step + stages, slot))
        restart = lax.broadcast_in_dim(last, total.shape, ())
        return lax.select(restart, jnp.zeros_like(total), total)

      lax.fori_loop(jnp.int32(0), steps, run_step, decode_gemm._zeros(1, (BLOCK, rows))[0])
      with jax.named_scope("final_store"):
        plgpu.wait_smem_to_gmem(0)

    buffers = work.stage_buffers()
    out_tile = plgpu.SMEM((BLOCK, rows), jnp.float32,
                          transforms=smem_transforms(rows, jnp.float32))
    pl.run_scoped(
        scoped, buffers["x_smem"], buffers["w_smem"], buffers["s_smem"], out_tile,
        plgpu.Barrier(num_arrivals=work.loads_a_step, num_barriers=stages),
        *([buffers["a_smem"]] if fp8_x else []), *([out_tile] if balanced else []))

  inputs = (x_RK, *[a for pair in zip(w8s_NK, scale_rows_NbX) for a in pair])
  inputs += (act_scale_X,) if fp8_x else ()
  # Named by shape, so that a profile tells a step's products apart.
  return decode_gemm._kernel_call(body, (segments, work.total_n, rows), jnp.float32,
                                  f"fp8_block_gemm_{work.k}x{work.total_n}",
                                  compiler_params=PROFILE)(*inputs)
