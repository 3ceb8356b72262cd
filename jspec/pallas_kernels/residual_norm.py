"""The residual add and the RMSNorm after it, for the few rows of a decode or verify step, in one
Pallas (Triton) kernel.

Why: in a batch-1 decode step a row is a few thousand elements, and XLA runs a norm as two
kernels (the sum of squares, then the scaling) and the residual add before it as a third; a
kernel on an H200 costs 1.1-2.3 µs however little it does (BENCHMARKS.md, "FP8 and MLA decode
on an H200 against their targets; ..."). Here:

  rms_norm   the residual add (optional) and the RMSNorm after it: (h, norm(h)).
             `quantize`: norm(h) in e4m3 too, as add_partials_rms_norm's below (a MoE
             layer's output before the next layer's q / k / v; a first layer's input).

It rounds where jspec.models.norms' modules round (the sum in bfloat16, normalising in float32,
the cast, the scale), so it stands in for them; only the order of the float32 sums differs.
One program per row (a program per piece of a row where it quantizes): the steps that call it
have at most a few hundred rows.
  add_partials_rms_norm  the same with the residual's delta given as an FP8 product's K-slice
             partials, rows first (fp8_gemm.fp8_partials_many), summed as they are read: the
             product's sum is then no kernel of its own (o_proj, down_proj). A first form read
             the rows-last partials, one float of every 32-byte sector, and was slower
             (BENCHMARKS.md, "Workspace kernels without flags (Lamport) ...").
             `quantize`: norm(h) in e4m3 too, with its scales in the FP8 kernel's lanes, for
             the FP8 products that read it next (jspec.models.linear.E4m3Rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3
from jspec.pallas_kernels.fp8_gemm import MAX_ROWS, act_lanes_size
from jspec.pallas_kernels.quantize_rows import e4m3_groups

MAX_CHUNK = 4096  # the widest piece of a row one load takes (Triton blocks are powers of two)
MIN_CHUNK = 64
# Pieces (programs) a row of rms_norm's quantize form is cut into, where its width allows:
# each program reads the whole row for its sum of squares and quantizes and stores its piece
# (as add_partials_rms_norm's pieces, whose partials bound them).
QUANTIZE_PIECES = 4
# Warps of add_partials_rms_norm's program (0: as rms_norm's): one program reads all of a row's
# K-slice partials, S x 16 KB at 4096 wide.
PARTIALS_WARPS = 0


def row_chunk(width: int) -> int:
  """The largest power of two that divides `width`, at most MAX_CHUNK: rows are read in
  pieces of this many (7168 = 7 x 1024; Triton cannot load a block of 7168)."""
  return min(width & -width, MAX_CHUNK)


def scaled_norm(h, scale, inv_rms, zero_centered: bool):
  """One piece of norm(h) in h's dtype from h, the scale's piece and the row's 1 / rms, as
  RMSNorm (cast, then the scale in the parameter's dtype) or ZeroCenteredRMSNorm ((1 + w) in
  float32, one cast) computes it, in the kernels that hold h in its dtype (this module's, the
  norm + router kernel's)."""
  normed = h.astype(jnp.float32) * inv_rms
  scale = scale.astype(jnp.float32)
  if zero_centered:
    return (normed * (1.0 + scale)).astype(h.dtype)
  return (scale * normed.astype(h.dtype).astype(jnp.float32)).astype(h.dtype)


def fits_kernel(width: int) -> bool:
  """Whether a row of `width` is read in pieces of at least MIN_CHUNK elements."""
  return width > 0 and row_chunk(width) >= MIN_CHUNK


def _norm_kernel(*refs, eps: float, chunk: int, zero_centered: bool, has_residual: bool,
                 delta_dtype=None, row_scaled: bool = False, quantize: bool = False,
                 sum_chunk: int = 0, interpret: bool = False):
  """Program m: row m, read once and held in registers (7168 bfloat16 values are 28 a thread
  at 8 warps) between the sum of its squares and its scaling. All loads come before any store,
  which they could alias: a 7168-wide row's 7 pieces were read one after another (BENCHMARKS.md,
  "Norm kernels' loads before their stores").

  delta_dtype set: the delta is K-slice partials [S, R, D] float32, each value their sum over
  S in order (times row m's scale where row_scaled) cast to delta_dtype, as fp8_gemm's
  fp8_matmul gives the product.

  The row's sum of squares is taken over pieces of `sum_chunk` (0: `chunk`), the plain form's,
  so that every form of a norm gives the same float32 sum and so the same norm(h).

  quantize: norm(h) also in e4m3 with its scales, as fp8_gemm.quantize_activations quantizes
  it, each 128-column group of a piece scaled by its own largest |value| (so a piece holds
  whole groups), the scales written in the FP8 kernel's lanes ([K/128, L]: fp8_gemm.act_lanes;
  program m writes the lanes m, m + M, ..., its own row's scale in lane m and 0 in the others,
  so that the padded lanes past M are written too). Program (m, c) then writes piece c (of
  `chunk` columns) of row m alone, each program reading the whole row for its sum of squares
  (the same sum in the same order in each): the pieces' scaling, quantizing and stores run side
  by side rather than one after another."""
  row_scale_ref = None
  if has_residual:
    x_ref, delta_ref, *refs = refs
    if row_scaled:
      row_scale_ref, *refs = refs
    scale_ref, h_ref, out_ref, *quantized = refs
  else:
    x_ref, scale_ref, out_ref, *quantized = refs
  m = pl.program_id(0)
  width = x_ref.shape[1]
  sum_chunk = sum_chunk or chunk
  sum_pieces = [pl.ds(c * sum_chunk, sum_chunk) for c in range(width // sum_chunk)]
  # The pieces this program writes: its own where it quantizes, else the row's.
  own = ([pl.ds(pl.multiple_of(pl.program_id(1) * chunk, chunk), chunk)] if quantize
         else sum_pieces)
  row_scale = row_scale_ref[m] if row_scaled else None

  def load_delta(cols):
    if not has_residual:
      return None
    if delta_dtype is None:
      return delta_ref[m, cols]
    return [delta_ref[s, m, cols] for s in range(delta_ref.shape[0])]

  def summed(parts):
    total = parts[0]
    for part in parts[1:]:
      total = total + part
    if row_scaled:
      total = total * row_scale
    return total.astype(delta_dtype)

  def added(x, delta):  # x + delta rounded to the stream's dtype, as XLA's add does
    if not has_residual:
      return x
    if delta_dtype is not None:
      delta = summed(delta)
    return (x.astype(jnp.float32) + delta.astype(jnp.float32)).astype(x.dtype)

  loaded = [(x_ref[m, cols], load_delta(cols)) for cols in sum_pieces]
  own_loaded = loaded if own is sum_pieces else [(x_ref[m, cols], load_delta(cols))
                                                 for cols in own]
  scales = [scale_ref[cols] for cols in own]
  summed_rows = [added(x, delta) for x, delta in loaded]
  own_rows = summed_rows if own is sum_pieces else [added(x, d) for x, d in own_loaded]
  squares = jnp.float32(0.0)
  for h in summed_rows:
    h32 = h.astype(jnp.float32)
    squares += jnp.sum(h32 * h32)
  inv_rms = jax.lax.rsqrt(squares / width + eps)
  for cols, h, scale in zip(own, own_rows, scales):
    if has_residual:
      h_ref[m, cols] = h
    normed = scaled_norm(h, scale, inv_rms, zero_centered)
    out_ref[m, cols] = normed
    if quantize:
      store_e4m3(normed, cols, m, *quantized, interpret=interpret)


def store_e4m3(normed, cols, m, x8_ref, lanes_ref, *, interpret: bool):
  """One piece of row m in e4m3 into x8_ref [M, D] and its groups' scales into lanes_ref
  [D/128, L] (_norm_kernel's `quantize`), rounded as XLA rounds quantize_activations
  (jspec.pallas_kernels.quantize_rows says how)."""
  x8, scale = e4m3_groups(normed.astype(jnp.float32).reshape(cols.size // BLOCK, BLOCK),
                          interpret)
  x8_ref[m, cols] = x8.reshape(cols.size)
  store_scale_lanes(lanes_ref, pl.ds(cols.start // BLOCK, cols.size // BLOCK), scale, m,
                    x8_ref.shape[0])


def store_scale_lanes(lanes_ref, groups, scale_G, m, num_rows: int, real_G=None):
  """Row m's scales of `groups` (a pl.ds of lanes_ref [K/128, L]'s groups) at lane m, and zeros
  at the lanes past the `num_rows` rows that are m modulo them, so that the rows' programs
  together write every lane (fp8_gemm.act_lanes' layout). `groups` and `m` may also be int
  arrays [G], scale g at group groups[g] of row m[g] (a verify window's heads, each of its own
  token). real_G: a mask of the groups to write (None: all)."""
  lanes = lanes_ref.shape[1]
  if isinstance(groups, pl.Slice):
    lane = jax.lax.broadcasted_iota(jnp.int32, (scale_G.shape[0], lanes), 1)
    mask = lane % num_rows == m
    pltriton.store(lanes_ref.at[groups, pl.ds(0, lanes)],
                   jnp.where(lane == m, scale_G[:, None], 0.0),
                   mask=mask if real_G is None else real_G[:, None] & mask)
    return
  # Each entry indexes its own lanes only, m, m + num_rows, ..., and a masked one lies past the
  # ref: interpret mode's scatter writes every index it is given (masked ones with the values
  # they held), and two entries at one index would race.
  per_row = 1 << (-(-lanes // num_rows) - 1).bit_length()  # Triton's blocks: powers of two
  lane = m[:, None] + num_rows * jax.lax.broadcasted_iota(
      jnp.int32, (scale_G.shape[0], per_row), 1)
  mask = lane < lanes if real_G is None else real_G[:, None] & (lane < lanes)
  pltriton.store(lanes_ref.at[jnp.where(mask, groups[:, None], lanes_ref.shape[0]), lane],
                 jnp.where(lane == m[:, None], scale_G[:, None], 0.0), mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "zero_centered", "interpret", "quantize"))
def rms_norm(x_MD: jax.Array, scale_D: jax.Array, residual_MD: jax.Array | None = None, *,
             eps: float, zero_centered: bool = False, interpret: bool | None = None,
             quantize: bool = False):
  """RMSNorm of the rows of x [M, D] by scale [D] (jspec.models.norms.RMSNorm, or
  ZeroCenteredRMSNorm's (1 + w) with `zero_centered`), in x's dtype. With `residual_MD`, the
  rows normalised are h = x + residual: returns (h, norm(h)). `interpret` None: interpret off
  GPU. quantize: norm(h)'s e4m3 form and its lanes follow (add_partials_rms_norm's), in
  QUANTIZE_PIECES pieces a row, each its own program."""
  rows, width = x_MD.shape
  if scale_D.shape != (width,) or (residual_MD is not None and residual_MD.shape != x_MD.shape):
    raise ValueError(f"rms_norm takes x [M, D], scale [D] and a residual like x, got "
                     f"{x_MD.shape}, {scale_D.shape}, "
                     f"{None if residual_MD is None else residual_MD.shape}")
  has_residual = residual_MD is not None
  inputs = (x_MD, residual_MD, scale_D) if has_residual else (x_MD, scale_D)
  chunk = sum_chunk = row_chunk(width)
  if quantize:  # whole 128-groups (refused below where there are none), QUANTIZE_PIECES of them
    chunk = max(BLOCK, min(chunk, _floor_pow2(width // QUANTIZE_PIECES)))
  return _norm_call("add_rms_norm" if has_residual else "rms_norm", inputs, x_MD.dtype,
                    interpret, chunk, eps=eps, zero_centered=zero_centered,
                    has_residual=has_residual, quantize=quantize, sum_chunk=sum_chunk)


@functools.partial(jax.jit,
                   static_argnames=("dtype", "eps", "zero_centered", "interpret", "quantize"))
def add_partials_rms_norm(x_MD: jax.Array, parts_SRD: jax.Array, scale_D: jax.Array,
                          row_scale_M: jax.Array | None = None, *, dtype, eps: float,
                          zero_centered: bool = False, interpret: bool | None = None,
                          quantize: bool = False):
  """rms_norm(x, scale, residual) with the residual given as one FP8 call's K-slice partials,
  rows first (fp8_gemm.fp8_partials_many(rows_first=True): [S, R, D] float32, R >= M): each
  value the sum of its S partials times its row's scale (where given) cast to `dtype`, as
  fp8_matmul gives o_proj's or down_proj's output: (h, norm(h)) for h = x + that product.

  quantize (M <= 64 rows, D in whole 128-blocks): (h, norm(h), its e4m3 form [M, D], the
  form's scales [D/128 x L] as fp8_gemm.act_lanes lays them out), for the next FP8 product to
  take as they are (fp8_gemm.fp8_partials_many's act_lanes_X): the activations quantized where
  they are made, with no pass of their own."""
  rows, width = x_MD.shape
  splits, padded, parts_width = parts_SRD.shape
  if (parts_SRD.dtype != jnp.float32 or parts_width != width or padded < rows
      or scale_D.shape != (width,)
      or (row_scale_M is not None and row_scale_M.shape != (rows,))):
    raise ValueError(f"add_partials_rms_norm takes x [M, D], float32 partials [S, R >= M, D], "
                     f"scale [D] and row scales [M] or None, got {x_MD.shape}, "
                     f"{parts_SRD.shape} {parts_SRD.dtype}, {scale_D.shape}, "
                     f"{None if row_scale_M is None else row_scale_M.shape}")
  # A piece holds all S partials of its columns: at most MAX_CHUNK values in registers (and
  # whole 128-groups where it quantizes).
  sum_chunk = max(MIN_CHUNK, min(row_chunk(width), _floor_pow2(MAX_CHUNK // splits)))
  chunk = max(BLOCK, sum_chunk) if quantize else sum_chunk
  row_scales = () if row_scale_M is None else (row_scale_M.astype(jnp.float32),)
  return _norm_call("add_partials_rms_norm", (x_MD, parts_SRD, *row_scales, scale_D),
                    x_MD.dtype, interpret, chunk, warps=PARTIALS_WARPS, eps=eps,
                    zero_centered=zero_centered, has_residual=True,
                    delta_dtype=jnp.dtype(dtype), row_scaled=row_scale_M is not None,
                    quantize=quantize, sum_chunk=sum_chunk)


def _floor_pow2(n: int) -> int:
  return 1 << (max(n, 1).bit_length() - 1)


def _norm_call(name: str, inputs, dtype, interpret, chunk: int, warps: int = 0, **form):
  """The pallas_call of _norm_kernel (its `form`) over `inputs`, a program per row of x (the
  first), after the width check both forms share."""
  rows, width = inputs[0].shape
  if not fits_kernel(width):
    raise ValueError(f"{name} reads rows in power-of-two pieces of >= {MIN_CHUNK}; "
                     f"D={width} has none")
  if interpret is None:
    interpret = not platform.on_gpu()
  row = jax.ShapeDtypeStruct((rows, width), dtype)
  out_shape = (row, row) if form["has_residual"] else (row,)
  if form.get("quantize"):
    if rows > MAX_ROWS or width % BLOCK or chunk % BLOCK:
      raise ValueError(f"{name} quantizes up to {MAX_ROWS} rows in whole {BLOCK}-groups, got "
                       f"{rows} rows of {width} in pieces of {chunk}")
    lanes = act_lanes_size(rows, width) // (width // BLOCK)
    out_shape += (jax.ShapeDtypeStruct((rows, width), E4M3),
                  jax.ShapeDtypeStruct((width // BLOCK, lanes), jnp.float32))
  # Quantizing, a row's pieces are written by programs of their own: in one program a row,
  # the quantize form took 1.4 µs a call longer than the plain one (Qwen3-8B's 4096-wide rows,
  # 4 pieces), so, 0.4; the plain forms measured no faster so (BENCHMARKS.md, "e4m3
  # activations for the FP8 few-row products ...").
  quantize = bool(form.get("quantize"))
  out = pl.pallas_call(
      functools.partial(_norm_kernel, chunk=chunk, interpret=interpret, **form),
      out_shape=out_shape, grid=(rows, width // chunk) if quantize else (rows,),
      compiler_params=pltriton.CompilerParams(
          num_warps=warps or (8 if width >= 4096 else 4), num_stages=1),
      interpret=interpret, name=name + ("_e4m3" if quantize else ""),
  )(*inputs)
  if quantize:
    *out, lanes_2d = out
    return (*out, lanes_2d.reshape(-1))
  return out if form["has_residual"] else out[0]
