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

Not on by default: `jspec.models.mlp.SWIGLU_KERNEL` (`tp_scaling.py --swiglu-kernel`) turns it
on; its speed against XLA's GEMM has not been measured on a GPU yet.
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
NUM_WARPS = 4
NUM_STAGES = 4


def blocks(k: int, f: int) -> tuple[int, int]:
  """(block_k, block_n): the most of BLOCK_K and BLOCK_N that divide K and F."""
  return math.gcd(k, BLOCK_K), math.gcd(f, BLOCK_N)


def fits(rows: int, k: int, f: int) -> bool:
  """Whether the kernel takes x [rows, k] and a weight [k, 2, f] in `blocks`' tiling: blocks
  of at least 16 (Triton's dot)."""
  return 0 < rows <= MAX_ROWS and min(blocks(k, f)) >= MIN_ROWS


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
                block_n: int | None = None, num_warps: int = NUM_WARPS,
                num_stages: int = NUM_STAGES, interpret: bool | None = None) -> jax.Array:
  """silu(x @ w[:, 0]) * (x @ w[:, 1]) for x [M, K] and w [K, 2, F] of x's dtype: [M, F], the
  sums in float32 and the activation rounded once. `block_k`, `block_n` (multiples of 16
  dividing K and F; None: `blocks`), `num_warps`, `num_stages`: the tiling; `interpret` None:
  off a GPU."""
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
  if interpret is None:
    interpret = not platform.on_gpu()
  kernel = functools.partial(_kernel, rows=rows,
                             block_rows=max(MIN_ROWS, 1 << (rows - 1).bit_length()),
                             block_k=block_k, block_n=block_n)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((rows, f), x_MK.dtype), grid=(f // block_n,),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="swiglu_gemm")(x_MK, w_KCF)
