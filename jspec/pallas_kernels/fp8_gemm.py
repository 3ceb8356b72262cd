"""A few rows against a block-scaled FP8 weight: y[M, N] = x[M, K] @ (w8[K, N] * scale), M <= 64.

The layout is the one FP8 checkpoints are published in (DeepSeek-V3 / R1, Qwen FP8 releases):
float8_e4m3fn weights with one float32 scale per 128 x 128 block (`weight_scale_inv`, which,
despite its name, multiplies). Decode and verify steps read every weight once per step, so a
product that reads the e4m3 bytes reads half of what bf16 weights cost.

Why a kernel: XLA does not keep the FP8 bytes on the wire for a few rows (measured on an H200,
benchmarks/fp8_matmul.py): a dot over `bf16(w8) * scale` writes the dequantized weight first
(2-3x the bf16 product), the FP8 tensor-core dot is slower than bf16 below ~512 rows, and a
product per 128-row block of K reaches at best the bf16 time.

Status: correct (tests/test_fp8_gemm.py, interpret mode and H200) but not yet at its ceiling:
on an H200 it reads e4m3 at 1.0-1.6 TB/s, so it takes about the bf16 product's time (0.9-1.4x)
where the bytes say 0.5x (BENCHMARKS.md, "FP8 block-scaled products"). FP8 checkpoints'
projections use it in steps of up to 64 rows on a GPU (jspec.models.projections).

How: Pallas on Triton. Program (n, s) owns the 128 output columns n and the s-th of S slices
of K; it walks its slice a 128 x 128 block at a time: load the e4m3 block, widen it to bf16 in
registers, one tensor-core dot with the rows (padded to 16), and the float32 partial times the
block's scale into the accumulator, so the scale is applied where it is one number. S is chosen
so that S x N/128 programs fill the SMs; the S partials are summed in float32 outside.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform

BLOCK = 128        # the published weight_block_size, both axes
MAX_ROWS = 64
MIN_ROWS = 16      # the tensor cores' smallest M
E4M3 = jnp.float8_e4m3fn


def fits_kernel(rows: int, k: int, n: int, block: tuple[int, int]) -> bool:
  return rows <= MAX_ROWS and tuple(block) == (BLOCK, BLOCK) and k % BLOCK == 0 \
      and n % BLOCK == 0


def choose_splits(k: int, n: int, num_sms: int) -> int:
  """The most K slices (a power of two, whole blocks each) keeping every slice at least two
  blocks long, until the programs fill the SMs twice."""
  splits = 1
  col_blocks = n // BLOCK
  while (splits * col_blocks < 2 * num_sms and k % (2 * splits * BLOCK) == 0
         and k // (2 * splits) >= 2 * BLOCK):
    splits *= 2
  return splits


@dataclasses.dataclass(frozen=True)
class Fp8Tiling:
  """col_blocks: 128-column blocks a program owns (each its own dot and accumulator, so more
  loads are in flight); num_warps / num_stages: Triton's (stages: the loop's loads ahead)."""
  col_blocks: int = 1
  num_warps: int = 4
  num_stages: int = 3


def _kernel(x_ref, w_ref, scale_ref, out_ref, *, blocks: int, col_blocks: int):
  """Program (j, s): output columns from j * col_blocks * 128, K blocks s * blocks ..;
  whole-array refs indexed here (Triton loads power-of-two tiles; K / S need not be one)."""
  j, s = pl.program_id(0), pl.program_id(1)
  first_col = j * col_blocks
  columns = [pl.ds(pl.multiple_of((first_col + c) * BLOCK, BLOCK), BLOCK)
             for c in range(col_blocks)]

  def body(b, accs):
    kb = s * blocks + b
    rows_k = pl.ds(pl.multiple_of(kb * BLOCK, BLOCK), BLOCK)
    x_RB = x_ref[:, rows_k]
    out = []
    for c, acc in enumerate(accs):
      w_BB = w_ref[rows_k, columns[c]].astype(jnp.bfloat16)
      part = jnp.dot(x_RB, w_BB, preferred_element_type=jnp.float32)
      out.append(acc + part * scale_ref[kb, first_col + c])
    return tuple(out)

  accs = tuple(jnp.zeros((x_ref.shape[0], BLOCK), jnp.float32) for _ in range(col_blocks))
  accs = jax.lax.fori_loop(0, blocks, body, accs)
  for c, acc in enumerate(accs):
    out_ref[s, :, columns[c]] = acc


@functools.partial(jax.jit, static_argnames=("splits", "tiling"))
def fp8_matmul(x_MK: jax.Array, w8_KN: jax.Array, scale_KbNb: jax.Array,
               splits: int | None = None, tiling: Fp8Tiling = Fp8Tiling()) -> jax.Array:
  """x @ (w8 * scale broadcast over its 128 x 128 blocks), in x's dtype (bfloat16)."""
  m, k = x_MK.shape
  k_w, n = w8_KN.shape
  if k != k_w or w8_KN.dtype != E4M3 or scale_KbNb.shape != (k // BLOCK, n // BLOCK):
    raise ValueError(f"fp8_matmul takes x [M, K], w8 [K, N] float8_e4m3fn and scales "
                     f"[K/{BLOCK}, N/{BLOCK}], got {x_MK.shape}, {w8_KN.shape} {w8_KN.dtype}, "
                     f"{scale_KbNb.shape}")
  if not fits_kernel(m, k, n, (BLOCK, BLOCK)):
    raise ValueError(f"fp8_matmul takes M <= {MAX_ROWS} rows and K, N in multiples of "
                     f"{BLOCK}, got M={m}, K={k}, N={n}")
  col_blocks = tiling.col_blocks if (n // BLOCK) % tiling.col_blocks == 0 else 1
  splits = splits or choose_splits(k, n // col_blocks, platform.num_sms())
  if k % (splits * BLOCK):
    raise ValueError(f"K={k} does not split into {splits} slices of whole {BLOCK}-blocks")
  rows = max(MIN_ROWS, 1 << (m - 1).bit_length())
  x_RK = jnp.pad(x_MK.astype(jnp.bfloat16), ((0, rows - m), (0, 0)))
  parts_SRN = pl.pallas_call(
      functools.partial(_kernel, blocks=k // splits // BLOCK, col_blocks=col_blocks),
      out_shape=jax.ShapeDtypeStruct((splits, rows, n), jnp.float32),
      grid=(n // BLOCK // col_blocks, splits),
      compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps,
                                              num_stages=tiling.num_stages),
      interpret=not platform.on_gpu(),
      name="fp8_block_scaled_gemm",
  )(x_RK, w8_KN, scale_KbNb.astype(jnp.float32))
  return jnp.sum(parts_SRN[:, :m], axis=0).astype(x_MK.dtype)
