"""Flash-decoding's chunks merged in one kernel: the softmax-weighted sum of K normalised
partial outputs by their log-sum-exps.

Why a kernel: XLA ran the merge as three to four kernels (the largest log-sum-exp, the
weights, the weighted sum, the conversion), each a launch of its own. At batch 1 those
launches and the bounds before the attention kernel took most of a call (BENCHMARKS.md, "FP8
and MLA decode kernels under the profiler": a 16-head call at 8k was about 30 us around a
17.5 us kernel). Here one launch reads each chunk's partial once.

How (Pallas on Triton): programs (column block, row, sequence). A program loads its row's K
log-sum-exps and its [K, columns] block of the partials in one go (no loop over the chunks:
Triton pipelines only the loads that feed a dot, so a loop's loads would wait one after
another, ~0.7 us each: 99 us for a batch-1 merge of 132 chunks, measured on an H100), weighs
and sums them. Blocks hold at most 8192 values (32 KiB of registers over 4 warps) up to 512
chunks (more than any GPU's SMs give mla_decode); columns are as narrow as it takes for the
programs to cover the GPU's SMs, so that the partials are read by all of them at once.

Measured under ncu on an H100 (BENCHMARKS.md, "MLA decode at batch 1: ..."): 5.5 us for a
batch-1 merge at 16 heads (132 chunks, 4.2 MB of partials), 10.9 us at 128 heads (66 chunks,
17 MB).
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
from jspec.pallas_kernels.residual_norm import store_e4m3

MIN_COLUMNS = 16
# Warps of a program of the quantize form, which merges a whole row: at Qwen3-30B-A3B's 32
# heads of a batch-1 step 1.75 µs a call at 4, 1.9 at 1, 2.15 at 2 (the others' choice there).
# None: as the others.
QUANTIZE_WARPS = 4
BLOCK_VALUES = 8192   # a program's [K, columns] block of partials, in float32 registers


def _pow2_at_least(n: int) -> int:
  return max(2, 1 << (n - 1).bit_length())   # Triton's blocks: powers of two


def merge_columns(splits: int, programs_per_column: int, latent_dim: int, num_sms: int) -> int:
  """The widest column block (a power of two dividing C, at least 16) within BLOCK_VALUES for
  `splits` chunks whose programs still number at least the SMs; 16 where none does.
  `programs_per_column`: sequences x rows."""
  cols = MIN_COLUMNS
  while (latent_dim % (2 * cols) == 0 and _pow2_at_least(splits) * 2 * cols <= BLOCK_VALUES
         and programs_per_column * (latent_dim // (2 * cols)) >= num_sms):
    cols *= 2
  return cols


def _kernel(parts_ref, lse_ref, out_ref, *quantized, splits: int, block_cols: int,
            copies: int, token_groups: tuple[int, int], interpret: bool):
  col, row, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(pl.multiple_of(col * block_cols, block_cols), block_cols)
  padded = _pow2_at_least(splits)
  real_K = jnp.arange(padded) < splits
  lse_K = pltriton.load(lse_ref.at[b, pl.ds(0, padded), row], mask=real_K, other=-jnp.inf)
  parts_KC = pltriton.load(parts_ref.at[b, pl.ds(0, padded), row, cols],
                           mask=real_K[:, None], other=0.0)
  top = jnp.max(lse_K)
  top = jnp.where(top > -jnp.inf, top, 0.0)  # no chunk saw the row: every weight 0
  weight_K = jnp.exp(lse_K - top)
  total = jnp.sum(weight_K)
  out_C = jnp.sum(weight_K[:, None] * parts_KC.astype(jnp.float32), axis=0)
  out_C = jnp.where(total > 0, out_C / jnp.where(total > 0, total, 1.0), 0.0)
  # token by token ([B, T x N, C]; e4m3 rows [B x T, N x C]): row k x T x G + t x G + g is
  # token t's head n = k x G + g (one token: row n)
  tokens, group = token_groups
  heads = out_ref.shape[1] // tokens
  token, head = row // group % tokens, row // (tokens * group) * group + row % group
  batch = out_ref.shape[0] // copies
  for c in range(copies):
    out_ref[c * batch + b, token * heads + head, cols] = out_C.astype(out_ref.dtype)
  if quantized:  # the row whole (block_cols = C)
    store_e4m3(out_C.astype(out_ref.dtype), pl.ds(head * block_cols, block_cols),
               b * tokens + token, *quantized, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "block_cols", "rows",
                                             "copies", "quantize", "token_groups"))
def merge_chunks(parts_BKRC: jax.Array, lse_BKR: jax.Array, *, dtype,
                 interpret: bool | None = None, block_cols: int | None = None,
                 rows: int | None = None, copies: int = 1, quantize: bool = False,
                 token_groups: tuple[int, int] | None = None):
  """[B, rows, C] in `dtype`: sum_k softmax_k(lse[b, k, r]) x parts[b, k, r, :] (float32
  sums) for the first `rows` rows (None: all R); rows no chunk saw (every lse -inf) give
  zeros. The rows past `rows` (a tile's padding, which the kernels need not write) are not
  read. C a multiple of 16. `interpret` None: interpret mode off a GPU; `block_cols` None:
  `merge_columns`' choice. `copies` > 1: [copies x B, rows, C], the output written that many
  times over (copy c at rows c x B ..; short_attention's `copies`).

  token_groups (T, G): the rows laid out as short_attention's, row k x T x G + t x G + g
  token t's head k x G + g, merged into [B, T x N, C] token by token (N = R / T heads; all R
  rows). None: (1, 1), the rows as they are.

  quantize (C = 128, all R rows, one copy, at most fp8_gemm.MAX_ROWS tokens): returns (the
  output token by token, the same values in e4m3 as B x T rows of N x C [B x T, N x C], each
  row's 128-groups scaled as fp8_gemm.quantize_activations scales them, their scales in the
  FP8 kernel's lanes [N x L], fp8_gemm.act_lanes): a decode or verify step's attention
  output as o_proj's few-row FP8 kernel takes it (linear.E4m3Rows), no quantizing pass of its
  own. A program then merges a whole row (block_cols = C)."""
  b, splits, padded, latent_dim = parts_BKRC.shape
  if lse_BKR.shape != (b, splits, padded) or latent_dim % MIN_COLUMNS:
    raise ValueError(f"merge_chunks takes parts [B, K, R, C] and lse [B, K, R] with C a "
                     f"multiple of 16, got {parts_BKRC.shape} and {lse_BKR.shape}")
  rows = padded if rows is None else rows
  if not 1 <= rows <= padded:
    raise ValueError(f"merge_chunks merges 1 to R={padded} rows, got rows={rows}")
  if interpret is None:
    interpret = not platform.on_gpu()
  out_shape = [jax.ShapeDtypeStruct((copies * b, rows, latent_dim), dtype)]
  tokens, group = token_groups or (1, 1)
  if quantize:
    heads = rows // tokens
    if (latent_dim != BLOCK or rows != padded or copies != 1 or b * tokens > MAX_ROWS
        or rows % (tokens * group)):
      raise ValueError(f"merge_chunks quantizes every row of C={BLOCK} once for up to "
                       f"{MAX_ROWS} tokens in groups of T x G rows, got C={latent_dim}, "
                       f"{rows} of {padded} rows, {copies} copies, B={b}, (T, G) = "
                       f"{(tokens, group)}")
    block_cols = latent_dim
    lanes = act_lanes_size(b * tokens, heads * latent_dim) // heads
    out_shape += [jax.ShapeDtypeStruct((b * tokens, heads * latent_dim), E4M3),
                  jax.ShapeDtypeStruct((heads, lanes), jnp.float32)]
  elif token_groups is not None and (rows != padded or rows % (tokens * group)):
    raise ValueError(f"merge_chunks writes token by token all R rows in groups of T x G, got "
                     f"{rows} of {padded} rows, (T, G) = {(tokens, group)}")
  if block_cols is None:
    block_cols = merge_columns(splits, b * rows, latent_dim, platform.num_sms())
  if latent_dim % block_cols:
    raise ValueError(f"merge_chunks' column block {block_cols} does not divide C={latent_dim}")
  values = _pow2_at_least(splits) * block_cols
  out = pl.pallas_call(
      functools.partial(_kernel, splits=splits, block_cols=block_cols, copies=copies,
                        token_groups=(tokens, group), interpret=interpret),
      out_shape=tuple(out_shape),
      grid=(latent_dim // block_cols, rows, b),
      compiler_params=pltriton.CompilerParams(
          num_warps=(quantize and QUANTIZE_WARPS) or max(1, min(4, values // 1024)),
          num_stages=1),
      interpret=interpret,
      name="mla_merge_chunks" + ("_e4m3" if quantize else ""),
  )(parts_BKRC, lse_BKR)
  if quantize:
    return out[0], out[1], out[2].reshape(-1)
  return out[0]
