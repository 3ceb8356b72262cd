"""MLA flash-decoding on Hopper's tensor cores (Pallas Mosaic GPU): the same attention as
jspec.pallas_kernels.mla_decode's Triton kernel, for tiles of 64 query rows.

Why: with 128 heads per device an MLA decode step does about 242 FLOP per latent byte, above
an H200's balance, so the attention is bound by the tensor cores, and the Triton kernel
reaches 8-34% of that floor (BENCHMARKS.md, "MLA decode attention on an H200"). FlashMLA's
answer is a warp-specialized wgmma kernel; this is its shape in Pallas.

How one program (row tile, split, sequence) runs, as FlashMLA does:
  rows     64 query rows (wgmma's M) in (token, head) order, [q_lat | q_rope] in SMEM.
  memory   a third warpgroup streams the split's latent blocks by TMA, each block's rows as
           three tiles (latent columns [0, C/2), [C/2, C), the rope key), `num_stages` deep.
  scores   warpgroup 0: S = q . block^T (three wgmmas into one float32 accumulator), the
           causal mask on the blocks that need it, the online softmax (base 2, the scale
           folded in); it hands P (bf16) and the rows' rescaling factors to warpgroup 1
           through SMEM, then adds P . latent[:, :C/2] into its half of the output.
  values   warpgroup 1 waits for P, rescales its half and adds P . latent[:, C/2:].
The output's two halves (64 x C/2 float32 each) are what the register file can hold: a
64 x C accumulator would need all of one warpgroup's registers. After the loop both halves
go out through SMEM that aliases the drained stage buffers, with the chunk's log-sum-exp;
chunks merge as in mla_decode (jspec.pallas_kernels.mla_merge).

Blocks whose slots every real row of the tile sees skip the mask (`_tile_bounds` gives, per
sequence and tile, the slots all real rows see and the slots any row sees); a row that sees
nothing (padding, an idle sequence) gives zeros and a log-sum-exp of -inf.

Measured on an H200 (BENCHMARKS.md, "MLA decode attention on Hopper's tensor cores"): 1.4-3.1x
XLA's path and 1.4-2.4x the Triton kernel at 128 heads, 44-74% of the FLOP floor from batch 8.
At batch 1 a call at context 8k costs 29-43 µs, 7-31% of the floor: per call costs dominate
(the launch, each program's Q and float32 partial outputs, the merge; profiled there).
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
from jspec.pallas_kernels.shared import smem_transforms

ROWS = 64          # query rows per program: wgmma's M
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
SCORES_WG, VALUES_WG, MEMORY_WG = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class WgmmaTiling:
  """block_slots: latent rows per pipeline step (the scores' N); num_stages: blocks in
  flight. 64 x 2 keeps the SMEM (Q 72 KiB, stages 144 KiB at C = 512) under Hopper's 227."""
  block_slots: int = 64
  num_stages: int = 2


def fits_latent(latent_dim: int, rope_dim: int) -> bool:
  """Whether this kernel takes latent rows of [C | R]: each half of C and R whole 64-column
  (128-byte) swizzle tiles, a half at most wgmma's N of 256."""
  return (latent_dim % 128 == 0 and latent_dim // 2 <= 256 and rope_dim % 64 == 0
          and rope_dim <= 256)


def fits_kernel(latent_dim: int, rope_dim: int, slots: int, tiling: WgmmaTiling) -> bool:
  """`fits_latent`, and a cache of whole blocks (no TMA past its end; jspec's cache buckets
  are multiples of 128 slots)."""
  return fits_latent(latent_dim, rope_dim) and slots % tiling.block_slots == 0


def _split_blocks(length, splits: int, split, block_slots: int):
  """The blocks [first, end) of this split's chunk of a tile's `length` slots."""
  blocks = (length + block_slots - 1) // block_slots
  per_split = (blocks + splits - 1) // splits
  first = split * per_split
  return first, jnp.maximum(jnp.minimum(first + per_split, blocks), first)


def _written_rows(live: int) -> int:
  """A tile's rows written out: its `live` ones, up to whole 8-row swizzle tiles of SMEM."""
  return min(ROWS, -(-live // 8) * 8)


def _tile_bounds(window_gmem, b, tile, *, heads: int, slots: int):
  """(the slots every real row of the tile sees, the slots any row sees), within [0, S], from
  the window's positions [B, T]: the tile's rows are those of tokens tile * 64 // N to
  (tile * 64 + 63) // N. Read here, since XLA's reductions for them were three kernels of
  their own before a batch-1 call."""
  seen_by_all, length = jnp.int32(slots), jnp.int32(0)
  for t in range(window_gmem.shape[1]):
    in_tile = (t * heads < (tile + 1) * ROWS) & ((t + 1) * heads > tile * ROWS)
    pos = window_gmem[b, t]
    seen_by_all = jnp.where(in_tile, jnp.minimum(seen_by_all, pos + 1), seen_by_all)
    length = jnp.where(in_tile, jnp.maximum(length, pos + 1), length)
  return jnp.clip(seen_by_all, 0, slots), jnp.clip(length, 0, slots)


def _kernel(q_gmem, cache_gmem, pos_gmem, window_gmem, out_gmem, lse_gmem, *, scratch,
            scale: float, latent_dim: int, splits: int, heads: int, tiling: WgmmaTiling,
            live_rows: int):
  tile, split, b = lax.axis_index("tile"), lax.axis_index("split"), lax.axis_index("batch")
  wg = lax.axis_index("wg")
  half = latent_dim // 2
  width = cache_gmem.shape[-1]
  block_slots, stages = tiling.block_slots, tiling.num_stages
  rows = pl.ds(tile * ROWS, ROWS)
  (q_smem, stage_or_out, p_smem, row_smem, pos_smem, bars) = scratch
  # One buffer for the rows' float32 vectors (small buffers each pad to an alignment): the
  # rescaling factors of a step, then the sums l, then the log-sum-exps.
  alpha_smem, l_smem, lse_smem = row_smem.at[0], row_smem.at[1], row_smem.at[2]
  (*lat_smem, rope_smem), o_smem = stage_or_out  # lat_smem: the two halves' stage buffers
  q_bars, lat_bars, rope_bars, consumed, p_ready, p_free, pos_bar, loop_done = bars

  seen_by_all, length = _tile_bounds(window_gmem, b, tile, heads=heads,
                                     slots=cache_gmem.shape[1])
  first, end = _split_blocks(length, splits, split, block_slots)
  steps = end - first
  # Blocks before `unmasked_end` hold only slots every real row of the tile sees.
  unmasked_end = jnp.clip(seen_by_all // block_slots, first, end)

  def block_rows(step):
    return pl.ds((first + step) * block_slots, block_slots)

  @pl.when(wg == MEMORY_WG)
  def _memory():
    plgpu.set_max_registers(40, action="decrease")

    def load(step, slot):
      src = cache_gmem.at[b, block_rows(step)]
      for h in range(2):
        plgpu.copy_gmem_to_smem(src.at[:, pl.ds(h * half, half)], lat_smem[h].at[slot],
                                lat_bars.at[h, slot])
      plgpu.copy_gmem_to_smem(src.at[:, pl.ds(latent_dim, width - latent_dim)],
                              rope_smem.at[slot], rope_bars.at[slot])

    for step in range(stages):
      pl.when(step < steps)(functools.partial(load, step, step))

    @pl.loop(stages, jnp.maximum(steps, stages))
    def _refill(step):
      slot = lax.rem(step, stages)
      plgpu.barrier_wait(consumed.at[slot])
      load(step, slot)

    # Observe the last blocks' release too: every barrier phase is waited on once.
    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _drain(step):
      plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

  def normalised(acc, l):
    seen = l > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    return acc * lax.broadcast_in_dim(inv, acc.shape, [0])

  last_tile = out_gmem.shape[2] // ROWS - 1
  last_rows = _written_rows(live_rows - last_tile * ROWS)

  def write_half(h, acc, l):
    o_half = o_smem.at[h]
    o_half[...] = normalised(acc, l).astype(o_half.dtype)
    plgpu.commit_smem()
    columns = pl.ds(h * half, half)
    if last_rows == ROWS:
      plgpu.copy_smem_to_gmem(o_half, out_gmem.at[b, split, rows, columns])
      return
    # The last tile writes its live rows only (the merge reads no others).
    @pl.when(tile == last_tile)
    def _live():
      plgpu.copy_smem_to_gmem(o_half.at[pl.ds(0, last_rows)],
                              out_gmem.at[b, split, pl.ds(tile * ROWS, last_rows), columns])

    @pl.when(tile != last_tile)
    def _whole():
      plgpu.copy_smem_to_gmem(o_half, out_gmem.at[b, split, rows, columns])

  def zeros_acc():
    return plgpu.layout_cast(jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA)

  def add_pv(acc, p, values_smem):
    def mma(acc_ref):
      plgpu.wgmma(acc_ref, p, values_smem)
    if platform.on_gpu():
      # Into the running accumulator: a fresh one would need another 128 registers a thread.
      return pl.run_state(mma)(plgpu.ACC.init(acc))
    # The interpreter has no run_state: the same sum, from a fresh accumulator.
    def fresh(acc_ref):
      mma(acc_ref)
      return acc_ref[...]
    return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))

  @pl.when(wg == SCORES_WG)
  def _scores():
    plgpu.set_max_registers(232, action="increase")
    q_lat, q_rope = q_smem
    for h in range(2):
      plgpu.copy_gmem_to_smem(q_gmem.at[b, rows, pl.ds(h * half, half)], q_lat.at[h],
                              q_bars.at[h])
    plgpu.copy_gmem_to_smem(q_gmem.at[b, rows, pl.ds(latent_dim, width - latent_dim)], q_rope,
                            q_bars.at[2])
    plgpu.copy_gmem_to_smem(pos_gmem.at[b, rows], pos_smem, pos_bar)
    for i in range(3):
      plgpu.barrier_wait(q_bars.at[i])
    plgpu.barrier_wait(pos_bar)
    pos_R = plgpu.load(pos_smem, layout=plgpu.Layout.WGMMA.reduce(1))
    log2_scale = scale * LOG2E

    def step_fn(step, carry, masked: bool):
      acc, m, l = carry
      slot = lax.rem(step, stages)
      plgpu.barrier_wait(lat_bars.at[0, slot])
      plgpu.barrier_wait(lat_bars.at[1, slot])
      plgpu.barrier_wait(rope_bars.at[slot])

      def scores_mma(s_ref):
        for h in range(2):
          plgpu.wgmma(s_ref, q_lat.at[h], lat_smem[h].at[slot].T)
        plgpu.wgmma(s_ref, q_rope, rope_smem.at[slot].T)
        return s_ref[...]

      s = pl.run_scoped(scores_mma, plgpu.ACC((ROWS, block_slots), jnp.float32)) * log2_scale
      if masked:
        slot_ids = (first + step) * block_slots + plgpu.broadcasted_iota(
            jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        visible = slot_ids <= lax.broadcast_in_dim(pos_R, s.shape, [0])
        s = jnp.where(visible, s, -jnp.inf)
      # m starts finite, so a row that has seen nothing keeps exp2(-inf - m) = 0, never NaN.
      m_next = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2(m - m_next)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
      l = l * alpha + p.sum(axis=1)
      # Warpgroup 1 must be done with the previous P before this one overwrites it.
      pl.when(step > 0)(lambda: plgpu.barrier_wait(p_free))
      p_smem[...] = p.astype(p_smem.dtype)
      alpha_smem[...] = alpha
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)
      # P from SMEM for both warpgroups (the same product as from registers; the interpreter
      # takes no register operand).
      acc = add_pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_smem,
                   lat_smem[0].at[slot])
      plgpu.barrier_arrive(consumed.at[slot])
      return acc, m_next, l

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    carry = (zeros_acc(),
             plgpu.layout_cast(jnp.full((ROWS,), jnp.finfo(jnp.float32).min, jnp.float32),
                               row_layout),
             plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout))
    carry = lax.fori_loop(0, unmasked_end - first,
                          functools.partial(step_fn, masked=False), carry)
    acc, m, l = lax.fori_loop(unmasked_end - first, steps,
                              functools.partial(step_fn, masked=True), carry)
    pl.when(steps > 0)(lambda: plgpu.barrier_wait(p_free))  # the last P's release
    l_smem[...] = l
    seen = l > 0
    lse_smem[...] = jnp.where(seen, m * LN2 + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[b, split, rows])
    # The output's SMEM aliases the stage buffers: both warpgroups' last products must be done.
    plgpu.barrier_arrive(loop_done)
    plgpu.barrier_wait(loop_done)
    write_half(0, acc, l)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == VALUES_WG)
  def _values():
    plgpu.set_max_registers(232, action="increase")

    def step_fn(step, acc):
      slot = lax.rem(step, stages)
      plgpu.barrier_wait(p_ready)
      plgpu.barrier_wait(lat_bars.at[1, slot])
      alpha = plgpu.load(alpha_smem, layout=plgpu.Layout.WGMMA.reduce(1))
      acc = add_pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_smem,
                   lat_smem[1].at[slot])
      plgpu.barrier_arrive(consumed.at[slot])
      plgpu.barrier_arrive(p_free)
      return acc

    acc = lax.fori_loop(0, steps, step_fn, zeros_acc())
    plgpu.barrier_arrive(loop_done)
    plgpu.barrier_wait(loop_done)
    l = plgpu.load(l_smem, layout=plgpu.Layout.WGMMA.reduce(1))
    write_half(1, acc, l)
    plgpu.wait_smem_to_gmem(0)


