"""The residual add + RMSNorm and a projection's K-slice partials in one kernel
(jspec.pallas_kernels.norm_product), in interpret mode: h = x + delta rounded to the stream's
dtype bit for bit; each slice's partials against float64 NumPy of the normed row (computed as
rms_norm computes it, in float32) times the weight's rows of that slice, for bf16 weights
[D, N] and FP8 weights [N, D] with one scale per 128 x 128 block (distinct powers of two, so
that a block read with another's scale fails)."""

import ml_dtypes
import numpy as np
import pytest
import jax.numpy as jnp

from jspec.pallas_kernels import norm_product
from jspec.pallas_kernels.norm_product import BLOCK_COLS, SLICE_ROWS, add_norm_partials

RUN_SEED = 20261203
EPS = 1e-6


def _normed(x, delta, scale, zero_centered):
  """(h, norm(h)) in x's dtype, each step in float32 as the norm kernels compute it."""
  dtype = x.dtype
  h = (x.astype(np.float32) + delta.astype(np.float32)).astype(dtype)
  h32 = h.astype(np.float32)
  inv_rms = (1.0 / np.sqrt((h32 * h32).sum(axis=1, dtype=np.float32) / h.shape[1]
                           + np.float32(EPS))).astype(np.float32)
  normed = h32 * inv_rms[:, None]
  s32 = scale.astype(np.float32)
  if zero_centered:
    out = (normed * (1.0 + s32)).astype(dtype)
  else:
    out = (s32 * normed.astype(dtype).astype(np.float32)).astype(dtype)
  return h, out


def _check_partials(parts, out, w_KN, rows):
  """parts [S, N, M] against float64 sums of each slice's terms, within 4e-3 of the slice's
  sum of |terms|: a bfloat16 value of norm(h) rounded the other way (float32 rsqrt against
  NumPy's) moves a sum by one ulp, at most 2^-7, of one of its 128 terms; a block misscaled
  moves it by half its terms at least."""
  parts = np.asarray(parts, np.float64)
  slices = w_KN.shape[0] // SLICE_ROWS
  assert parts.shape == (slices, w_KN.shape[1], rows)
  out64 = out.astype(np.float64)
  for s in range(slices):
    k = slice(s * SLICE_ROWS, (s + 1) * SLICE_ROWS)
    terms = out64[:, k, None] * w_KN[None, k, :]          # [M, K/S, N]
    want = terms.sum(axis=1).T                              # [N, M]
    bound = 4e-3 * np.abs(terms).sum(axis=1).T + 1e-30
    assert (np.abs(parts[s] - want) <= bound).all(), (s, np.abs(parts[s] - want).max())


def _inputs(rng, rows, width, dtype):
  x = (rng.standard_normal((rows, width)) * 2).astype(dtype)
  delta = rng.standard_normal((rows, width)).astype(dtype)
  scale = (1 + 0.2 * rng.standard_normal(width)).astype(dtype)
  return x, delta, scale


