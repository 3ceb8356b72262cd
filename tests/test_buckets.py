"""Bucket shapes: every sequence fits its cache bucket with a verify window to spare, and the
capped bucket is a whole number of 128-slot tiles (a cap of 16-slot granularity made XLA copy
the cache every step)."""

import numpy as np
import pytest

from jspec.models.decode_attention import split_plan
from jspec.shapes import buckets


@pytest.mark.parametrize("seed", range(4))
def test_cache_buckets_hold_the_sequence_and_tile_by_128(seed):
  rng = np.random.default_rng(seed)
  for _ in range(200):
    max_model_len = int(rng.integers(16, 40000))
    k = int(rng.integers(0, 8))
    total = int(rng.integers(1, max_model_len + 1))
    slots = buckets.cache_bucket(total, k, max_model_len)
    assert slots >= total + k + 1  # the last verify window's writes land inside
    assert slots % 128 == 0
    cap = buckets.max_cache_slots(max_model_len, k)
    assert cap - 128 < max_model_len + k + 1 <= cap  # the least whole number of tiles
    assert slots <= cap
    k_splits, block_k = split_plan(slots)
    assert block_k == 128 and (slots // block_k) % k_splits == 0


def test_short_sequences_share_power_of_two_buckets():
  assert [buckets.cache_bucket(n, 3, 8192) for n in (1, 124, 125, 1000, 5000)] == [
      128, 128, 256, 1024, 8192]
  assert buckets.cache_bucket(8192, 3, 8192) == 8320  # the cap: 8196 slots, 65 tiles
