"""A few rows against a block-scaled FP8 weight as K-slice partials, in one Pallas (Triton)
kernel: partials [S, N, R] float32 with sum_s partials[s, :, :M].T = x @ (w8 * scale).T.

Why beside jspec.pallas_kernels.fp8_block_kernel (Mosaic GPU, one program per SM streaming its
items' tiles by the TMA): that kernel's stream holds at 3.6-3.9 TB/s on an H200 whatever its
depth, warps or barriers (BENCHMARKS.md, "What holds the FP8 few-row kernel's stream …"),
while Triton programs of plain loads, several an SM, stream bf16 K slices at XLA's 4.3-4.5
(BENCHMARKS.md, "… a Triton kernel for few-row products …"). Here program (j, s) owns
`block_n` output columns and the s-th slice of K, and walks it a 128 x 128 scale block at a
time:

  e4m3 x  (the norm kernels' rows, their scales per row and 128-K group): one FP8 tensor-core
          product w8 . x8^T per block, times the weight block's scale and each row's;
  bf16 x  each e4m3 tile widened to bfloat16 in registers, then the product, times the block's
          scale.

The weight is the M side of the products ([block_n, 128] . [128, R]): the rows, padded to 16
(the tensor cores' smallest side here), are the N side, as in the Mosaic kernel.

Shape letters: M rows, R padded rows, K input width, N output width, S K slices, Kb = K / 128.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3

MIN_ROWS = 16  # the dot's smallest side in Triton
MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class TritonRowsTiling:
  """block_n: output columns a program owns (a divisor of 128: one weight-block scale each);
  splits: K slices (None: enough programs for `programs_per_sm` an SM); Triton's warps and
  pipeline stages."""
  block_n: int = 128
  splits: int | None = None
  num_warps: int = 4
  num_stages: int = 4
  programs_per_sm: int = 4


def choose_splits(k: int, n: int, block_n: int, num_sms: int, programs_per_sm: int) -> int:
  """The fewest K slices (a power of two, whole blocks each) that bring the programs to
  `programs_per_sm` an SM, at most one slice a block."""
  k_blocks = k // BLOCK
  splits = 1
  while (splits * (n // block_n) < programs_per_sm * num_sms and 2 * splits <= k_blocks
         and k_blocks % (2 * splits) == 0):
    splits *= 2
  return splits


def _kernel(x_ref, w_ref, w_scale_ref, *refs, blocks: int, block_n: int, fp8_x: bool):
  x_scale_ref = refs[0] if fp8_x else None
  out_ref = refs[-1]
  j, s = pl.program_id(0), pl.program_id(1)
  cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
  n_block = j * block_n // BLOCK

  def body(b, acc_NR):
    kb = s * blocks + b
    k_cols = pl.ds(pl.multiple_of(kb * BLOCK, BLOCK), BLOCK)
    w_NB = w_ref[cols, k_cols]
    x_RB = x_ref[:, k_cols]
    scale = w_scale_ref[n_block, kb]
    if fp8_x:
      part_NR = pltriton.dot(w_NB, x_RB, trans_b=True)
      return acc_NR + part_NR * (scale * x_scale_ref[kb, :])[None, :]
    part_NR = pltriton.dot(w_NB.astype(x_RB.dtype), x_RB, trans_b=True)
    return acc_NR + part_NR * scale

  acc_NR = jax.lax.fori_loop(0, blocks, body,
                             jnp.zeros((block_n, x_ref.shape[0]), jnp.float32))
  out_ref[s, cols, :] = acc_NR


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def fp8_rows_partials(x_MK: jax.Array, w8_NK: jax.Array, scale_NbKb: jax.Array,
                      x_scale_MKb: jax.Array | None = None,
                      tiling: TritonRowsTiling = TritonRowsTiling(),
                      interpret: bool | None = None) -> jax.Array:
  """[S, N, R] float32 K-slice partials of x @ (w8 * scale).T (R: M padded to 16 or a power of
  two). x: bfloat16 [M, K], or e4m3 [M, K] with x_scale_MKb [M, K/128] (each row's 128-group
  scales, fp8_gemm.quantize_activations')."""
  m, k = x_MK.shape
  n, k_w = w8_NK.shape
  fp8_x = x_MK.dtype == E4M3
  if (k != k_w or w8_NK.dtype != E4M3 or scale_NbKb.shape != (n // BLOCK, k // BLOCK)
      or k % BLOCK or n % BLOCK or not 0 < m <= MAX_ROWS
      or fp8_x != (x_scale_MKb is not None)
      or (fp8_x and x_scale_MKb.shape != (m, k // BLOCK))
      or (not fp8_x and x_MK.dtype != jnp.bfloat16)):
    raise ValueError(f"fp8_rows_partials takes x [M <= {MAX_ROWS}, K] bfloat16 (or e4m3 with "
                     f"x_scale [M, K/{BLOCK}]), w8 [N, K] e4m3 and scales [N/{BLOCK}, "
                     f"K/{BLOCK}], K and N in whole blocks; got {x_MK.shape} {x_MK.dtype}, "
                     f"{None if x_scale_MKb is None else x_scale_MKb.shape}, {w8_NK.shape} "
                     f"{w8_NK.dtype}, {scale_NbKb.shape}")
  if BLOCK % tiling.block_n or tiling.block_n < 16:
    raise ValueError(f"block_n must divide {BLOCK} and be at least 16, got {tiling.block_n}")
  if interpret is None:
    interpret = not platform.on_gpu()
  splits = tiling.splits or choose_splits(k, n, tiling.block_n, platform.num_sms(),
                                          tiling.programs_per_sm)
  if k // BLOCK % splits:
    raise ValueError(f"K={k} does not split into {splits} slices of whole {BLOCK}-blocks")
  rows = max(MIN_ROWS, pl.next_power_of_2(m))
  x_RK = jnp.pad(x_MK, ((0, rows - m), (0, 0)))
  operands = [x_RK, w8_NK, scale_NbKb.astype(jnp.float32)]
  if fp8_x:  # [Kb, R]: a block's row scales contiguous; padded rows' scales 0
    operands.append(jnp.pad(x_scale_MKb.astype(jnp.float32), ((0, rows - m), (0, 0))).T)
  return pl.pallas_call(
      functools.partial(_kernel, blocks=k // BLOCK // splits, block_n=tiling.block_n,
                        fp8_x=fp8_x),
      out_shape=jax.ShapeDtypeStruct((splits, n, rows), jnp.float32),
      grid=(n // tiling.block_n, splits),
      compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps,
                                              num_stages=tiling.num_stages),
      interpret=interpret, name="fp8_rows_triton",
  )(*operands)
