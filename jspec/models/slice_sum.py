"""A batch-1 step's attention output projection on one GPU, its K-slice sum left to the kernel
that reads it.

Why: one row by Qwen3-30B-A3B's o_proj (4096 x 2048) falls under XLA's rule that rewrites a
small one-row dot into a reduction, so it runs as a GEMM of the row and its copy
(jspec.pallas_kernels.skinny_gemm): the copy is a concatenation (1.1 µs a layer on an H200),
XLA splits the GEMM's K and sums the slices, rounds and takes the first row in a fusion of its
own (1.2 µs). Here the attention kernel writes the row twice (as for a tp shard's row product,
Attention._doubles_row), the product is K slices' float32 partials (one batched GEMM), and the
MoE layer's residual add + RMSNorm + router kernel sums them as it reads the row
(jspec.pallas_kernels.norm_router). Any other reader sums them first (DeferredSum's `+`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.sharding.tensor_parallel import DeferredSum, k_slice_partials

# Whether a batch-1 one-GPU step leaves o_proj's K-slice sum to the MoE layer's norm kernel
# where the layer takes it (set per attention layer at load: Attention.o_slices). Benchmarks
# switch it off to time the two.
ONE_GPU_O_SLICES = True
O_K_SLICES = 4  # as the q / k / v product's (row_kernels.QKV_K_SLICES)
TILE = 64  # each slice whole 64-row tiles of the weight


def o_slices() -> int:
  """O_K_SLICES on a GPU (the rule worked around is XLA's GPU compiler's) where
  ONE_GPU_O_SLICES; 0 elsewhere."""
  from jspec.pallas_kernels import platform
  return O_K_SLICES if ONE_GPU_O_SLICES and platform.on_gpu() else 0


class SliceSum(DeferredSum):
  """K slices' float32 partials [S, B, T', D] of a row product of `tokens` rows (T' = 2 for
  one row: the row and its copy), and the product's dtype."""

  def __init__(self, partials_SBTD, dtype, tokens: int):
    self.partials_SBTD, self.tokens, self.dtype = partials_SBTD, tokens, jnp.dtype(dtype)
    b, _, d = partials_SBTD.shape[1:]
    self.shape = (b, tokens, d)

  def reduced(self):
    return jnp.sum(self.partials_SBTD, axis=0)[:, :self.tokens].astype(self.dtype)


def takes(k: int, slices: int) -> bool:
  """Whether K input rows cut into `slices` slices of whole tiles."""
  return slices > 1 and k % (slices * TILE) == 0


def row_twice_product(x_BTI, w_IO, in_axes: int, slices: int) -> SliceSum:
  """x [1, 2, *in] (one row written twice) times w [*in, D] as K slices' partials."""
  k = 1
  for size in w_IO.shape[:in_axes]:
    k *= size
  b, t = x_BTI.shape[:2]
  if (b, t) != (1, 2):
    raise ValueError(f"row_twice_product takes one row written twice, x [1, 2, ...], got "
                     f"{x_BTI.shape}")
  parts_SMD = k_slice_partials(x_BTI.reshape(t, k), w_IO.reshape(k, -1), slices)
  return SliceSum(parts_SMD[:, None], x_BTI.dtype, tokens=1)
