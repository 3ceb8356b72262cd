"""A few rows against one weight matrix, y[M, N] = x[M, K] @ w[K, N] for M <= 64, on Hopper.

Why: XLA's GPU compiler rewrites a vector-matrix dot (one row) whose operands hold fewer than
10 M elements together (K + K x N, its "too small for a GEMM" rule) into a broadcast multiply
and a reduction, and the multiply writes the whole [K, N] product to HBM before the reduction
reads it back. From two rows on it runs a GEMM, which the kernel does not beat (measured: 6.2
µs per 16 MB projection for the kernel, about 5.5 for XLA's GEMM at 2 to 4 rows).
At batch 1 the q and o projections of Qwen3-30B-A3B (2048 x 4096 each) fall under the rule:
profiled, they took 21 and 28.5 µs where reading their 16 MB once takes 3.6 µs (BENCHMARKS.md,
"MoE decode"). Models with hidden size <= 2048 hit it in every attention layer.

How: through the decode expert kernel (jspec.pallas_kernels.decode_gemm.down_decode), which
streams a weight once and multiplies all rows with it. The weight's K rows are cut into S
slices, a free reshape to [S, K/S, N]; slice s is the kernel's slot s, its "expert" the s-th
slice, its activations the matching columns of x and its routing weight 1. S is the largest
power of two for which S x (N / block) work items still fit the SMs, so every SM streams. The
S partial products (bf16, as the kernel writes them) are summed in float32.

Default since 2026-11-28 (`ONE_ROW`): the products `use_skinny` picks run instead as XLA GEMMs
of two equal rows, the first kept. The kernel needs glue around it, each piece a kernel launch
of its own in the step: the pad and transpose of x before it, the sum of the S partials after
it, and its slot table and routing weights (iota and broadcast kernels; NumPy constants too,
which XLA turns back into them). On 2 H200s the GEMMs, with no glue, made the step faster:
Qwen3-8B at tp = 2, batch 1, 3.677 against 3.839 ms a step; Qwen3-30B-A3B on one GPU 3.833
against 3.882 (BENCHMARKS.md, "One-row products as two-row GEMMs"). The kernel stays for
`projection_backend="pallas"`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.pallas_kernels import decode_gemm, decode_routing, platform

# XLA's threshold (gpu_algebraic_simplifier: IsMatrixMultiplicationTooSmallForRewriting with
# 10,000,000): below it a dot is strength-reduced to multiply + reduce.
XLA_DOT_REDUCE_ELEMENTS = 10_000_000
# Below this many weight elements (16 MB in bf16) XLA keeps the product: its reduction fuses
# smaller products well (Qwen3-8B's k and v, 4096 x 1024 each, ran as one reduction at 58% of
# the read bandwidth) and the kernel's work items would be too small to pay for its pipeline.
MIN_WEIGHT_ELEMENTS = 1 << 23
MAX_ROWS = 64   # the decode kernels' N (float32 sums in registers)
TILE = 64       # K and N must be multiples of the kernel's smallest block


def fits_kernel(rows: int, k: int, n: int, dtype) -> bool:
  """The kernel's shapes: few rows, K and N on its tile, a 16-bit type (wgmma reads 32-bit
  operands only K-major, and w is N-major)."""
  return (rows <= MAX_ROWS and k % TILE == 0 and n % TILE == 0
          and jnp.dtype(dtype).itemsize == 2)


def use_skinny(rows: int, k: int, n: int, dtype) -> bool:
  """Whether x[rows, k] @ w[k, n] goes to the kernel by default: a product XLA would
  strength-reduce (one row), large enough to matter, that the kernel takes."""
  return (rows == 1 and k + k * n < XLA_DOT_REDUCE_ELEMENTS and k * n >= MIN_WEIGHT_ELEMENTS
          and fits_kernel(rows, k, n, dtype))


def _block(size: int) -> int:
  return 128 if size % 128 == 0 else 64


def choose_splits(k: int, n: int, num_sms: int) -> int:
  """The most K slices (a power of two, each a multiple of TILE rows) whose work items, one per
  (slice, column block), fit `num_sms`."""
  col_blocks = n // _block(n)
  splits = 1
  while 2 * splits * col_blocks <= num_sms and k % (2 * splits * TILE) == 0:
    splits *= 2
  return splits


@functools.partial(jax.jit, static_argnames=("splits",))
def skinny_matmul(x_MK: jax.Array, w_KN: jax.Array, splits: int | None = None) -> jax.Array:
  """x @ w in x's dtype, the weight read once; `splits` K slices (None: choose_splits)."""
  m, k = x_MK.shape
  k_w, n = w_KN.shape
  if k != k_w or x_MK.dtype != w_KN.dtype:
    raise ValueError(f"skinny_matmul takes x [M, K] and w [K, N] of one dtype, got "
                     f"{x_MK.shape} {x_MK.dtype} and {w_KN.shape} {w_KN.dtype}")
  if m > MAX_ROWS or k % TILE or n % TILE:
    raise ValueError(f"skinny_matmul takes M <= {MAX_ROWS} rows and K, N in multiples of "
                     f"{TILE}, got M={m}, K={k}, N={n}")
  splits = splits or choose_splits(k, n, platform.num_sms())
  if k % (splits * TILE):
    raise ValueError(f"K={k} does not split into {splits} slices of a multiple of {TILE}")
  k_slice = k // splits
  rows = decode_routing.padded_tokens(m)
  x_pad = jnp.pad(x_MK, ((0, rows - m), (0, 0)))
  act_SRK = x_pad.reshape(rows, splits, k_slice).transpose(1, 0, 2)
  w_SKN = w_KN.reshape(splits, k_slice, n)
  ones_SC = jnp.ones((splits, decode_routing.weight_columns(m)), jnp.float32)
  slots_S = jnp.arange(splits, dtype=jnp.int32)
  tiling = decode_gemm.DecodeTiling(block_cols=_block(n), block_k=_block(k_slice))
  parts_SRN = decode_gemm.down_decode(act_SRK, w_SKN, ones_SC, slots_S,
                                      jnp.full((1,), splits, jnp.int32), tiling)
  return jnp.sum(parts_SRN[:, :m].astype(jnp.float32), axis=0).astype(x_MK.dtype)


