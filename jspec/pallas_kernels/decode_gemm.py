"""Decode-sized expert GEMMs in Pallas Mosaic GPU: every selected expert's weights streamed once.

Two kernels over the slots of a `DecodePlan` (one slot per selected expert):

  gate_up_decode:  act[s] = silu(x @ w_gate[e_s]) * (x @ w_up[e_s])      [S, N, F]
  down_decode:     out[s] = weight[s] * (act[s] @ w_down[e_s])            [S, N, D]

Both compute the transpose (out^T = W^T x^T): the weight columns are wgmma's M dimension
(64 or 128) and all N padded tokens its N dimension, so x is read straight from the [T, D]
input (rows past T arrive as zeros from the TMA's out-of-bounds fill) and no permuted copy
of it exists.

At decode sizes the layer is a stream of weight bytes, and what limits it is how many bytes
each SM keeps in flight. So each CTA runs ONE software pipeline over all of its work items
(slot, column block) x contraction steps, rather than one pipeline per item: the TMA loads
of the next item are already in flight while the current item's epilogue runs, and the
pipeline never drains between items. Work items are strided over the SMs
(item = sm + i * num_sms); their number is known only on the device (the used slots).

An item's sums must restart at the next item without a store into a live wgmma accumulator
(which interpret mode does not model). Two ways, chosen by `DecodeTiling.async_mma`; the
default, blocking, is the one measured on the GPU (BENCHMARKS.md, "MoE decode"):
  blocking  each step's products go to fresh accumulators, waited for and added to sums the
            pipeline carries; a stage is free as soon as its step ends.
  async     one accumulator per kernel keeps running over all items, each step's wgmma runs
            on while the next step's data arrives (as in the grouped kernels), and an item's
            result is the accumulator at its last step minus its value at the previous
            item's last step (carried). In float32 that difference loses about eps * sqrt(n)
            of the item's magnitude after n items, far below the bf16 rounding of the output.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import platform
from jspec.pallas_kernels.shared import silu_mul, smem_transforms

# The TMA writes shared memory at 128-byte aligned addresses: every pipelined block must be a
# multiple of this many bytes, or the second stage's buffer is misaligned.
TMA_SMEM_ALIGNMENT = 128
# Rows of the SMEM tiles the TMA writes (the tiling transform's first dimension).
ROW_TILE = 8
# Shared memory the pipeline stages may take (the H100 / H200 limit is 227 KiB per block;
# the rest holds the epilogue tile, at most 16 KiB, and barriers).
PIPELINE_SMEM_BYTES = 192 * 1024


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
  """block_cols: weight columns per work item (wgmma M: 64 or 128).
  block_k: contraction step. num_stages: pipeline depth (0: as many as fit the budget).
  async_mma: accumulate asynchronously over all items (see the module docstring)."""

  block_cols: int
  block_k: int
  num_stages: int = 0
  async_mma: bool = False


def _check_divisible(name, size, block):
  if size % block:
    raise ValueError(f"{name}={size} must be a multiple of the block size {block}")


def _check_aligned(*blocks):
  """blocks: (shape, dtype) of each pipelined input block."""
  for shape, dtype in blocks:
    size = math.prod(shape) * jnp.dtype(dtype).itemsize
    if size % TMA_SMEM_ALIGNMENT:
      raise ValueError(f"a pipelined block {shape} of {jnp.dtype(dtype).name} is {size} bytes, "
                       f"not a multiple of {TMA_SMEM_ALIGNMENT}: its stages would be misaligned")


def _num_stages(tiling: DecodeTiling, bytes_per_stage: int) -> int:
  fit = max(2, PIPELINE_SMEM_BYTES // bytes_per_stage)
  return max(2, min(tiling.num_stages or fit, fit))


def _zeros(count, shape):
  return tuple(plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
               for _ in range(count))


def _accumulate(sums, operands):
  """sums[j] + W_j^T @ X_j^T for each (W_j, X_j) SMEM pair, as float32 register arrays.

  Each step's products go to fresh zeroed accumulators and are added to the running sums that
  the pipeline carries, so the sums restart at every work item without a store into a live
  accumulator. The step waits for its own products; its SMEM slots are then free at once (no
  delay_release), and the loads run a stage further ahead.
  """
  def mma(*accs):
    for acc, (w_smem, x_smem) in zip(accs, operands):
      plgpu.wgmma(acc, w_smem.T, x_smem.T)
    return tuple(acc[...] for acc in accs)

  parts = pl.run_scoped(mma, *[plgpu.ACC(sums[0].shape) for _ in operands])
  return tuple(s + p for s, p in zip(sums, parts))


def _store_transposed(value_CN, o_smem, out_gmem):
  """value^T -> SMEM tile -> one TMA store. The tile's previous store, issued a whole work
  item earlier, must have finished reading it first."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  o_smem.T[...] = value_CN.astype(o_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, out_gmem)


