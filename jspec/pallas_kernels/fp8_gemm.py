"""A few rows against a block-scaled FP8 weight: y[M, N] = x[M, K] @ (w8[N, K] * scale).T,
M <= 64, on Hopper (Pallas Mosaic GPU).

The layout is the one FP8 checkpoints are published in (DeepSeek-V3 / R1, Qwen FP8 releases),
kept as it is: float8_e4m3fn weights [out, in] with one float32 scale per 128 x 128 block
(`weight_scale_inv` [out / 128, in / 128], which, despite its name, multiplies). Decode and
verify steps read every weight once per step, so a product that reads the e4m3 bytes reads half
of what bf16 weights cost.

Why a kernel: XLA does not keep the FP8 bytes on the wire for a few rows (measured on an H200,
benchmarks/fp8_matmul.py): a dot over `bf16(w8) * scale` writes the dequantized weight first
(2-3x the bf16 product), the FP8 tensor-core dot is slower than bf16 below ~512 rows, and a
product per 128-row block of K reaches at best the bf16 time. A first kernel in Pallas Triton
(e4m3 widened to bf16 for the dot) read the bytes at only 1.0-1.6 TB/s.

How: jspec.pallas_kernels.fp8_block_kernel (the kernel and its numerics), fp8_layout (its
K slices or balanced runs over the SMs); here the choice of activation route and tiling, and
the XLA work around the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.pallas_kernels import decode_gemm, decode_routing, fp8_layout, platform
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3, Fp8Tiling, partials
from jspec.pallas_kernels.shared import float16_rows

MAX_ROWS = 64      # float32 sums of a 128-column item in registers
E4M3_MAX = 448.0
INVERSE_E4M3_MAX = float(np.float32(1.0 / E4M3_MAX))
ACTIVATIONS = ("bfloat16", "float16", "e4m3")
# A block's scale travels repeated over this many float32 lanes: one 128-byte TMA block.
SCALE_LANES = 32
# The activation route of calls that name none (None: bfloat16 x as it is, float16 for other
# x); "e4m3" quantizes x per row and 128 columns first, the checkpoints' "dynamic" scheme.
DEFAULT_ACTIVATIONS: str | None = None
# Steps of several rows lay the K-slice partials that XLA sums out rows first ([S, R, N]): rows
# last, the sum's [N, M] needs a transpose into [M, N], a kernel of its own after the SwiGLU
# fusion (1.9 µs a layer at Qwen3-8B's 8 rows); the Qwen3-8B FP8 step at batch 8 -1.2%
# (BENCHMARKS.md, "o_proj's FP8 product on e4m3 rows written by the decode step's attention
# kernel …"). One row keeps them rows last, where [N, 1] is [1, N] already: rows first there
# measured no faster (a MoE o_proj's sum 1.25 against 1.15 µs). The same sums either way.
ROWS_FIRST_SUMS = True


# Pipeline stages of two-block steps (up to 16 rows). Timed kernel by kernel under the profiler
# on an H200 at Qwen3-8B's four shapes, 1 and 8 rows (BENCHMARKS.md, "The FP8 product kernel's
# own time ..."): 3 stages 1.5-5.4% faster than 4 at every shape, 5 and 2 slower than 4.
TWO_BLOCK_STAGES = 3
# Two blocks a step up to this many rows. Measured before each tile was widened right before its
# own product (fewer registers live): verify windows of 4 tokens at batch 8 (32 rows) take one.
TWO_BLOCK_MAX_ROWS = 16


def default_tiling(rows: int) -> Fp8Tiling:
  """Measured on an H200 (BENCHMARKS.md, "FP8 block-scaled products"): two blocks a step up to
  16 rows; from there the widened tiles of two blocks crowd the registers, one is faster."""
  if rows <= TWO_BLOCK_MAX_ROWS:
    return Fp8Tiling(blocks_per_step=2, num_stages=TWO_BLOCK_STAGES)
  return Fp8Tiling(blocks_per_step=1, num_stages=4)


def fits_kernel(rows: int, k: int, n: int, block: tuple[int, int]) -> bool:
  return rows <= MAX_ROWS and tuple(block) == (BLOCK, BLOCK) and k % BLOCK == 0 \
      and n % BLOCK == 0


def bfloat16_rows(x_MK):
  """x as the bfloat16 route hands it to the kernel, with no pass over it where it is bfloat16
  already (_tma_rows)."""
  return _tma_rows(x_MK.astype(jnp.bfloat16))


def _tma_rows(x_MK):
  """x as the kernel reads it: up to 8 rows the TMA fills a tile's missing rows itself (their
  outputs are dropped); past 8 it reads x in tiles of 8 rows, so a partial last tile is padded
  (as decode_gemm's x)."""
  m = x_MK.shape[0]
  if m > decode_gemm.ROW_TILE and m % decode_gemm.ROW_TILE:
    return jnp.pad(x_MK, ((0, -m % decode_gemm.ROW_TILE), (0, 0)))
  return x_MK


def scale_lanes(scale, lanes: int = SCALE_LANES):
  """A block scale (any shape, its last axis the input blocks) with each value repeated over
  `lanes` lanes along that axis: the form the kernel reads for steps of up to that many padded
  rows. Made once before a loop of steps, it keeps a repeat out of every step."""
  return jnp.repeat(scale.astype(jnp.float32), lanes, axis=-1)


def act_lanes(scale_MKb):
  """e4m3 rows' scales [M, K/128] as the kernel reads them: [K/128 x L] float32, L =
  max(padded rows, SCALE_LANES), row r's scale of 128-column group g at g x L + r, 0 past the
  rows (whose x rows are zeros). A kernel that writes x in e4m3 writes its scales so
  (residual_norm's `quantize` form)."""
  m, k_blocks = scale_MKb.shape
  lanes = act_lanes_size(m, k_blocks * BLOCK) // k_blocks
  return jnp.pad(scale_MKb.astype(jnp.float32), ((0, lanes - m), (0, 0))).T.reshape(-1)


def quantize_activations(x_MK):
  """(x8 [M, K] e4m3, scale [M, K/128] float32): each row's 128-wide groups scaled so that their
  largest |x| maps to e4m3's 448 (DeepSeek-V3's act_quant; the checkpoints' "dynamic"
  activation scheme). The prefill products take the same values, padded and laid out, from
  one kernel (jspec.pallas_kernels.quantize_rows)."""
  m, k = x_MK.shape
  groups = x_MK.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
  # amax / 448 as a product with 448's float32 reciprocal, written out: XLA's simplifier makes
  # that product of a division by a constant in some programs and not in others, and the
  # kernels that quantize (quantize_rows, residual_norm) compute this very product.
  scale = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1), 1e-12) * INVERSE_E4M3_MAX
  x8 = (groups / scale[..., None]).astype(E4M3).reshape(m, k)
  return x8, scale