def _scratch(dtype, out_dtype, latent_dim: int, rope_dim: int, tiling: WgmmaTiling):
  half = latent_dim // 2
  bs, stages = tiling.block_slots, tiling.num_stages

  def smem(shape, dt):
    return plgpu.SMEM(shape, dt, transforms=smem_transforms(shape[-1], dt))

  q_smem = (smem((2, ROWS, half), dtype), smem((ROWS, rope_dim), dtype))
  # Separate buffers per latent half: a ref closed over by run_state may only be indexed by
  # traced values (a constant index becomes a state the lowering cannot carry).
  stage_smem = (smem((stages, bs, half), dtype), smem((stages, bs, half), dtype),
                smem((stages, bs, rope_dim), dtype))
  o_smem = smem((2, ROWS, half), out_dtype)
  bars = (plgpu.Barrier(num_barriers=3),                      # q's three tiles
          plgpu.Barrier(num_barriers=(2, stages)),            # latent halves per stage
          plgpu.Barrier(num_barriers=stages),                 # rope keys per stage
          plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # a stage read by both
          plgpu.Barrier(),                                    # P ready
          plgpu.Barrier(),                                    # P free again
          plgpu.Barrier(),                                    # the rows' positions
          plgpu.Barrier(num_arrivals=2))                      # both loops done
  return (q_smem, plgpu.RefUnion(stage_smem, o_smem), smem((ROWS, bs), dtype),
          plgpu.SMEM((3, ROWS), jnp.float32), plgpu.SMEM((ROWS,), jnp.int32), bars)


