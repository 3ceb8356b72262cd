"""A few rows times one weight as K slices' float32 partials, in one Pallas (Triton) kernel:

  parts [S, M, N] (or [S, N, M]) with parts[s] = x[:, s K/S : (s+1) K/S] @ w[s K/S : (s+1) K/S]

for the decode and verify steps' row products at tp (o_proj, down_proj: summed by the
all-reduce + norm kernel, jspec.pallas_kernels.workspace_norm) and their fused q / k / v
product (summed by the q / k kernel, jspec.pallas_kernels.row_norms), in place of the batched
GEMM XLA runs for them (jspec.sharding.tensor_parallel.k_slice_partials).

Why: a tp = 2 shard of Qwen3-8B's o and q / k / v weights is 16.8 and 25 MB. XLA's GEMMs read
them at 2.40 and 3.03 TB/s at batch 8 on an H200, where the SwiGLU kernel (the same Triton
form, one program a column block) streams its 100 MB at 3.83 (BENCHMARKS.md, 2026-12-01).

How: program (j, s) holds columns [j BN, (j + 1) BN) of slice s and runs over the slice's K
rows in blocks of BK (Triton pipelines the weight's loads): (N / BN) x S programs, each
writing its float32 sums once. The step's rows (at most MAX_ROWS) are padded to Triton's 16 by
masked loads and stores.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform

# Whether k_slice_partials runs its products through the kernel on Hopper GPUs (benchmarks
# turn it off to time XLA's).
ENABLED = True
MIN_ROWS = 16  # Triton's dot takes at least 16 rows
MAX_ROWS = 16
BLOCK_N = 64   # output columns a program holds
BLOCK_K = 128  # K rows a loop step reads
NUM_WARPS = 4
NUM_STAGES = 4


def blocks(slice_k: int, n: int) -> tuple[int, int]:
  """(block_k, block_n): the most of BLOCK_K and BLOCK_N that divide a slice's K and N."""
  return math.gcd(slice_k, BLOCK_K), math.gcd(n, BLOCK_N)


def fits(rows: int, k: int, n: int, slices: int) -> bool:
  """Whether the kernel takes x [rows, k] @ w [k, n] in `slices` K slices: few rows, and
  slices and columns that cut into blocks of at least Triton's 16."""
  if not (0 < rows <= MAX_ROWS and slices > 0 and k % slices == 0):
    return False
  return min(blocks(k // slices, n)) >= MIN_ROWS


def use_kernel(rows: int, k: int, n: int, slices: int, dtype) -> bool:
  """Whether k_slice_partials hands its product to the kernel: ENABLED, on a Hopper GPU, a
  16-bit type (a step's bf16; float32 would take TF32 products), in a shape it takes."""
  return (ENABLED and platform.on_hopper() and jnp.dtype(dtype).itemsize == 2
          and fits(rows, k, n, slices))


def _kernel(x_ref, w_ref, out_ref, *, rows: int, slice_k: int, block_k: int, block_n: int,
            rows_last: bool):
  j, s = pl.program_id(0), pl.program_id(1)
  cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
  row_mask = jnp.arange(MIN_ROWS) < rows
  first = s * slice_k

  def body(i, sums):
    ks = pl.ds(pl.multiple_of(first + i * block_k, block_k), block_k)
    x = pltriton.load(x_ref.at[pl.ds(0, MIN_ROWS), ks], mask=row_mask[:, None], other=0.0)
    return sums + pltriton.dot(x, w_ref[ks, cols])

  sums = lax.fori_loop(0, slice_k // block_k, body, jnp.zeros((MIN_ROWS, block_n), jnp.float32))
  n = w_ref.shape[1]
  if rows_last:  # [S * N, M]: slice s's columns, then rows
    at = out_ref.at[pl.ds(pl.multiple_of(s * n + j * block_n, block_n), block_n),
                    pl.ds(0, MIN_ROWS)]
    pltriton.store(at, sums.T, mask=row_mask[None, :])
  else:  # [S * M, N]: slice s's rows, then columns
    pltriton.store(out_ref.at[pl.ds(s * rows, MIN_ROWS), cols], sums, mask=row_mask[:, None])


@functools.partial(jax.jit, static_argnames=("slices", "rows_last", "block_k", "block_n",
                                             "num_warps", "num_stages", "interpret"))
def k_slice_gemm(x_MK: jax.Array, w_KN: jax.Array, *, slices: int, rows_last: bool = False,
                 block_k: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 interpret: bool | None = None) -> jax.Array:
  """[S, M, N] float32 (rows_last: [S, N, M]): x [M, K] times w [K, N] (one dtype), K
  cut into `slices` equal slices, each slice's product summed in float32. `block_k`,
  `block_n` (multiples of 16 dividing a slice's K and N; None: `blocks`), `num_warps`,
  `num_stages` (None: the module's): the tiling; `interpret` None: off a GPU."""
  rows, k = x_MK.shape
  if w_KN.ndim != 2 or w_KN.shape[0] != k or w_KN.dtype != x_MK.dtype:
    raise ValueError(f"k_slice_gemm takes x [M, K] and w [K, N] of one dtype, got "
                     f"{x_MK.shape} {x_MK.dtype} and {w_KN.shape} {w_KN.dtype}")
  n = w_KN.shape[1]
  if not fits(rows, k, n, slices):
    raise ValueError(f"k_slice_gemm takes 1 to {MAX_ROWS} rows and K = {k} in {slices} slices "
                     f"whose K and N = {n} cut into blocks of at least {MIN_ROWS}; got {rows} "
                     f"rows")
  slice_k = k // slices
  block_k = block_k or blocks(slice_k, n)[0]
  block_n = block_n or blocks(slice_k, n)[1]
  if slice_k % block_k or n % block_n or block_k % MIN_ROWS or block_n % MIN_ROWS:
    raise ValueError(f"blocks of {block_k} x {block_n} (multiples of {MIN_ROWS}) must divide "
                     f"a slice's K = {slice_k} and N = {n}")
  if interpret is None:
    interpret = not platform.on_gpu()
  kernel = functools.partial(_kernel, rows=rows, slice_k=slice_k, block_k=block_k,
                             block_n=block_n, rows_last=rows_last)
  out_shape = (slices * n, rows) if rows_last else (slices * rows, n)
  parts = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
      grid=(n // block_n, slices),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                              num_stages=num_stages or NUM_STAGES),
      interpret=interpret, name="k_slice_gemm")(x_MK, w_KN)
  return parts.reshape(slices, n, rows) if rows_last else parts.reshape(slices, rows, n)