def _slot_pipeline(*, num_slots, col_blocks, k_steps, block_cols, tokens_pad, dtype,
                   in_specs_for, num_sums, stages, epilogue, operands_of, async_mma,
                   accumulate=None, out_smem=None, programs: int | None = None):
  """Runs this program's work items (slot, column block) x k_steps as one pipeline.

  in_specs_for(item, delay_release) -> BlockSpecs, given item(i) -> (slot, col) for the
  pipeline's first grid index; operands_of(*smem_refs) -> the (W, X) pairs to multiply at
  each step; epilogue(slot, col, sums, smem_refs, o_smem) stores an item's result.
  accumulate(slot, col, k, sums, smem_refs) -> sums, where given, replaces a blocking step's
  products (a kernel whose operands need work in registers, or whose steps are scaled);
  out_smem: the epilogue's SMEM tile, if not the transposed [tokens_pad, block_cols] one.
  programs: the persistent grid's size (_kernel_call's; default one program per SM).
  """
  num_sms = programs or platform.num_sms()
  sm = lax.axis_index("sm")  # this program's rank in the round-robin
  num_items = num_slots * col_blocks
  my_items = lax.div(num_items - sm + (num_sms - 1), jnp.int32(num_sms))
  acc_shape = (block_cols, tokens_pad)

  def item(i):
    work = sm + i * num_sms
    return lax.div(work, jnp.int32(col_blocks)), lax.rem(work, jnp.int32(col_blocks))

  def blocking_step(o_smem, idx, *refs_and_sums):
    i, k = idx
    *smem_refs, sums = refs_and_sums
    if accumulate is None:
      sums = _accumulate(sums, operands_of(*smem_refs))
    else:
      sums = accumulate(*item(i), k, sums, smem_refs)
    is_last = k == k_steps - 1

    @pl.when(is_last)
    def _():
      epilogue(*item(i), sums, smem_refs, o_smem)

    # Warpgroup lowering takes no implicit broadcasts: the predicate is broadcast by hand.
    restart = lax.broadcast_in_dim(is_last, acc_shape, ())
    return tuple(lax.select(restart, jnp.zeros_like(s), s) for s in sums)

  def async_step(o_smem, accs, idx, *refs_and_prev):
    i, k = idx
    *smem_refs, prev = refs_and_prev
    for acc, (w_smem, x_smem) in zip(accs, operands_of(*smem_refs)):
      plgpu.wgmma(acc, w_smem.T, x_smem.T)
    plgpu.wgmma_wait(len(accs))  # This step's groups may run on; the previous step's are done.

    def finish(prev):
      totals = tuple(acc[...] for acc in accs)
      epilogue(*item(i), tuple(t - p for t, p in zip(totals, prev)), smem_refs, o_smem)
      return totals

    return lax.cond(k == k_steps - 1, finish, lambda prev: prev, prev)

  def run(o_smem, *gmem_refs):
    def pipeline(step, delay_release):
      plgpu.emit_pipeline(
          step, grid=(my_items, k_steps), in_specs=in_specs_for(item, delay_release),
          max_concurrent_steps=stages, init_carry=_zeros(num_sums, acc_shape))(*gmem_refs)

    if async_mma:
      pl.run_scoped(lambda *accs: pipeline(functools.partial(async_step, o_smem, accs), 1),
                    *[plgpu.ACC(acc_shape) for _ in range(num_sums)])
    else:
      pipeline(functools.partial(blocking_step, o_smem), 0)
    plgpu.wait_smem_to_gmem(0)

  o_smem = out_smem or plgpu.SMEM((tokens_pad, block_cols), dtype,
                                  transforms=smem_transforms(block_cols, dtype))
  return lambda *gmem_refs: pl.run_scoped(lambda o: run(o, *gmem_refs), o_smem)


def _kernel_call(body, out_shape, dtype, name, programs: int | None = None,
                 compiler_params=None):
  """A persistent kernel of `programs` programs (default: one per SM; the interpreter runs one)."""
  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(out_shape, dtype),
      grid=(programs or platform.num_sms(),),
      grid_names=("sm",),
      interpret=platform.interpret_params(),
      kernel_name=name,
      compiler_params=compiler_params,
  )


