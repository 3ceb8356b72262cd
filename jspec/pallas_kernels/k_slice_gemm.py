"""A few rows' product as K slices' float32 partials in one Pallas (Triton) kernel:

  parts [S, M, N] (or [S, N, M]) = x [M, K] @ w [K, N], slice s over K rows [s K/S, (s+1) K/S)

the form jspec.sharding.tensor_parallel.k_slice_partials hands the readers that sum slices as
they read them (the fused all-reduce + residual + norm after a tp row product, the q / k norm
and RoPE kernel after the fused q / k / v product).

Why: XLA runs those products as one batched GEMM per call, and a decode step's shards are
short: at tp = 2, batch 8, Qwen3-8B's o and down products read their weights at 2.36 and
3.60 TB/s, where the one-GPU products reach 3.3-4.0 (BENCHMARKS.md, "the tp = 2 step at batch 8
kernel by kernel").

How: program (j, s) holds columns [j BN, (j + 1) BN) of slice s and runs over its K rows in
blocks of BK (Triton pipelines the weight's loads), its float32 sums stored as they are. The
step's rows (at most MAX_ROWS) are padded to Triton's 16 by masked loads; rows past M in the
output (one row is written as two, as k_slice_partials does) hold zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform

MIN_ROWS = 16  # Triton's dot takes at least 16 rows
MAX_ROWS = 64
BLOCK_N = 64
ROW_BLOCK_N = 32  # row_gemm's: no K slices, so narrower column blocks to fill the SMs
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4


def _block_rows(rows: int) -> int:
  return max(MIN_ROWS, 1 << (rows - 1).bit_length())


def fits(rows: int, k: int, n: int, slices: int, dtype, block_k: int = BLOCK_K,
         block_n: int = BLOCK_N) -> bool:
  """Whether x [rows, k] and w [k, n] of `dtype` cut into `slices` take the kernel: at most
  MAX_ROWS rows, a 16-bit type, a slice's K rows and N on the blocks."""
  return (0 < rows <= MAX_ROWS and jnp.dtype(dtype).itemsize == 2 and slices > 0
          and k % (slices * block_k) == 0 and n % block_n == 0)


def _kernel(x_ref, w_ref, out_ref, *, rows: int, out_rows: int, block_rows: int,
            block_k: int, block_n: int, steps: int, columns: int, rows_last: bool):
  cols = pl.ds(pl.program_id(0) * block_n, block_n)
  first_k = pl.program_id(1) * (steps * block_k)
  row_ids = jnp.arange(block_rows)

  def body(i, sums):
    ks = pl.ds(pl.multiple_of(first_k + i * block_k, block_k), block_k)
    x = pltriton.load(x_ref.at[pl.ds(0, block_rows), ks], mask=(row_ids < rows)[:, None],
                      other=0.0)
    return sums + pltriton.dot(x, w_ref[ks, cols])

  sums = lax.fori_loop(0, steps, body, jnp.zeros((block_rows, block_n), jnp.float32))
  # out_ref is the output's [S x M', N] (rows_last: [S x N, M']) view: slice s's rows start
  # at s M' (at s N)
  if rows_last:
    first = pl.program_id(1) * columns
    pltriton.store(out_ref.at[pl.ds(first + pl.program_id(0) * block_n, block_n),
                              pl.ds(0, block_rows)], sums.T, mask=(row_ids < out_rows)[None, :])
  else:
    pltriton.store(out_ref.at[pl.ds(pl.program_id(1) * out_rows, block_rows), cols],
                   sums.astype(out_ref.dtype), mask=(row_ids < out_rows)[:, None])


@functools.partial(jax.jit, static_argnames=("slices", "rows_last", "block_k", "block_n",
                                             "num_warps", "num_stages", "interpret"))
def k_slice_gemm(x_MK: jax.Array, w_KN: jax.Array, slices: int, rows_last: bool = False, *,
                 block_k: int = BLOCK_K, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                 num_stages: int = NUM_STAGES, interpret: bool | None = None) -> jax.Array:
  """[S, M', N] float32 (rows_last: [S, N, M']), slice s = x[:, Ks] @ w[Ks] over the s-th of S
  equal K slices; M' = max(M, 2), rows past M zero. x and w of one 16-bit dtype; `block_k`,
  `block_n` (multiples of 16), `num_warps`, `num_stages`: the tiling; `interpret` None: off a
  GPU."""
  _check(x_MK, w_KN, slices, block_k, block_n)
  rows, n = x_MK.shape[0], w_KN.shape[1]
  out_rows = max(rows, 2)
  shape = (slices, n, out_rows) if rows_last else (slices, out_rows, n)
  return _call(x_MK, w_KN, slices, out_rows, jnp.float32, rows_last, block_k, block_n,
               num_warps, num_stages, interpret).reshape(shape)


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "num_warps", "num_stages",
                                             "interpret"))
def row_gemm(x_MK: jax.Array, w_KN: jax.Array, *, block_k: int = BLOCK_K,
             block_n: int = ROW_BLOCK_N, num_warps: int = NUM_WARPS,
             num_stages: int = NUM_STAGES, interpret: bool | None = None) -> jax.Array:
  """x @ w [M, N] in x's dtype, each column's whole K in one program (no K slices, so no
  partials to sum after it), the sums in float32 rounded once; tiling and `interpret` as
  k_slice_gemm's."""
  _check(x_MK, w_KN, 1, block_k, block_n)
  return _call(x_MK, w_KN, 1, x_MK.shape[0], x_MK.dtype, False, block_k, block_n, num_warps,
               num_stages, interpret)


def _check(x_MK, w_KN, slices, block_k, block_n):
  rows, k = x_MK.shape
  if w_KN.ndim != 2 or w_KN.shape[0] != k or w_KN.dtype != x_MK.dtype:
    raise ValueError(f"the row kernels take x [M, K] and w [K, N] of one dtype, got "
                     f"{x_MK.shape} {x_MK.dtype} and {w_KN.shape} {w_KN.dtype}")
  if block_k % MIN_ROWS or block_n % MIN_ROWS or not fits(rows, k, w_KN.shape[1], slices,
                                                          x_MK.dtype, block_k, block_n):
    raise ValueError(f"the row kernels take 1 to {MAX_ROWS} rows of a 16-bit type, K cut into "
                     f"{slices} slices of whole {block_k}-row blocks and N of whole "
                     f"{block_n}-column blocks (multiples of {MIN_ROWS}); got x {x_MK.shape} "
                     f"{x_MK.dtype}, w {w_KN.shape}")


def _call(x_MK, w_KN, slices, out_rows, out_dtype, rows_last, block_k, block_n, num_warps,
          num_stages, interpret):
  """The kernel's output as its 2-D view: [S x out_rows, N] (rows_last: [S x N, out_rows])."""
  rows, k = x_MK.shape
  n = w_KN.shape[1]
  if interpret is None:
    interpret = not platform.on_gpu()
  flat = (slices * n, out_rows) if rows_last else (slices * out_rows, n)
  kernel = functools.partial(_kernel, rows=rows, out_rows=out_rows,
                             block_rows=_block_rows(out_rows), block_k=block_k, block_n=block_n,
                             steps=k // (slices * block_k), columns=n, rows_last=rows_last)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(flat, out_dtype), grid=(n // block_n, slices),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="k_slice_gemm" if slices > 1 else "row_gemm")(x_MK, w_KN)
