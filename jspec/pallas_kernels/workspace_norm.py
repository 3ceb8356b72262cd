"""The all-reduce of a tp layer's output, the residual add after it and the next RMSNorm, in one
kernel launch (TensorRT-LLM's "all-reduce + residual + RMSNorm" fusion).

A tp decode step ends each attention and each MLP with a row product's all-reduce, and the
next thing it does is the residual add and an RMSNorm (jspec.pallas_kernels.residual_norm's
`rms_norm`), a kernel of its own: 72 all-reduces and 72 norm kernels a Qwen3-8B step. Here the
norm runs in the all-reduce's blocks, after their sums:

  workspace_add_norm(partial [M, D], residual [M, D], scale [D], row, ...) -> (h, norm(h))

with h = residual + the sum of `partial` over the group, rounded as the unfused steps round
(the sum to the stream's dtype once, as the all-reduce returns it, then the add in float32
rounded once, as `rms_norm` does), and norm(h) as `rms_norm` computes it (RMSNorm, or
ZeroCenteredRMSNorm's (1 + w) with `zero_centered`). Only the order of the float32 sum of
squares differs. A row is split over blocks of one 2 KB tile each: each block hands its chunk
to every peer through the PeerWorkspace (jspec.pallas_kernels.peer_exchange, in a region of its
own), waits for every chunk of its row from every peer, sums the whole row (the norm needs its
sum of squares), and writes its own chunk of h and of norm(h).

Shape letters: M rows (tokens of the step), D the hidden size, A the devices on the axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.pallas_kernels import lamport_exchange as lamport, peer_exchange
from jspec.pallas_kernels import workspace_all_reduce as wsar


# Load the residual's chunks and the scale before the exchange, so that their reads overlap
# the wait for the peers' parts instead of following it (two memory round trips off each
# call's critical path). The same results; measured on H200s (Qwen3-8B, tp = 2): 3.327 ->
# 3.267 ms a step at batch 1, 3.398 -> 3.350 at batch 8 (BENCHMARKS.md, 2026-11-29).
PREFETCH = True


def fits(shape, dtype) -> bool:
  """Rows [M, D] the kernel takes: float16 / bfloat16 / float32, at most wsar.NORM_ROWS rows
  of at most wsar.NORM_ROW_BYTES, each a whole number of the warpgroup's 16-byte vectors."""
  dtype = jnp.dtype(dtype)
  if len(shape) != 2 or dtype not in wsar.FLOAT_DTYPES:
    return False
  rows, width = shape
  return (0 < rows <= wsar.NORM_ROWS and 0 < width * dtype.itemsize <= wsar.NORM_ROW_BYTES
          and width * dtype.itemsize % wsar.TILE_BYTES == 0)


def workspace_add_norm(partial_MD, residual_MD, scale_D, row, axis_size: int, *, eps: float,
                       zero_centered: bool = False, protocol: str | None = None):
  """(h, norm(h)) for h = residual + the sum of `partial` over the group (see the module
  docstring), inside a shard_map that hands each device its own `row` of a PeerWorkspace's
  table. Every device's results hold the same bits. `protocol`: the handover
  (wsar.PROTOCOLS; None: wsar.DEFAULT_PROTOCOL). Hopper GPUs only.

  `partial` may also be a product's float32 K-slice partials [S, R, D] (R >= M rows, of which
  the first M are the residual's): each device sums its S slices in float32 and rounds the sum
  to the residual's dtype, as XLA's split-K sum after a product does, before the exchange."""
  rows, width = residual_MD.shape
  slices = None
  if partial_MD.ndim == 3:
    slices, part_rows, part_width = partial_MD.shape
    if (partial_MD.dtype != jnp.float32 or part_rows < rows or part_width != width
        or slices < 1):
      raise ValueError(f"K-slice partials must be float32 [S, R, D] with R >= the residual's "
                       f"{rows} rows and D = {width}; got {partial_MD.shape} {partial_MD.dtype}")
  elif residual_MD.shape != partial_MD.shape or residual_MD.dtype != partial_MD.dtype:
    raise ValueError(f"the residual must match the partial sums {partial_MD.shape} "
                     f"{partial_MD.dtype}; got {residual_MD.shape} {residual_MD.dtype}")
  protocol = wsar.protocol_for(residual_MD.dtype, protocol)
  if not fits(residual_MD.shape, residual_MD.dtype):
    raise ValueError(f"workspace_add_norm takes float16 / bfloat16 / float32 rows [M, D], M <= "
                     f"{wsar.NORM_ROWS}, D a multiple of {wsar.TILE_BYTES} bytes up to "
                     f"{wsar.NORM_ROW_BYTES}; got {residual_MD.shape} {residual_MD.dtype}")
  if scale_D.shape != (width,) or scale_D.dtype != residual_MD.dtype:
    raise ValueError(f"scale: expected [{width}] {residual_MD.dtype}, got "
                     f"{scale_D.shape} {scale_D.dtype}")
  row = row.reshape(-1)
  if row.shape != (2 * axis_size + 1,) or row.dtype != jnp.int32:
    raise ValueError(f"row: expected {2 * axis_size + 1} int32 words, got {row.shape} {row.dtype}")
  slicing = (slices, partial_MD.shape[1]) if slices else None
  kernel = _build(rows, width, jnp.dtype(residual_MD.dtype), axis_size, float(eps),
                  bool(zero_centered), protocol, PREFETCH, slicing)
  h, normed = kernel(partial_MD.reshape(-1), residual_MD.reshape(-1), scale_D, row)
  return h.reshape(rows, width), normed.reshape(rows, width)


