"""Rows quantized to e4m3 per 128 channels in one kernel (jspec.pallas_kernels.quantize_rows):
value for value fp8_gemm.quantize_activations (DeepSeek-V3's act_quant) in the layout the FP8
products read, padded rows zeros; in interpret mode here, and compiled on a GPU against XLA's
own divisions."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jspec.pallas_kernels.fp8_gemm import BLOCK, quantize_activations
from jspec.pallas_kernels.quantize_rows import MIN_SCALE, program_rows, quantize_rows

RUN_SEED = 20261202


def _rows(rng, m, k, dtype):
  """Rows whose groups span many magnitudes (a group of zeros among them)."""
  x = rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-6, 4, (m, k // BLOCK)).repeat(BLOCK, 1)
  x[rng.integers(m), :BLOCK] = 0.0
  return jnp.asarray(x, dtype)


def _reference(x_MK, padded_rows, tile_rows):
  """quantize_activations, padded and laid out as quantize_rows' results, in NumPy."""
  x8, scale = (np.asarray(a.astype(jnp.float32)) for a in quantize_activations(x_MK))
  m, k = x8.shape
  x8 = np.concatenate([x8, np.zeros((padded_rows - m, k), np.float32)])
  scale = np.concatenate([scale, np.full((padded_rows - m, k // BLOCK), MIN_SCALE, np.float32)])
  return x8, scale.reshape(padded_rows // tile_rows, tile_rows, k // BLOCK).transpose(0, 2, 1)


def _assert_equal_to_reference(x_MK, padded_rows, tile_rows=None):
  x8, scale = quantize_rows(x_MK, padded_rows, tile_rows)
  assert x8.dtype == ml_dtypes.float8_e4m3fn and scale.dtype == np.float32
  want_x8, want_scale = _reference(x_MK, padded_rows, tile_rows or padded_rows)
  np.testing.assert_array_equal(np.asarray(x8.astype(jnp.float32)), want_x8)
  np.testing.assert_array_equal(np.asarray(scale), want_scale)


# (M, K, P, T): a prefill chunk padded to its 128-row tile; rows filling it; tiles of 16 and
# 8 rows as the grouped experts' slots take them; one row.
CASES = [(100, 256, 128, None), (128, 384, 128, None), (40, 256, 64, 16), (24, 128, 24, 8),
         (1, 128, 8, 8)]


@pytest.mark.parametrize("m, k, padded, tile", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equals_quantize_activations_padded_and_laid_out(m, k, padded, tile, dtype):
  rng = np.random.default_rng([RUN_SEED, m, k, padded])
  _assert_equal_to_reference(_rows(rng, m, k, dtype), padded, tile)


def test_a_group_largest_value_maps_to_e4m3_max_and_the_rest_round_to_nearest():
  # The published formula, independently of quantize_activations: scale = amax / 448 (as XLA
  # computes it: amax times 448's float32 reciprocal), each value x / scale rounded to the
  # nearest e4m3.
  rng = np.random.default_rng(RUN_SEED)
  x = np.asarray(_rows(rng, 16, 512, jnp.float32))
  x8, scale = quantize_rows(jnp.asarray(x), 16)
  groups = x.reshape(16, 4, BLOCK)
  amax = np.abs(groups).max(-1)
  want_scale = np.maximum(amax, 1e-12).astype(np.float32) * np.float32(1 / 448.0)
  np.testing.assert_array_equal(np.asarray(scale)[0].T, want_scale)
  want_x8 = (groups / want_scale[..., None]).astype(ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(np.asarray(x8.astype(jnp.float32)).reshape(16, 4, BLOCK),
                                want_x8.astype(np.float32))
  assert (np.abs(np.asarray(x8.astype(jnp.float32))).reshape(16, 4, BLOCK).max(-1)[amax > 0]
          == 448.0).all()


def test_program_rows_divide_the_tile():
  for tile in (8, 16, 24, 32, 64, 128, 640):
    rows = program_rows(tile)
    assert tile % rows == 0 and rows & (rows - 1) == 0 and 8 <= rows <= 32


@pytest.mark.parametrize("shape, dtype, padded, tile", [
    ((4, 100), jnp.float32, 8, None),       # K not whole groups
    ((10, 128), jnp.float32, 8, None),      # fewer padded rows than rows
    ((4, 128), jnp.float32, 16, 12),        # a tile not a multiple of 8
    ((4, 128), jnp.float32, 24, 16),        # tiles not dividing the padded rows
    ((4, 128), jnp.int32, 8, None),         # not floats
])
def test_refuses_what_it_cannot_take(shape, dtype, padded, tile):
  with pytest.raises(ValueError, match="quantize_rows takes"):
    quantize_rows(jnp.zeros(shape, dtype), padded, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, padded, tile", [(512, 2048, 512, None), (300, 4096, 384, None),
                                                (1000, 768, 1024, 16), (96, 12288, 128, 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_equals_xla_quantization_bit_for_bit(m, k, padded, tile, dtype):
  """Compiled, against quantize_activations compiled by XLA on the same GPU: the divisions are
  IEEE ones in both (an approximate division would move some values by one e4m3 step)."""
  rng = np.random.default_rng([RUN_SEED, m, k])
  _assert_equal_to_reference(_rows(rng, m, k, dtype), padded, tile)