def check_operands(name: str, x_MK, w8_NK, scale_NbKb) -> tuple[int, int, int]:
  """(M, K, N) of a product's operands, or a ValueError naming what `name` takes."""
  m, k = x_MK.shape
  n, k_w = w8_NK.shape
  if k != k_w or w8_NK.dtype != E4M3 or scale_NbKb.shape != (n // BLOCK, k // BLOCK):
    raise ValueError(f"{name} takes x [M, K], w8 [N, K] float8_e4m3fn and scales "
                     f"[N/{BLOCK}, K/{BLOCK}], got {x_MK.shape}, {w8_NK.shape} {w8_NK.dtype}, "
                     f"{scale_NbKb.shape}")
  return m, k, n


@functools.partial(jax.jit,
                   static_argnames=("splits", "tiling", "activations", "sum_apart", "out_dtype"))
def fp8_matmul(x_MK: jax.Array, w8_NK: jax.Array, scale_NbKb: jax.Array,
               splits: int | None = None, tiling: Fp8Tiling | None = None,
               activations: str | None = None, lanes_NbX: jax.Array | None = None,
               sum_apart: bool = True, act_lanes_X: jax.Array | None = None,
               out_dtype=None) -> jax.Array:
  """x @ (w8 * scale broadcast over its 128 x 128 blocks).T, in x's dtype.

  lanes_NbX: scale_lanes(scale) made beforehand, used where the step's padded rows fit
  SCALE_LANES (else the scales are repeated here, over more lanes).

  activations: "bfloat16" (x as it is, the weight tiles widened to bfloat16 in registers: no
  pass over x before the kernel; the default for bfloat16 x), "float16" (each row scaled by a
  power of two into float16's range, which needs the row's largest |x| first; the default for
  other x, whose 11 bits it keeps), or "e4m3" (x quantized per row and 128-K group first,
  quantize_activations). The first two multiply exactly what x holds.

  sum_apart: the sum of the K slices' partials as a kernel of its own (the default: right
  where the consumer reduces over the output row, as the norm after o_proj and down does);
  False lets XLA fuse the sum into an elementwise consumer (SwiGLU after gate / up), one
  kernel fewer. The value is the same either way.

  act_lanes_X: x given in e4m3 with its rows' scales (fp8_partials_many's); the output is
  then in `out_dtype` (the model's), which other x need not name."""
  (out,) = _products("fp8_matmul", x_MK, (w8_NK,), (scale_NbKb,), (lanes_NbX,), splits,
                     tiling, activations, sum_apart, act_lanes_X, out_dtype)
  return out


@functools.partial(jax.jit,
                   static_argnames=("splits", "tiling", "activations", "sum_apart"))
def fp8_matmul_many(x_MK: jax.Array, w8s_NK: tuple, scales_NbKb: tuple,
                    lanes_NbX: tuple | None = None, splits: int | None = None,
                    tiling: Fp8Tiling | None = None, activations: str | None = None,
                    sum_apart: bool = True) -> tuple:
  """fp8_matmul of one x with each of several weights of the same K (q, k and v), in one
  kernel call (fp8_block_kernel.partials says why): a tuple of [M, N_i] in x's dtype, equal to
  the separate products at the same K slices. lanes_NbX and sum_apart: as fp8_matmul's,
  lanes one per weight (or None)."""
  if not w8s_NK or len(w8s_NK) != len(scales_NbKb):
    raise ValueError(f"fp8_matmul_many takes as many scales as weights (at least one), got "
                     f"{len(w8s_NK)} weights and {len(scales_NbKb)} scales")
  lanes_NbX = lanes_NbX or (None,) * len(w8s_NK)
  if len(lanes_NbX) != len(w8s_NK):
    raise ValueError(f"lanes_NbX has {len(lanes_NbX)} entries for {len(w8s_NK)} weights")
  return _products("fp8_matmul_many", x_MK, tuple(w8s_NK), tuple(scales_NbKb),
                   tuple(lanes_NbX), splits, tiling, activations, sum_apart)


def _products(name, x_MK, w8s_NK, scales_NbKb, lanes_NbX, splits, tiling, activations,
              sum_apart, act_lanes_X=None, out_dtype=None):
  if x_MK.dtype == E4M3 and out_dtype is None:
    raise ValueError(f"{name} of e4m3 x names its out_dtype")
  m = x_MK.shape[0]
  rows_first = ROWS_FIRST_SUMS and m > 1
  parts, row_scale_M = _partials(name, x_MK, w8s_NK, scales_NbKb, lanes_NbX, splits, tiling,
                                 activations, rows_first, act_lanes_X=act_lanes_X)
  ns = [w.shape[0] for w in w8s_NK]
  bounds = np.cumsum([0] + ns)
  if rows_first:
    out_MN = jnp.sum(parts[:, :m], axis=0)
  else:
    out_MN = jnp.sum(parts[:, :, :m], axis=0).T
  if row_scale_M is not None:
    out_MN = out_MN * row_scale_M[:, None]
  out_MN = out_MN.astype(out_dtype or x_MK.dtype)
  if parts.shape[0] > 1 and sum_apart:
    # The sum of the K-slice partials stays out of the consumer's fusion. Where the consumer
    # reduces over the output row (the residual add and RMSnorm after o_proj or down), XLA
    # fuses the sum into it, and at a few rows that reduction runs in one thread block that
    # loads each output's partials one after another: 9.7 µs a layer for Qwen3-30B-A3B's
    # o_proj (8 slices, one row) on an H100, where the sum alone is a small parallel kernel
    # (BENCHMARKS.md, "FP8 experts at decode sizes: …").
    out_MN = jax.lax.optimization_barrier(out_MN)
  return tuple(out_MN[:, start:stop] for start, stop in zip(bounds[:-1], bounds[1:]))


@functools.partial(jax.jit, static_argnames=("splits", "tiling", "activations", "rows_first"))
def fp8_partials_many(x_MK: jax.Array, w8s_NK: tuple, scales_NbKb: tuple,
                      lanes_NbX: tuple | None = None, splits: int | None = None,
                      tiling: Fp8Tiling | None = None, activations: str | None = None,
                      rows_first: bool = False, act_lanes_X: jax.Array | None = None):
  """fp8_matmul_many before its K-slice sum, for a consumer that sums the slices as it reads
  them (row_norms.qkv_partials_norm_rope): (partials [S, sum of N_i, R] float32, the weights'
  columns one after another and the rows padded to R, and each row's scale [M] float32 or
  None). The products are sum over S of partials[:, :, :M].T times the row scales, cast to
  x's dtype. rows_first: the partials as [S, R, sum of N_i] (fp8_block_kernel.partials', for
  a reader of whole rows: residual_norm.add_partials_rms_norm). act_lanes_X: x given as
  e4m3 already, quantized by the kernel that wrote it (residual_norm's `quantize` form), with
  its rows' scales in the kernel's lanes (act_lanes). Jitted as fp8_matmul is:
  every layer's call is then one lowering, and one compile of the Mosaic GPU kernel (each
  costs about 0.75 s)."""
  lanes_NbX = lanes_NbX or (None,) * len(w8s_NK)
  return _partials("fp8_partials_many", x_MK, tuple(w8s_NK), tuple(scales_NbKb),
                   tuple(lanes_NbX), splits, tiling, activations, rows_first, act_lanes_X)


def act_lanes_size(rows: int, k: int) -> int:
  """The length of act_lanes' scales of `rows` rows of K."""
  return k // BLOCK * max(decode_routing.padded_tokens(rows), SCALE_LANES)


def _partials(name, x_MK, w8s_NK, scales_NbKb, lanes_NbX, splits, tiling, activations,
              rows_first: bool = False, act_lanes_X=None):
  shapes = [check_operands(name, x_MK, w, s) for w, s in zip(w8s_NK, scales_NbKb)]
  m, k, _ = shapes[0]
  ns = [n for _, _, n in shapes]
  if not all(fits_kernel(m, k, n, (BLOCK, BLOCK)) for n in ns):
    raise ValueError(f"{name} takes M <= {MAX_ROWS} rows and K, N in multiples of "
                     f"{BLOCK}, got M={m}, K={k}, N={ns}")
  if (x_MK.dtype == E4M3) != (act_lanes_X is not None):
    raise ValueError(f"{name} takes e4m3 x with its act_lanes_X and other x without, got "
                     f"{x_MK.dtype} x and act_lanes_X {act_lanes_X is not None}")
  if act_lanes_X is not None:
    if activations not in (None, "e4m3"):
      raise ValueError(f"e4m3 x multiplies as e4m3, not {activations!r}")
    if act_lanes_X.shape != (act_lanes_size(m, k),) or act_lanes_X.dtype != jnp.float32:
      raise ValueError(f"act_lanes_X has shape {act_lanes_X.shape} {act_lanes_X.dtype}, not "
                       f"float32 ({act_lanes_size(m, k)},) for {m} rows of {k}")
    activations = "e4m3"
  if activations is None:  # bfloat16 x as it is; float32 x keeps float16's 11 bits
    activations = DEFAULT_ACTIVATIONS or (
        "bfloat16" if x_MK.dtype == jnp.bfloat16 else "float16")
  if activations not in ACTIVATIONS:
    raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
  # The weights' items share the SMs' rounds: the slices are chosen for all their columns.
  balanced = False
  if not splits:
    splits, balanced = fp8_layout.choose_layout(k, sum(ns), platform.num_sms(), rows=m)
    splits = 1 if balanced else splits  # a balanced item is the whole of K
  if k % (splits * BLOCK):
    raise ValueError(f"K={k} does not split into {splits} slices of whole {BLOCK}-blocks")
  tiling = tiling or default_tiling(m)
  per_step = tiling.blocks_per_step
  if k // splits % (per_step * BLOCK):
    tiling = dataclasses.replace(tiling, blocks_per_step=1)  # a slice of an odd block count
  rows = decode_routing.padded_tokens(m)
  lanes = max(rows, SCALE_LANES)
  scale_rows = []
  for n, scale, prepared in zip(ns, scales_NbKb, lanes_NbX):
    if prepared is not None and lanes == SCALE_LANES:
      if prepared.shape != (n // BLOCK, k // BLOCK * SCALE_LANES):
        raise ValueError(f"lanes_NbX has shape {prepared.shape}, not scale_lanes(scale)'s "
                         f"{(n // BLOCK, k // BLOCK * SCALE_LANES)}")
      scale_rows.append(prepared)
    else:
      scale_rows.append(scale_lanes(scale, lanes))
  act_scale_X = None
  if act_lanes_X is not None:  # quantized by the kernel that wrote x
    x_RK, act_scale_X, row_scale_M = _tma_rows(x_MK), act_lanes_X, None
  elif activations == "e4m3":
    x8_MK, act_scale_MKb = quantize_activations(x_MK)
    x_RK = jnp.pad(x8_MK, ((0, rows - m), (0, 0)))
    act_scale_X = act_lanes(act_scale_MKb)
    row_scale_M = None  # the rows' scales are in the kernel's lanes
  elif activations == "bfloat16":
    x_RK, row_scale_M = bfloat16_rows(x_MK), None
  else:
    x16_MK, row_scale_M = float16_rows(x_MK)
    x_RK = jnp.pad(x16_MK, ((0, rows - m), (0, 0)))
  return (partials(x_RK, w8s_NK, scale_rows, act_scale_X, splits, tiling, balanced, rows_first),
          row_scale_M)