@functools.cache
def _build(rows: int, width: int, dtype, axis_size: int, eps: float, zero_centered: bool,
           protocol: str = "flags", prefetch: bool = False, slicing=None):
  """slicing: (S, R) where the partial is float32 K-slice partials [S, R, D], else None."""
  # Mosaic GPU's own modules: imported here, so that jspec imports without a GPU build.
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, gpu
  import jax.experimental.mosaic.gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mu

  vec = 16 // dtype.itemsize
  region = wsar.norm_region(axis_size)
  # A row is split over `chunks` blocks of one 2 KB tile each: more of the row crosses NVLink
  # at once than from one block (a 4096-wide bf16 row from one block took 8-9 µs a call).
  chunks = width * dtype.itemsize // wsar.TILE_BYTES
  chunk = width // chunks

  def body(ctx, x_ref, residual_ref, scale_ref, row_ref, h_ref, out_ref, scratch):
    del ctx
    f32 = ir.F32Type.get()
    ir_dtype = mu.dtype_to_ir_type(dtype)
    index = ir.IndexType.get()
    block = gpu.block_id(gpu.Dimension.x)
    row = arith.divui(block, arith.constant(index, chunks))
    mine_c = arith.remui(block, arith.constant(index, chunks))
    row_start = arith.muli(row, arith.constant(index, width))
    own_start = arith.addi(row_start, arith.muli(mine_c, arith.constant(index, chunk)))
    load = lambda ref, start: mgpu.FragmentedArray.load_strided(
        mu.memref_slice(ref, mu.ds(start, chunk)), vec_size=vec)
    if slicing is None:
      mine = load(x_ref, own_start)
    else:  # the K slices' float32 partials, summed in float32 and rounded once
      slices, part_rows = slicing
      total = None
      for s in range(slices):
        start = arith.addi(own_start, arith.constant(index, s * part_rows * width))
        part = mgpu.FragmentedArray.load_strided(
            mu.memref_slice(x_ref, mu.ds(start, chunk)), vec_size=vec)
        total = part if total is None else total + part
      mine = total.astype(ir_dtype)
    chunk_start = lambda c: arith.addi(row_start, arith.constant(index, c * chunk))
    scale_at = lambda: load(scale_ref, arith.muli(mine_c, arith.constant(index, chunk)))
    if prefetch:  # read while the parts travel
      residuals = [load(residual_ref, chunk_start(c)) for c in range(chunks)]
      own_residual, early_scale = load(residual_ref, own_start), scale_at()
    else:  # read when they are used
      residuals = [functools.partial(load, residual_ref, chunk_start(c)) for c in range(chunks)]
      own_residual = functools.partial(load, residual_ref, own_start)
    if protocol == "lamport":
      first_slot = lamport.first_row_slot(wsar.NORM_ROWS, chunks, row)
      parts, done = lamport.exchange(
          row_ref, axis_size, wsar.lamport_norm_region(axis_size),
          arith.addi(first_slot, mine_c), mine, first_slot=first_slot, chunks=chunks)
    else:
      first_slot = arith.muli(row, arith.constant(index, wsar.NORM_ROW_SLOTS))
      parts, done = peer_exchange.exchange(
          row_ref, axis_size, region, arith.addi(first_slot, mine_c), mine,
          first_slot=first_slot, chunks=chunks)

    def h_of(chunk_parts, residual):
      total = chunk_parts[0].astype(f32)
      for part in chunk_parts[1:]:
        total = total + part.astype(f32)
      # The sum rounded as the all-reduce returns it, then the residual add rounded once.
      delta = total.astype(mine.mlir_dtype).astype(f32)
      residual = residual if prefetch else residual()
      return (residual.astype(f32) + delta).astype(mine.mlir_dtype)

    # The whole row's sum of squares: every block of the row sums every chunk.
    squares = None
    for c in range(chunks):
      h32 = h_of(parts(c), residuals[c]).astype(f32)
      squares = h32 * h32 if squares is None else squares + h32 * h32
    total_squares = squares.reduce("add", 0, scratch)
    inv_rms = (total_squares * (1.0 / width) + eps).rsqrt().broadcast((chunk,))
    # This block's own chunk, written out.
    h = h_of(parts(), own_residual)
    h.store_untiled(mu.memref_slice(h_ref, mu.ds(own_start, chunk)))
    normed = h.astype(f32) * inv_rms
    scale = (early_scale if prefetch else scale_at()).astype(f32)
    if zero_centered:  # (1 + w) in float32, one cast (ZeroCenteredRMSNorm)
      out = normed * (scale + 1.0)
    else:  # cast, then the scale (RMSNorm)
      out = scale * normed.astype(mine.mlir_dtype).astype(f32)
    out.astype(mine.mlir_dtype).store_untiled(mu.memref_slice(out_ref, mu.ds(own_start, chunk)))
    done()

  n = rows * width
  flat = jax.ShapeDtypeStruct((n,), dtype)
  parts = flat if slicing is None else jax.ShapeDtypeStruct(
      (slicing[0] * slicing[1] * width,), jnp.float32)
  return peer_exchange.as_kernel(
      body, "workspace_add_norm", rows * chunks,
      (parts, flat, jax.ShapeDtypeStruct((width,), dtype),
       jax.ShapeDtypeStruct((2 * axis_size + 1,), jnp.int32)),
      (flat, flat), scratch=jax.ShapeDtypeStruct((4 * 128,), jnp.float32))
