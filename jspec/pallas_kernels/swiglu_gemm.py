"""A step's SwiGLU gate / up product and its activation in one Pallas (Triton) kernel, for the
few rows of a decode or verify step:

  act [M, F] = silu(x [M, K] @ w[:, 0, :]) * (x @ w[:, 1, :]),  w [K, 2, F] (jspec.models.mlp)

Why: XLA runs the product as one GEMM over the [K, 2, F] weight and then SiLU x up as a kernel
of its own, 1.4-1.7 µs a layer of a Qwen3-8B step on an H200 at batch 1 to 8, one GPU or a
tp = 2 shard (BENCHMARKS.md, "One-row steps on one GPU write …"). XLA cannot fuse it either
way: into the next GEMM's operand it fuses only producers that add at most 1 KiB of input
(SiLU x up reads twice what it writes), and into this GEMM's output only elementwise
consumers of one output column (SiLU x up pairs column f with column F + f).

How: program j holds columns [j BN, (j + 1) BN) of gate and of up, runs over K in blocks of
BK (Triton pipelines the weight's loads; the K loop is the whole reduction, no K split, so
the activation needs no second pass), and applies silu(g) x u to its float32 sums before one
rounding to x's dtype (XLA's path rounds the product first, then the activation). The step's
rows (at most MAX_ROWS) are padded to Triton's 16 by masked loads.

On by default on Hopper GPUs (`jspec.models.mlp.SWIGLU_KERNEL`; `tp_scaling.py
--no-swiglu-kernel` turns it off) for shards of MIN_F to MAX_F columns: Qwen3-8B at tp = 2 on
2 H200, TPOT -3.5% at batch 1, -1.3% at batch 8 (BENCHMARKS.md, "SwiGLU's gate / up product
and activation in one kernel").
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
from jspec.pallas_kernels.shared import silu_mul

MIN_ROWS = 16  # Triton's dot takes at least 16 rows
MAX_ROWS = 64
BLOCK_N = 64   # columns of gate (and of up) a program holds
BLOCK_K = 128  # K rows a loop step reads
# The columns (a shard's F) the models' MLPs hand the kernel. On an H200 it beats XLA's GEMM +
# activation at a tp = 2 shard of Qwen3-8B (6144: 25.4 against 27.2-30.1 µs a layer) and not in
# the step at the whole 12288 (TPOT equal within 0.3% at its best tiling), nor at 4096 or less
# (19.5 against 18.8 µs at 4096): with no K split, a narrow F is few programs (F / BLOCK_N).
MIN_F = 6144
MAX_F = 8192
NUM_WARPS = 4
NUM_STAGES = 4
# A block's shared memory on an H100 / H200 (227 KiB opt-in): Triton asks for the pipeline's
# stages less one, each an x tile and two weight tiles, and for the float32 sums' epilogue
# (bounded by four [rows, BN] float32 tiles: 65536 bytes measured at 64 rows).
SHARED_MEMORY = 232448


def shared_memory(rows: int, block_k: int, block_n: int, itemsize: int, stages: int) -> int:
  """The bytes of shared memory a tiling asks for, bounded from above."""
  block_rows = _block_rows(rows)
  tiles = (block_rows * block_k + 2 * block_k * block_n) * itemsize
  return (stages - 1) * tiles + 4 * block_rows * block_n * 4


def stages_that_fit(rows: int, block_k: int, block_n: int, itemsize: int, stages: int) -> int:
  """The most pipeline stages, at most `stages` and at least 2, whose shared memory fits; 0
  where not even 2 do (a float32 x at 64 rows runs 2, bf16 the module's 4)."""
  fitting = [s for s in range(2, stages + 1)
             if shared_memory(rows, block_k, block_n, itemsize, s) <= SHARED_MEMORY]
  return max(fitting, default=0)


def _block_rows(rows: int) -> int:
  return max(MIN_ROWS, 1 << (rows - 1).bit_length())


def blocks(k: int, f: int) -> tuple[int, int]:
  """(block_k, block_n): the most of BLOCK_K and BLOCK_N that divide K and F."""
  return math.gcd(k, BLOCK_K), math.gcd(f, BLOCK_N)


def takes_width(k: int, f: int) -> bool:
  """Whether the models' MLPs with a shard's weight [k, 2, f] take the kernel: MIN_F to MAX_F
  columns and `blocks`' tiling of at least 16 (Triton's dot)."""
  return MIN_F <= f <= MAX_F and min(blocks(k, f)) >= MIN_ROWS


def fits(rows: int, k: int, f: int, itemsize: int = 2) -> bool:
  """Whether the models' MLPs hand x [rows, k] and a weight [k, 2, f] to the kernel: a width
  it takes, at most MAX_ROWS rows, in the shared memory at 2 stages or more."""
  return (0 < rows <= MAX_ROWS and takes_width(k, f)
          and stages_that_fit(rows, *blocks(k, f), itemsize, NUM_STAGES) > 0)


def _kernel(x_ref, w_ref, out_ref, *, rows: int, block_rows: int, block_k: int,
            block_n: int):
  cols = pl.ds(pl.program_id(0) * block_n, block_n)
  row_mask = jnp.arange(block_rows) < rows

  def body(i, sums):
    gate, up = sums
    ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
    x = pltriton.load(x_ref.at[pl.ds(0, block_rows), ks], mask=row_mask[:, None], other=0.0)
    gate = gate + pltriton.dot(x, w_ref[ks, 0, cols])
    return gate, up + pltriton.dot(x, w_ref[ks, 1, cols])

  zeros = jnp.zeros((block_rows, block_n), jnp.float32)
  gate, up = lax.fori_loop(0, x_ref.shape[1] // block_k, body, (zeros, zeros))
  pltriton.store(out_ref.at[pl.ds(0, block_rows), cols], silu_mul(gate, up).astype(out_ref.dtype),
                 mask=row_mask[:, None])


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "num_warps", "num_stages",
                                             "interpret"))