def latent_attention_parts(q_BRL, cache_BSL, pos_BR, positions_BT, *, latent_dim: int,
                           scale: float, splits: int, out_dtype, heads: int,
                           tiling: WgmmaTiling = WgmmaTiling(), live_rows: int | None = None):
  """Per chunk: the normalised context [B, K, R, C] (`out_dtype`) and log-sum-exp [B, K, R]
  of the padded query rows q [B, R, L] (R a multiple of 64) over cache [B, S, L].

  pos_BR: each row's position (-1: sees nothing); positions_BT: the window's positions, row r
  being token r // `heads` (rows past T x heads are padding). `live_rows` (None: R): the
  context is written for these rows (up to whole 8-row tiles) and left unwritten past them;
  the log-sum-exps for all R."""
  b, padded, width = q_BRL.shape
  live_rows = padded if live_rows is None else live_rows
  if not padded - ROWS < live_rows <= padded:
    raise ValueError(f"latent_attention_parts: live_rows={live_rows} must fall in the last of "
                     f"the {padded // ROWS} row tiles")
  row_tiles = padded // ROWS
  scratch = _scratch(cache_BSL.dtype, out_dtype, latent_dim, width - latent_dim, tiling)
  kernel = functools.partial(_kernel, scale=scale, latent_dim=latent_dim, splits=splits,
                             heads=heads, tiling=tiling, live_rows=live_rows)
  return plgpu.kernel(
      lambda *refs: kernel(*refs[:6], scratch=refs[6:]),
      out_type=(jax.ShapeDtypeStruct((b, splits, padded, latent_dim), out_dtype),
                jax.ShapeDtypeStruct((b, splits, padded), jnp.float32)),
      scratch_types=scratch,
      grid=(row_tiles, splits, b), grid_names=("tile", "split", "batch"),
      num_threads=3, thread_name="wg",
      # The row reductions stay inside each warp (the wgmma layout gives a row to one warp), so
      # no SMEM for cross-warp reductions: the 2 KiB it reserves by default do not fit.
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
      interpret=platform.interpret_params(), kernel_name="mla_flash_decode_wgmma",
  )(q_BRL, cache_BSL, pos_BR, positions_BT)