CASES = [(rows, width, cols, dtype, zc)
         for rows, width, cols, dtype, zc in [
             (1, 256, 256, ml_dtypes.bfloat16, False), (2, 512, 128, ml_dtypes.bfloat16, True),
             (3, 256, 384, np.float32, False), (1, 384, 256, ml_dtypes.bfloat16, True),
             (16, 256, 128, ml_dtypes.bfloat16, False), (1, 2048, 128, ml_dtypes.bfloat16, False)]]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_bf16_weight_partials_and_h(case):
  rows, width, cols, dtype, zero_centered = CASES[case]
  rng = np.random.default_rng([RUN_SEED, case])
  x, delta, scale = _inputs(rng, rows, width, dtype)
  w = (rng.standard_normal((width, cols)) / np.sqrt(width)).astype(ml_dtypes.bfloat16)
  h, parts = add_norm_partials(jnp.asarray(x), jnp.asarray(delta), jnp.asarray(scale),
                               jnp.asarray(w), eps=EPS, zero_centered=zero_centered)
  h_want, out = _normed(x, delta, scale, zero_centered)
  np.testing.assert_array_equal(np.asarray(h).view(np.uint8), h_want.view(np.uint8))
  _check_partials(parts, out, w.astype(np.float64), rows)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fp8_weight_partials_read_each_blocks_scale(case):
  rows, width, cols, dtype, zero_centered = CASES[case]
  rng = np.random.default_rng([RUN_SEED, 100 + case])
  x, delta, scale = _inputs(rng, rows, width, dtype)
  w8 = rng.uniform(-448, 448, (cols, width)).astype(ml_dtypes.float8_e4m3fn)
  # Distinct powers of two (2^-4 down), one a block: a block read with another's scale, or
  # the scale's two axes swapped, changes its terms by a factor of 2 at least.
  blocks = (cols // 128) * (width // 128)
  block_scale = np.exp2(-4.0 - rng.permutation(blocks)).reshape(cols // 128, width // 128)
  block_scale = block_scale.astype(np.float32)
  h, parts = add_norm_partials(jnp.asarray(x), jnp.asarray(delta), jnp.asarray(scale),
                               jnp.asarray(w8), jnp.asarray(block_scale), eps=EPS,
                               zero_centered=zero_centered)
  h_want, out = _normed(x, delta, scale, zero_centered)
  np.testing.assert_array_equal(np.asarray(h).view(np.uint8), h_want.view(np.uint8))
  w_KN = (w8.astype(np.float64)
          * np.repeat(np.repeat(block_scale, 128, axis=0), 128, axis=1)).T
  _check_partials(parts, out, w_KN, rows)


def test_the_slices_sum_to_the_product_of_the_normed_row():
  """What a consumer reads: sum over S of partials[s].T is norm(h) @ w."""
  rng = np.random.default_rng([RUN_SEED, 7])
  x, delta, scale = _inputs(rng, 1, 1024, ml_dtypes.bfloat16)
  w = (rng.standard_normal((1024, 256)) / 32).astype(ml_dtypes.bfloat16)
  _, parts = add_norm_partials(jnp.asarray(x), jnp.asarray(delta), jnp.asarray(scale),
                               jnp.asarray(w), eps=EPS)
  _, out = _normed(x, delta, scale, False)
  want = out.astype(np.float64) @ w.astype(np.float64)
  got = np.asarray(parts, np.float64).sum(axis=0).T
  bound = 4e-3 * (np.abs(out.astype(np.float64)) @ np.abs(w.astype(np.float64)))
  assert (np.abs(got - want) <= bound).all()


@pytest.mark.parametrize("bad", ["rows", "width", "cols", "fp8_dtype", "fp8_scale", "delta"])
def test_shapes_it_does_not_take_are_refused(bad):
  rows, width, cols = 1, 256, 128
  rows = norm_product.MAX_ROWS + 1 if bad == "rows" else rows
  width = 200 if bad == "width" else width
  cols = 96 if bad == "cols" else cols
  x = jnp.ones((rows, width), jnp.bfloat16)
  delta = jnp.ones((rows, width + (bad == "delta")), jnp.bfloat16)
  scale = jnp.ones((width,), jnp.bfloat16)
  if bad.startswith("fp8"):
    w = jnp.ones((cols, width), jnp.bfloat16 if bad == "fp8_dtype" else norm_product.E4M3)
    ws = jnp.ones((cols // 128, width // 128 + (bad == "fp8_scale")), jnp.float32)
  else:
    w, ws = jnp.ones((width, cols), jnp.bfloat16), None
  with pytest.raises(ValueError, match="add_norm_partials takes"):
    add_norm_partials(x, delta, scale, w, ws, eps=EPS)


def test_block_sizes_are_one_fp8_block():
  """A program's slice and column block are one 128 x 128 FP8 block: its one scale."""
  assert SLICE_ROWS == BLOCK_COLS == norm_product.FP8_BLOCK