# How `project` multiplies one-row products: "two_rows" (those `use_skinny` picks as two-row
# XLA GEMMs: x doubled, the first row kept; the rest through XLA's dot, which strength-reduces
# those under its threshold), "kernel" (those `use_skinny` picks through the module's kernel),
# or "two_rows_all" (every one-row product under XLA's threshold as two-row GEMMs, the small
# k / v ones too: slower on one GPU, 4.614 against 4.525 ms a Qwen3-8B step). Benchmarks
# switch it to time them.
ONE_ROW = "two_rows"


def twice(x_1X: jax.Array) -> jax.Array:
  """[1, ...] -> [2, ...]: the row twice, for a GEMM that XLA would strength-reduce into a
  reduction with one row (two equal rows: XLA cannot fold a zero row away and rewrite the
  dot again). A broadcast, not a concatenate: XLA's GEMM fusion reads a broadcast operand
  in place, where a concatenate was a kernel of its own before each such product (1.0-1.4 µs
  on an H200; Qwen3-30B-A3B's batch-1 step -3.5% at 12 layers, Qwen3-8B's -1.3%,
  BENCHMARKS.md, "One row doubled by a broadcast ...")."""
  return jnp.broadcast_to(x_1X, (2,) + x_1X.shape[1:])


def _two_rows(x_K, w_KN):
  return jnp.dot(twice(x_K[None]), w_KN)[0]


def project(x_BTK: jax.Array, w_KN: jax.Array, always: bool = False) -> jax.Array:
  """x @ w over the last axis: the kernel where `use_skinny` says so (`always`: wherever the
  kernel takes the shapes), XLA's dot otherwise (see ONE_ROW for one-row products)."""
  *lead, k = x_BTK.shape
  rows = 1
  for size in lead:
    rows *= size
  n = w_KN.shape[1]
  if not always and rows == 1 and (
      ONE_ROW == "two_rows_all" and k + k * n < XLA_DOT_REDUCE_ELEMENTS
      or ONE_ROW == "two_rows" and use_skinny(rows, k, n, x_BTK.dtype)):
    return _two_rows(x_BTK.reshape(k), w_KN).reshape(*lead, n)
  choose = fits_kernel if always else use_skinny
  if not choose(rows, k, n, x_BTK.dtype):
    return jnp.einsum("...k,kn->...n", x_BTK, w_KN)
  return skinny_matmul(x_BTK.reshape(rows, k), w_KN).reshape(*lead, w_KN.shape[1])
