"""The merge of flash-decoding's chunks (jspec.pallas_kernels.mla_merge, interpreted on CPU)
against a float64 NumPy evaluation of the softmax over chunks: chunk counts that are and are
not powers of two (1 through the 132 a batch-1 step takes on an H100), chunks and whole rows
that saw nothing (log-sum-exp -inf), every column block width, bfloat16 results; and the
column blocks' choice, which spreads a batch-1 merge over the GPU's SMs."""

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.pallas_kernels.mla_merge import merge_chunks, merge_columns


def _reference(parts_BKRC, lse_BKR):
  """sum_k exp(lse_k - logsumexp(lse)) parts_k per row; rows with every lse -inf: zeros."""
  parts, lse = parts_BKRC.astype(np.float64), lse_BKR.astype(np.float64)
  top = np.max(lse, axis=1)
  top = np.where(np.isfinite(top), top, 0.0)
  weights = np.exp(lse - top[:, None])
  total = weights.sum(axis=1)
  out = np.einsum("bkr,bkrc->brc", weights, parts)
  return np.where(total[..., None] > 0, out / np.where(total > 0, total, 1.0)[..., None], 0.0)


# (batch, chunks, rows, C, block_cols)
CASES = [(1, 1, 16, 16, None), (2, 2, 5, 32, 16), (1, 3, 32, 64, 32), (3, 7, 16, 48, 16),
         (1, 132, 16, 64, 32), (2, 5, 64, 128, 128), (1, 17, 3, 32, None)]


@pytest.mark.parametrize("seed", range(len(CASES)))
def test_merge_equals_the_softmax_over_chunks(seed):
  b, k, r, c, cols = CASES[seed]
  rng = np.random.default_rng(seed)
  parts = rng.standard_normal((b, k, r, c)).astype(np.float32)
  # Chunks' log-sum-exps spread over ~30 nats, so that some weigh ~0 beside others.
  lse = (rng.standard_normal((b, k, r)) * 10).astype(np.float32)
  lse[rng.random((b, k, r)) < 0.2] = -np.inf           # chunks that saw none of a row's slots
  lse[0, :, r - 1] = -np.inf                           # a row no chunk saw: zeros
  got = merge_chunks(jnp.asarray(parts), jnp.asarray(lse), dtype=jnp.float32, block_cols=cols)
  want = _reference(parts, lse)
  assert got.shape == (b, r, c) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert not np.asarray(got)[0, r - 1].any()


@pytest.mark.parametrize("rows", [1, 16, 24])
def test_merge_reads_only_the_live_rows(rows):
  """Rows past `rows` (a tile's padding, which the kernels leave unwritten) are never read:
  NaN there leaves the live rows' merge exact, and the result holds the live rows only."""
  rng = np.random.default_rng(rows)
  parts = rng.standard_normal((2, 5, 64, 32)).astype(np.float32)
  lse = (rng.standard_normal((2, 5, 64)) * 5).astype(np.float32)
  want = _reference(parts[:, :, :rows], lse[:, :, :rows])
  parts[:, :, rows:], lse[:, :, rows:] = np.nan, np.nan
  got = merge_chunks(jnp.asarray(parts), jnp.asarray(lse), dtype=jnp.float32, rows=rows)
  assert got.shape == (2, rows, 32)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_merge_rounds_once_to_bfloat16():
  """Sums in float32, one rounding at the end: within bfloat16's unit roundoff (2^-8 of the
  value: 8 significant bits, round to nearest) of the exact merge, plus float32's error."""
  rng = np.random.default_rng(11)
  parts = rng.standard_normal((2, 6, 32, 64)).astype(np.float32)
  lse = rng.standard_normal((2, 6, 32)).astype(np.float32)
  got = np.asarray(merge_chunks(jnp.asarray(parts), jnp.asarray(lse), dtype=jnp.bfloat16),
                   np.float32)
  want = _reference(parts, lse)
  assert np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 1e-6)


@pytest.mark.parametrize("splits, programs_per_column, c, sms, cols", [
    (132, 16, 512, 132, 32),   # batch 1, 16 heads: 256 programs, each [256, 32] (8192 values)
    (66, 128, 512, 132, 64),   # batch 1, 128 heads: 1024 programs of [128, 64]
    (4, 512, 512, 132, 512),   # batch 32, 16 heads: whole rows, 512 programs
    (132, 1, 512, 132, 16),    # one row: as narrow as blocks go (32 programs)
    (2, 1, 48, 132, 16),       # C = 48: 16 divides it, 32 does not
    (2, 1, 512, 1, 512),       # the interpreter's one SM: whole rows
])
def test_column_blocks_spread_the_merge_over_the_sms(splits, programs_per_column, c, sms, cols):
  assert merge_columns(splits, programs_per_column, c, sms) == cols


def test_shapes_the_merge_cannot_tile_are_refused():
  with pytest.raises(ValueError, match="C a multiple of 16"):
    merge_chunks(jnp.zeros((1, 2, 16, 20)), jnp.zeros((1, 2, 16)), dtype=jnp.float32)
  with pytest.raises(ValueError, match="C a multiple of 16"):
    merge_chunks(jnp.zeros((1, 2, 16, 32)), jnp.zeros((1, 3, 16)), dtype=jnp.float32)
  with pytest.raises(ValueError, match="does not divide C=48"):
    merge_chunks(jnp.zeros((1, 2, 16, 48)), jnp.zeros((1, 2, 16)), dtype=jnp.float32,
                 block_cols=32)
  with pytest.raises(ValueError, match="1 to R=16 rows, got rows=17"):
    merge_chunks(jnp.zeros((1, 2, 16, 32)), jnp.zeros((1, 2, 16)), dtype=jnp.float32,
                 rows=17)