def gate_up_decode(x_TD, w_gate_EDF, w_up_EDF, slot_expert_S, num_slots_1, tokens_pad: int,
                   tiling: DecodeTiling) -> jax.Array:
  """act_SNF[s] = silu(x @ w_gate[e_s]) * (x @ w_up[e_s]) for the used slots."""
  _, dim = x_TD.shape
  _, _, ffn = w_gate_EDF.shape
  num_slots_max = slot_expert_S.shape[0]
  dtype = x_TD.dtype
  bc, bk, n = tiling.block_cols, tiling.block_k, tokens_pad
  _check_divisible("D", dim, bk)
  _check_divisible("F", ffn, bc)
  itemsize = jnp.dtype(dtype).itemsize
  stages = _num_stages(tiling, (n * bk + 2 * bk * bc) * itemsize)
  _check_aligned(((n, bk), dtype), ((bk, bc), dtype))
  num_tokens = x_TD.shape[0]
  if num_tokens > ROW_TILE and num_tokens % ROW_TILE:
    # The TMA reads x in tiles of 8 rows: a row count past 8 must be a multiple of 8 (below
    # 8, the rows past T arrive as zeros).
    x_TD = jnp.pad(x_TD, ((0, -num_tokens % ROW_TILE), (0, 0)))

  def body(slot_expert_ref, num_slots_ref, x_ref, w_gate_ref, w_up_ref, act_ref):
    def in_specs_for(item, delay_release):
      def w_index(i, k):
        slot, col = item(i)
        return slot_expert_ref[slot], k, col

      w_spec = plgpu.BlockSpec((None, bk, bc), w_index, transforms=smem_transforms(bc, dtype),
                               delay_release=delay_release)
      x_spec = plgpu.BlockSpec((n, bk), lambda i, k: (0, k),
                               transforms=smem_transforms(bk, dtype),
                               delay_release=delay_release)
      return [x_spec, w_spec, w_spec]

    def epilogue(slot, col, sums, smem_refs, o_smem):
      gate, up = sums
      _store_transposed(silu_mul(gate, up), o_smem, act_ref.at[slot, :, pl.ds(col * bc, bc)])

    _slot_pipeline(
        num_slots=num_slots_ref[0], col_blocks=ffn // bc, k_steps=dim // bk, block_cols=bc,
        tokens_pad=n, dtype=dtype, in_specs_for=in_specs_for, num_sums=2, stages=stages,
        epilogue=epilogue, operands_of=lambda x, g, u: [(g, x), (u, x)],
        async_mma=tiling.async_mma,
    )(x_ref, w_gate_ref, w_up_ref)

  return _kernel_call(body, (num_slots_max, n, ffn), dtype, "moe_decode_gate_up")(
      slot_expert_S, num_slots_1, x_TD, w_gate_EDF, w_up_EDF)


def down_decode(act_SNF, w_down_EFD, weight_SR, slot_expert_S, num_slots_1,
                tiling: DecodeTiling) -> jax.Array:
  """out_SND[s] = weight_SR[s, :N] * (act_SNF[s] @ w_down[e_s]) for the used slots.

  weight_SR: the slots' routing weights, R >= N columns (R * 4 bytes a multiple of 128: each
  slot's row travels with every pipeline step as one TMA block, so the epilogue never waits on
  a load of its own)."""
  num_slots_max, n, ffn = act_SNF.shape
  _, _, dim = w_down_EFD.shape
  dtype = act_SNF.dtype
  bc, bk = tiling.block_cols, tiling.block_k
  _check_divisible("F", ffn, bk)
  _check_divisible("D", dim, bc)
  itemsize = jnp.dtype(dtype).itemsize
  r = weight_SR.shape[1]
  if r < n:
    raise ValueError(f"weight_SR has {r} columns, fewer than the {n} padded tokens")
  stages = _num_stages(tiling, (n * bk + bk * bc) * itemsize + r * 4)
  _check_aligned(((n, bk), dtype), ((bk, bc), dtype), ((r,), jnp.float32))

  def body(slot_expert_ref, num_slots_ref, weight_ref, act_ref, w_down_ref, out_ref):
    def in_specs_for(item, delay_release):
      def w_index(i, k):
        slot, col = item(i)
        return slot_expert_ref[slot], k, col

      a_spec = plgpu.BlockSpec((None, n, bk), lambda i, k: (item(i)[0], 0, k),
                               transforms=smem_transforms(bk, dtype),
                               delay_release=delay_release)
      w_spec = plgpu.BlockSpec((None, bk, bc), w_index, transforms=smem_transforms(bc, dtype),
                               delay_release=delay_release)
      r_spec = plgpu.BlockSpec((None, r), lambda i, k: (item(i)[0], 0),
                               delay_release=delay_release)
      return [a_spec, w_spec, r_spec]

    def epilogue(slot, col, sums, smem_refs, o_smem):
      (out,) = sums
      weight_N = plgpu.load(smem_refs[2].at[pl.ds(0, n)], layout=plgpu.Layout.WGMMA.reduce(0))
      weighted = out * lax.broadcast_in_dim(weight_N, (bc, n), [1])
      _store_transposed(weighted, o_smem, out_ref.at[slot, :, pl.ds(col * bc, bc)])

    _slot_pipeline(
        num_slots=num_slots_ref[0], col_blocks=dim // bc, k_steps=ffn // bk, block_cols=bc,
        tokens_pad=n, dtype=dtype, in_specs_for=in_specs_for, num_sums=1, stages=stages,
        epilogue=epilogue, operands_of=lambda a, w, r: [(w, a)],
        async_mma=tiling.async_mma,
    )(act_ref, w_down_ref, weight_ref)

  return _kernel_call(body, (num_slots_max, n, dim), dtype, "moe_decode_down")(
      slot_expert_S, num_slots_1, weight_SR, act_SNF, w_down_EFD)