def swiglu_gemm(x_MK: jax.Array, w_KCF: jax.Array, *, block_k: int | None = None,
                block_n: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, interpret: bool | None = None) -> jax.Array:
  """silu(x @ w[:, 0]) * (x @ w[:, 1]) for x [M, K] and w [K, 2, F] of x's dtype: [M, F], the
  sums in float32 and the activation rounded once. `block_k`, `block_n` (multiples of 16
  dividing K and F; None: `blocks`), `num_warps`, `num_stages` (None: the
  module's; fewer where the shared memory holds fewer): the tiling; `interpret` None: off a GPU."""
  rows, k = x_MK.shape
  if w_KCF.ndim != 3 or w_KCF.shape[:2] != (k, 2) or w_KCF.dtype != x_MK.dtype:
    raise ValueError(f"swiglu_gemm takes x [M, K] and w [K, 2, F] of one dtype, got "
                     f"{x_MK.shape} {x_MK.dtype} and {w_KCF.shape} {w_KCF.dtype}")
  f = w_KCF.shape[2]
  block_k = block_k or blocks(k, f)[0]
  block_n = block_n or blocks(k, f)[1]
  if not 0 < rows <= MAX_ROWS:
    raise ValueError(f"swiglu_gemm takes 1 to {MAX_ROWS} rows, got {rows}")
  if k % block_k or f % block_n or block_k % MIN_ROWS or block_n % MIN_ROWS:
    raise ValueError(f"blocks of {block_k} x {block_n} (multiples of {MIN_ROWS}) must divide "
                     f"K={k} and F={f}")
  stages = stages_that_fit(rows, block_k, block_n, x_MK.dtype.itemsize,
                           num_stages or NUM_STAGES)
  if not stages:
    raise ValueError(f"blocks of {block_k} x {block_n} at {rows} rows of {x_MK.dtype} need more "
                     f"than {SHARED_MEMORY} bytes of shared memory at 2 stages")
  if interpret is None:
    interpret = not platform.on_gpu()
  kernel = functools.partial(_kernel, rows=rows, block_rows=_block_rows(rows), block_k=block_k,
                             block_n=block_n)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((rows, f), x_MK.dtype), grid=(f // block_n,),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                              num_stages=stages),
      interpret=interpret, name="swiglu_gemm")(x_MK, w_KCF)
