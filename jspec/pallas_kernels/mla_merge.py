"""Flash-decoding's chunks merged in one kernel: the softmax-weighted sum of K normalised
partial outputs by their log-sum-exps.

Why a kernel: XLA ran the merge as three to four kernels (the largest log-sum-exp, the
weights, the weighted sum, the conversion), each a launch of its own. At batch 1 those
launches and the bounds before the attention kernel took most of a call (BENCHMARKS.md, "FP8
and MLA decode kernels under the profiler": a 16-head call at 8k was about 30 us around a
17.5 us kernel). Here one launch reads each chunk's partial once.

How (Pallas on Triton): programs (column block, row tile, sequence). A program loads its rows'
K log-sum-exps at once for their maximum and the weights' total, then walks the K chunks
adding weight x partial for its [rows, columns] block. Column blocks are as narrow as it takes
for the programs to cover the GPU's SMs (at batch 1, 16 rows: 16 columns each), so that the
partials are read by many SMs at once rather than by a few.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform

MIN_COLUMNS = 16
MAX_COLUMNS = 128
BLOCK_ROWS = 16


def merge_columns(programs_per_column: int, latent_dim: int, num_sms: int) -> int:
  """The widest column block (a power of two in [16, 128] dividing C) whose programs still
  number at least the SMs; 16 where none does. `programs_per_column`: sequences x row tiles."""
  cols = MAX_COLUMNS
  while cols > MIN_COLUMNS and (latent_dim % cols
                                or programs_per_column * (latent_dim // cols) < num_sms):
    cols //= 2
  return cols


def _kernel(parts_ref, lse_ref, out_ref, *, splits: int, block_cols: int):
  col, tile, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = pl.ds(pl.multiple_of(tile * BLOCK_ROWS, BLOCK_ROWS), BLOCK_ROWS)
  cols = pl.ds(pl.multiple_of(col * block_cols, block_cols), block_cols)
  padded_splits = max(2, 1 << (splits - 1).bit_length())  # Triton's blocks: powers of two
  chunks = jnp.arange(padded_splits)
  lse_KR = pltriton.load(lse_ref.at[b, pl.ds(0, padded_splits), rows],
                         mask=(chunks < splits)[:, None], other=-jnp.inf)
  top_R = jnp.max(lse_KR, axis=0)
  top_R = jnp.where(top_R > -jnp.inf, top_R, 0.0)  # no chunk saw the row: weights all 0
  total_R = jnp.sum(jnp.exp(lse_KR - top_R[None, :]), axis=0)

  def add_chunk(k, acc):
    weight_R = jnp.exp(lse_ref[b, k, rows] - top_R)
    return acc + weight_R[:, None] * parts_ref[b, k, rows, cols].astype(jnp.float32)

  acc = jax.lax.fori_loop(0, splits, add_chunk,
                          jnp.zeros((BLOCK_ROWS, block_cols), jnp.float32))
  seen = total_R > 0
  out = jnp.where(seen[:, None], acc / jnp.where(seen, total_R, 1.0)[:, None], 0.0)
  out_ref[b, rows, cols] = out.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "block_cols"))
def merge_chunks(parts_BKRC: jax.Array, lse_BKR: jax.Array, *, dtype,
                 interpret: bool | None = None, block_cols: int | None = None) -> jax.Array:
  """[B, R, C] in `dtype`: sum_k softmax_k(lse[b, k, r]) x parts[b, k, r, :] (float32 sums);
  rows no chunk saw (every lse -inf) give zeros. R a multiple of 16, C of 16. `interpret`
  None: interpret mode off a GPU; `block_cols` None: `merge_columns`' choice."""
  b, splits, rows, latent_dim = parts_BKRC.shape
  if lse_BKR.shape != (b, splits, rows) or rows % BLOCK_ROWS or latent_dim % MIN_COLUMNS:
    raise ValueError(f"merge_chunks takes parts [B, K, R, C] and lse [B, K, R] with R and C "
                     f"multiples of 16, got {parts_BKRC.shape} and {lse_BKR.shape}")
  if interpret is None:
    interpret = not platform.on_gpu()
  row_tiles = rows // BLOCK_ROWS
  if block_cols is None:
    block_cols = merge_columns(b * row_tiles, latent_dim, platform.num_sms())
  if latent_dim % block_cols:
    raise ValueError(f"merge_chunks' column block {block_cols} does not divide C={latent_dim}")
  return pl.pallas_call(
      functools.partial(_kernel, splits=splits, block_cols=block_cols),
      out_shape=jax.ShapeDtypeStruct((b, rows, latent_dim), dtype),
      grid=(latent_dim // block_cols, row_tiles, b),
      compiler_params=pltriton.CompilerParams(
          num_warps=max(1, min(4, BLOCK_ROWS * block_cols // 256)), num_stages=3),
      interpret=interpret,
      name="mla_merge_chunks",
  )(parts_BKRC, lse_BKR)
