"""A few rows against a block-scaled FP8 weight (jspec.pallas_kernels.fp8_gemm): the kernel, in
interpret mode here, against float32 NumPy on the dequantized weight (e4m3 value x its block's
scale, the published checkpoints' meaning of `weight_scale_inv`)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jspec.pallas_kernels.fp8_gemm import (BLOCK, Fp8Tiling, choose_splits, fits_kernel,
                                           fp8_matmul)

# (rows, K, N, K slices): one row, rows off the 16-row tile, several blocks per slice.
CASES = [(1, 256, 128, 2), (3, 384, 256, 3), (16, 256, 384, 1), (17, 512, 128, 4),
         (64, 256, 256, 2)]


def _dequantized(w8, scale_KbNb):
  return (np.asarray(w8).astype(np.float32)
          * np.repeat(np.repeat(scale_KbNb, BLOCK, axis=0), BLOCK, axis=1))


@pytest.mark.parametrize("rows, k, n, splits", CASES)
def test_fp8_matmul_equals_the_dequantized_product(rows, k, n, splits):
  rng = np.random.default_rng(rows * 1000 + k + n)
  x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
  w8 = np.clip(rng.standard_normal((k, n)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  scale = rng.uniform(1e-4, 1e-2, (k // BLOCK, n // BLOCK)).astype(np.float32)
  y = np.asarray(fp8_matmul(x, jnp.asarray(w8), jnp.asarray(scale), splits=splits), np.float32)
  x32, w32 = np.asarray(x, np.float32), _dequantized(w8, scale)
  exact = x32 @ w32
  assert y.shape == (rows, n) and np.isfinite(y).all()  # interpret mode fills with NaN
  # e4m3 -> bf16 is exact (3 mantissa bits into 7); products summed in float32; the one
  # rounding that matters is the bf16 output's (2^-9 relative), plus float32 sums' error.
  bound = 2.0 ** -8 * np.abs(exact) + 1e-5 * (np.abs(x32) @ np.abs(w32))
  assert (np.abs(y - exact) <= bound).all()


def test_fp8_matmul_refuses_what_it_cannot_take():
  x = jnp.ones((2, 256), jnp.bfloat16)
  w8 = jnp.ones((256, 128), jnp.float8_e4m3fn)
  scale = jnp.ones((2, 1), jnp.float32)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    fp8_matmul(x, w8.astype(jnp.bfloat16), scale)
  with pytest.raises(ValueError, match="scales"):
    fp8_matmul(x, w8, jnp.ones((1, 1), jnp.float32))
  with pytest.raises(ValueError, match="M <= 64"):
    fp8_matmul(jnp.ones((65, 256), jnp.bfloat16), w8, scale)
  with pytest.raises(ValueError, match="slices"):
    fp8_matmul(x, w8, scale, splits=4)


def test_shapes_and_splits():
  assert fits_kernel(1, 4096, 12288, (128, 128))
  assert not fits_kernel(65, 4096, 12288, (128, 128))
  assert not fits_kernel(1, 4096, 12288, (64, 64))     # another block size: XLA's path
  assert not fits_kernel(1, 4000, 12288, (128, 128))
  # Qwen3-8B's down projection on an H200 (132 SMs): 32 column blocks, K = 96 blocks.
  splits = choose_splits(12288, 4096, 132)
  assert 12288 % (splits * BLOCK) == 0 and 12288 // splits >= 2 * BLOCK
  assert splits * 32 >= 132
  assert choose_splits(256, 128, 132) == 1  # a slice keeps two blocks at least


@pytest.mark.parametrize("tiling", [Fp8Tiling(col_blocks=2), Fp8Tiling(num_warps=8, num_stages=4)])
def test_fp8_matmul_tilings_agree(tiling):
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((5, 384)), jnp.bfloat16)
  w8 = jnp.asarray(np.clip(rng.standard_normal((384, 256)) * 100, -448, 448)
                   .astype(ml_dtypes.float8_e4m3fn))
  scale = jnp.asarray(rng.uniform(1e-4, 1e-2, (3, 2)), jnp.float32)
  default = np.asarray(fp8_matmul(x, w8, scale, splits=3), np.float32)
  tiled = np.asarray(fp8_matmul(x, w8, scale, splits=3, tiling=tiling), np.float32)
  # The same products and float32 sums (the order inside a dot may differ): within one
  # rounding of the bf16 output.
  np.testing.assert_allclose(tiled, default, rtol=2.0 ** -7, atol=0)
