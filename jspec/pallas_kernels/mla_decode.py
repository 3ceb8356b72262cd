"""Flash-decoding over MLA's latent cache: the absorbed form's attention in one pass.

What it computes (jspec.models.mla.latent_attention, the XLA path it replaces): for each
sequence b, every query row -- all N heads at each of the window's T positions, [q_lat | q_rope]
in the cache's row space [L = C + R] -- attends causally to the sequence's cached rows
[latent (C) | rope key (R)]; the probabilities weight the rows' latent parts (C wide).

Why: XLA runs it as two batched products over the whole cache bucket, scores [B, N, T, S] in
float32 between them, reading the latent twice (7.7-18.8% of the HBM bandwidth at 8k). Here
each block of latent rows is loaded once for both products (the values are the first C
columns of the same rows), and only each sequence's valid slots are read.

How (Pallas on Triton, as JAX's jax/experimental/pallas/ops/gpu/decode_attention.py):
  rows    the window's N x T query rows of a sequence, in (token, head) order (a free reshape
          of q [B, T, N, L]), in tiles of `block_rows`; each row carries its absolute position.
  splits  each sequence's valid slots (up to its tile's largest position) are cut into K
          equal chunks, one program each: programs (row tile, split, sequence). Row tiles are
          the launch grid's fastest axis, so the tiles that read the same latent chunk run side
          by side and all but the first find it in L2.
  program walks its chunk `block_slots` rows at a time: scores = q_lat . latent + q_rope .
          rope key (float32), causal mask by the row's position, online softmax, acc += p .
          latent; writes acc / l of its live rows and the log-sum-exp of its chunk.
  merge   the K partial softmaxes combined by their log-sum-exps in one more kernel
          (jspec.pallas_kernels.mla_merge; K = 1: the kernel's output, in the cache's dtype).
Rows' positions and tiles' lengths come from the window's positions [B, T] in the kernel (no
XLA kernel before it). A row that sees no slot (an idle sequence) gives zeros.

K fills the GPU once (`choose_splits`), each chunk at least as heavy in latent rows as its
float32 partial output (`min_split_slots`). 16 heads per device (a tp = 8 shard) is
memory-bound; 128 heads is compute-bound on Hopper (242 FLOP per latent byte at T = 1, above
an H100's ~220 and an H200's ~165; verify(4) four times that).

On Hopper, wide windows and large batches (`choose_form`) go to jspec.pallas_kernels.
mla_decode_wgmma, FlashMLA's warp-specialized design: on an H200 1.3-3.1x XLA's path at 128
heads (up to 76% of the FLOP floor), at 16 heads, batch 8-32, 32k, 67-87% of the read probe.
On a GPU the kernel needs C and R powers of two >= 16 (Triton's block shapes and the tensor
cores' smallest dot; DeepSeek-V3 / R1, GLM-4.7-Flash and Kimi K2: C = 512, R = 64).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import mla_decode_wgmma as wgmma
from jspec.pallas_kernels import mla_merge, platform

MIN_ROWS = 16          # Triton's dot needs 16 rows
PARTIAL_BYTES = 4      # a chunk's partial output is float32 (the Triton form's)
# The wgmma form's chunks in the cache's dtype (False: float32): bf16 halves the partials a
# 128-head call writes at its end and the merge reads (BENCHMARKS.md, "MLA's wgmma chunks in
# bf16"); each is normalised, so bf16 adds at most one rounding of the output's size.
WGMMA_CACHE_DTYPE_PARTS = True


@dataclasses.dataclass(frozen=True)
class MLATiling:
  """block_rows: query rows per program (at most; fewer rows take the next power of two >= 16;
  0: `rows_block`'s choice by the batch); block_slots: latent rows per loop step; num_warps /
  num_stages: Triton's (stages: loads in flight ahead of the loop; 0: `stages_for`'s choice by
  the tile's rows); programs_per_sm: how many programs per SM `choose_splits` aims at."""
  block_rows: int = 0
  block_slots: int = 64
  num_warps: int = 8
  num_stages: int = 0
  programs_per_sm: int = 1


STAGED_BYTES = 144 << 10  # latent blocks in flight: the default tiling's at bf16 (2 x 64 x 1152)


def fitting_block_slots(block_slots: int, stages: int, row_bytes: int, slots: int) -> int:
  """`block_slots` halved (to 16 at least) until it lies within the cache and its `stages` - 1
  blocks in flight of `row_bytes` rows fit STAGED_BYTES: float32 caches of DeepSeek-V3's rows
  take 32-slot blocks (64 would ask for 295 KiB of shared memory, past Hopper's 227)."""
  while block_slots > MIN_ROWS and (block_slots > slots
                                    or (stages - 1) * block_slots * row_bytes > STAGED_BYTES):
    block_slots //= 2
  return block_slots


def stages_for(block_rows: int) -> int:
  """Loads in flight: 3 for tiles of up to 16 rows (16 heads: 8-10% faster than 2 from batch 8
  on an H100; BENCHMARKS.md, "FP8 and MLA decode kernels under the profiler"), 2 for larger
  tiles, whose query rows take more of the shared memory."""
  return 3 if block_rows <= 16 else 2


def _pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def fits_kernel(latent_dim: int, rope_dim: int) -> bool:
  """Whether the compiled kernel takes rows of [C | R] (interpret mode takes any)."""
  return all(_pow2(d) and d >= 16 for d in (latent_dim, rope_dim))


BATCH_BLOCK_ROWS = 64  # the row tile's bound from two sequences on (block_rows = 0)


def rows_block(rows: int, tiling: MLATiling, batch: int) -> int:
  """Query rows per program: the next power of two >= 16 of the window's rows, at most
  tiling.block_rows, or where that is 0, 16 for a single sequence (its few blocks per program
  leave fixed costs weighing most: 0.69-0.90x a 64-row tile's time at T = 4) and
  BATCH_BLOCK_ROWS from two on (BENCHMARKS.md, "MLA decode at batch 1: ...")."""
  most = tiling.block_rows or (MIN_ROWS if batch == 1 else BATCH_BLOCK_ROWS)
  return min(most, max(MIN_ROWS, 1 << (rows - 1).bit_length()))


def min_split_slots(tile_rows: int, latent_dim: int, row_bytes: int) -> int:
  """The shortest chunk worth a program of its own: one whose latent rows (`row_bytes` each)
  weigh at least its float32 partial output ([tile_rows, C]), which the merge reads back. For
  DeepSeek-V3's rows that is 114 slots per 64-row tile and 29 for a tp = 8 shard's 16 rows:
  132 chunks at batch 1 / 8k instead of 32, 22.4 -> 17.5 us in one comparison on an H100
  (BENCHMARKS.md, "FP8 and MLA decode kernels under the profiler")."""
  return -(-tile_rows * latent_dim * PARTIAL_BYTES // row_bytes)


def choose_splits(batch: int, row_tiles: int, slots: int, num_sms: int,
                  programs_per_sm: int = 1, *, min_slots: int) -> int:
  """The most chunks per sequence whose programs run in one wave (`programs_per_sm` per SM),
  at most one per `min_slots` slots of the cache (min_split_slots), at least one. One more
  would start a second wave: on an H100, 144 programs took about as long as 2 x 132."""
  fit = num_sms * programs_per_sm // (batch * row_tiles)
  return max(1, min(fit, slots // min_slots))


def _row_positions(pos_ref, b, tile, *, block_rows: int, heads: int):
  """The positions of a tile's query rows, row r being token r // heads of the window (-1 for
  the padding rows past it), from the window's positions [B, T]: read here rather than
  repeated per row by XLA, whose small kernels took longer than a batch-1 call's attention."""
  token_R = (tile * block_rows + jnp.arange(block_rows)) // heads
  pos_R = jnp.full((block_rows,), -1, jnp.int32)
  for t in range(pos_ref.shape[1]):
    pos_R = jnp.where(token_R == t, pos_ref[b, t], pos_R)
  return pos_R


def _kernel(q_ref, cache_ref, pos_ref, out_ref, lse_ref, *, scale: float, latent_dim: int,
            rope_dim: int, block_rows: int, block_slots: int, splits: int, heads: int,
            live_rows: int):
  """Program (row tile, split, sequence); whole-array refs indexed here (L = C + R need not be
  a power of two, so no BlockSpec can cut it). `live_rows`: the window's T x N rows."""
  tile, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = pl.ds(pl.multiple_of(tile * block_rows, block_rows), block_rows)
  q_lat = q_ref[b, rows, pl.ds(0, latent_dim)]
  q_rope = q_ref[b, rows, pl.ds(latent_dim, rope_dim)]
  pos_R = _row_positions(pos_ref, b, tile, block_rows=block_rows, heads=heads)
  # The slots this tile's rows see (the cache's end at most), cut into `splits` chunks of
  # whole blocks.
  length = jnp.clip(jnp.max(pos_R) + 1, 0, cache_ref.shape[1])
  blocks = (length + block_slots - 1) // block_slots
  chunk = (blocks + splits - 1) // splits * block_slots
  start = split * chunk
  end = jnp.minimum(start + chunk, length)
  steps = jnp.maximum(end - start + block_slots - 1, 0) // block_slots

  def body(i, carry):
    acc, m, l = carry
    first = start + i * block_slots
    slots = first + jnp.arange(block_slots)
    valid = slots < end
    # One indexer per load: interpret mode pads a slice past the cache's end only there.
    window = pl.ds(first, block_slots)
    latent = pltriton.load(cache_ref.at[b, window, pl.ds(0, latent_dim)],
                           mask=valid[:, None], other=0)
    rope = pltriton.load(cache_ref.at[b, window, pl.ds(latent_dim, rope_dim)],
                         mask=valid[:, None], other=0)
    scores = (pltriton.dot(q_lat, latent, trans_b=True)
              + pltriton.dot(q_rope, rope, trans_b=True)) * scale
    visible = valid[None, :] & (slots[None, :] <= pos_R[:, None])
    scores = jnp.where(visible, scores, -jnp.inf)
    # m starts finite, so a row with nothing visible yet keeps exp(-inf - m) = 0, never NaN.
    m_next = jnp.maximum(m, jnp.max(scores, axis=1))
    correction = jnp.exp(m - m_next)
    p = jnp.exp(scores - m_next[:, None])
    l = l * correction + jnp.sum(p, axis=1)
    acc = acc * correction[:, None] + pltriton.dot(p.astype(latent.dtype), latent)
    return acc, m_next, l

  init = (jnp.zeros((block_rows, latent_dim), jnp.float32),
          jnp.full((block_rows,), jnp.finfo(jnp.float32).min, jnp.float32),
          jnp.zeros((block_rows,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(0, steps, body, init)
  seen = l > 0
  out = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
  out = out.astype(out_ref.dtype)
  if live_rows % block_rows:
    # The last tile's padding rows are not written: the merge reads only the live ones.
    live_R = tile * block_rows + jnp.arange(block_rows) < live_rows
    pltriton.store(out_ref.at[b, split, rows, pl.ds(0, latent_dim)], out,
                   mask=live_R[:, None])
  else:
    out_ref[b, split, rows, pl.ds(0, latent_dim)] = out
  lse_ref[b, split, rows] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


WGMMA_ONE_TILE_MIN_SLOTS = 1 << 15  # one-tile windows take the wgmma form from this many slots
WGMMA_MIN_BATCH_SLOTS = 1 << 16  # half-tile windows take the wgmma form from this many slots
WGMMA_H200_MIN_BATCH_SLOTS = 1 << 18  # on an H200, windows of any width from this many


def choose_form(rows: int, latent_dim: int, rope_dim: int, slots: int, dtype, *,
                batch: int) -> str:
  """"wgmma" (jspec.pallas_kernels.mla_decode_wgmma) where the shape fits it, the cache is
  16-bit and a sequence's window has more than a 64-row tile of query rows (128 heads);
  exactly one (verify(4) at 16 heads) from 32k slots a batch (batch x S), half of one or more
  (verify(2-3)) from 64k; on an H200 any window from 256k. Else "triton". Against the Triton
  form (one H100 unless said; BENCHMARKS.md, "MLA decode: live rows only"): one tile at batch
  1 1.16x / 1.03x / 0.81x at 8k / 16k / 32k; half tiles 0.72x / 0.95x at batch 8 / 8k (T = 3
  / 2), 0.79x at batch 8 / 32k, 0.74-0.84x at batch 32, 0.86-1.43x at batch 1; a 16-head
  decode step on an H200 0.74-0.88x at batch 32, 0.64x / 1.00x at batch 8 / 32k, where an
  H100's took 1.16-1.17x ("FP8 and MLA decode on an H200 ...")."""
  many_slots = batch * slots
  wide_enough = (rows > wgmma.ROWS
                 or (rows == wgmma.ROWS and many_slots >= WGMMA_ONE_TILE_MIN_SLOTS)
                 or (2 * rows >= wgmma.ROWS and many_slots >= WGMMA_MIN_BATCH_SLOTS)
                 or (many_slots >= WGMMA_H200_MIN_BATCH_SLOTS
                     and "H200" in platform.device_kind()))
  if (wide_enough and jnp.dtype(dtype).itemsize == 2
      and wgmma.fits_kernel(latent_dim, rope_dim, slots, wgmma.WgmmaTiling())):
    return "wgmma"
  return "triton"


@functools.partial(jax.jit, static_argnames=("latent_dim", "scale", "splits", "tiling",
                                             "interpret", "form"))
def mla_decode(q_BTNL: jax.Array, cache_BSL: jax.Array, positions_BT: jax.Array, *,
               latent_dim: int, scale: float, splits: int | None = None,
               tiling: MLATiling = MLATiling(), interpret: bool | None = None,
               form: str | None = None) -> jax.Array:
  """Causal attention of q [B, T, N, L] (in cache-row space) over cache [B, S, L]: the
  probability-weighted latent parts [B, T, N, C] in the cache's dtype (float32 sums).

  Query row (t, n) of sequence b sees slots j <= positions[b, t] (clipped to the cache); a
  row whose position is negative sees none and gives zeros. `splits` chunks per sequence
  (None: `choose_splits`); `interpret` None: interpret off GPU. `form`: "triton" (this
  module's kernel, `tiling`), "wgmma" (jspec.pallas_kernels.mla_decode_wgmma, interpreted
  off GPU as well), None: `choose_form`'s pick on a Hopper GPU, "triton" elsewhere."""
  b, t, n, width = q_BTNL.shape
  slots = cache_BSL.shape[1]
  rope_dim = width - latent_dim
  if cache_BSL.shape[0] != b or cache_BSL.shape[2] != width or rope_dim < 1:
    raise ValueError(f"mla_decode takes q [B, T, N, L] and a cache [B, S, L] with L = C + R "
                     f"> C={latent_dim}, got {q_BTNL.shape} and {cache_BSL.shape}")
  if form is None:
    form = ("triton" if not platform.on_hopper()
            else choose_form(t * n, latent_dim, rope_dim, slots, cache_BSL.dtype, batch=b))
  if form == "wgmma":
    return _wgmma_form(q_BTNL, cache_BSL, positions_BT, latent_dim=latent_dim, scale=scale,
                       splits=splits)
  if form != "triton":
    raise ValueError(f"mla_decode's form is 'triton', 'wgmma' or None, got {form!r}")
  if interpret is None:
    interpret = not platform.on_gpu()
  if not interpret and not fits_kernel(latent_dim, rope_dim):
    raise ValueError(f"mla_decode on a GPU needs C and R powers of two >= 16, got "
                     f"C={latent_dim}, R={rope_dim}")
  rows = t * n
  block_rows = rows_block(rows, tiling, b)
  q_BRL = _rows(q_BTNL, cache_BSL.dtype, block_rows)
  padded = q_BRL.shape[1]
  row_tiles = padded // block_rows
  if splits is None:
    splits = choose_splits(b, row_tiles, slots, platform.num_sms(), tiling.programs_per_sm,
                           min_slots=min_split_slots(block_rows, latent_dim,
                                                     width * cache_BSL.dtype.itemsize))
  stages = tiling.num_stages or stages_for(block_rows)
  block_slots = fitting_block_slots(tiling.block_slots, stages,
                                    width * cache_BSL.dtype.itemsize, slots)
  out_dtype = _parts_dtype(splits, cache_BSL.dtype)
  parts_BKRC, lse_BKR = pl.pallas_call(
      functools.partial(_kernel, scale=scale, latent_dim=latent_dim, rope_dim=rope_dim,
                        block_rows=block_rows, block_slots=block_slots, splits=splits,
                        heads=n, live_rows=rows),
      out_shape=(jax.ShapeDtypeStruct((b, splits, padded, latent_dim), out_dtype),
                 jax.ShapeDtypeStruct((b, splits, padded), jnp.float32)),
      grid=(row_tiles, splits, b),
      compiler_params=pltriton.CompilerParams(
          num_warps=tiling.num_warps, num_stages=stages),
      interpret=interpret,
      name="mla_flash_decode",
  )(q_BRL, cache_BSL, positions_BT.astype(jnp.int32))
  return _context(parts_BKRC, lse_BKR, q_BTNL.shape, latent_dim, cache_BSL.dtype, interpret)


def _rows(q_BTNL, dtype, block_rows: int):
  """q's N x T rows per sequence in (token, head) order, padded to whole tiles [B, R', L] (a
  free reshape where the rows fill their tiles, as a decode step's 16 or 128 heads do)."""
  b, t, n, width = q_BTNL.shape
  rows = t * n
  padded = -(-rows // block_rows) * block_rows
  return jnp.pad(q_BTNL.reshape(b, rows, width).astype(dtype),
                 ((0, 0), (0, padded - rows), (0, 0)))


def _rows_and_positions(q_BTNL, positions_BT, dtype, block_rows: int):
  """_rows, and each row's position [B, R'] (padding rows -1: they see nothing)."""
  b, t, n, _ = q_BTNL.shape
  q_BRL = _rows(q_BTNL, dtype, block_rows)
  pos_BR = jnp.pad(jnp.repeat(positions_BT.astype(jnp.int32), n, axis=1),
                   ((0, 0), (0, q_BRL.shape[1] - t * n)), constant_values=-1)
  return q_BRL, pos_BR


def _parts_dtype(splits: int, dtype, narrow: bool = False):
  """One chunk is the result, in the cache's dtype; several to merge, float32 unless narrow."""
  return dtype if splits == 1 or narrow else jnp.float32


def _context(parts_BKRC, lse_BKR, q_shape, latent_dim: int, dtype, interpret: bool | None):
  """Either form's chunks as mla_decode returns them: [B, T, N, C] in `dtype`; several chunks
  merged by jspec.pallas_kernels.mla_merge. The padding rows past T x N are neither written
  by the kernels (a 16-head decode step's wgmma tile is 3/4 padding: its float32 partials
  were most of a call's writes) nor read."""
  b, t, n, _ = q_shape
  if parts_BKRC.shape[1] == 1:
    out_BRC = parts_BKRC[:, 0, :t * n]
  else:
    out_BRC = mla_merge.merge_chunks(parts_BKRC, lse_BKR, dtype=dtype, interpret=interpret,
                                     rows=t * n)
  return out_BRC.reshape(b, t, n, latent_dim)


def _wgmma_form(q_BTNL, cache_BSL, positions_BT, *, latent_dim: int, scale: float,
                splits: int | None, tiling: wgmma.WgmmaTiling = wgmma.WgmmaTiling()):
  """mla_decode through jspec.pallas_kernels.mla_decode_wgmma: 64-row tiles, each row's
  position, and the window's positions, from which the kernel bounds each tile's slots."""
  b, t, n, width = q_BTNL.shape
  slots = cache_BSL.shape[1]
  if not wgmma.fits_kernel(latent_dim, width - latent_dim, slots, tiling):
    raise ValueError(
        f"mla_decode's wgmma form needs C a multiple of 128 (at most 512), R a multiple of 64 "
        f"and a cache of whole {tiling.block_slots}-slot blocks, got C={latent_dim}, "
        f"R={width - latent_dim}, S={slots}")
  q_BRL, pos_BR = _rows_and_positions(q_BTNL, positions_BT, cache_BSL.dtype, wgmma.ROWS)
  row_tiles = q_BRL.shape[1] // wgmma.ROWS
  if splits is None:
    splits = choose_splits(b, row_tiles, slots, platform.num_sms(), min_slots=min_split_slots(
        wgmma.ROWS, latent_dim, width * cache_BSL.dtype.itemsize))
  out_dtype = _parts_dtype(splits, cache_BSL.dtype, narrow=WGMMA_CACHE_DTYPE_PARTS)
  parts_BKRC, lse_BKR = wgmma.latent_attention_parts(
      q_BRL, cache_BSL, pos_BR, positions_BT.astype(jnp.int32), latent_dim=latent_dim,
      scale=scale, splits=splits, out_dtype=out_dtype, heads=n, tiling=tiling, live_rows=t * n)
  return _context(parts_BKRC, lse_BKR, q_BTNL.shape, latent_dim, cache_BSL.dtype, None)
