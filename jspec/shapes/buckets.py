"""Fixed shapes for the compiled programs: a handful of buckets serve any request mix.

- batch buckets: multiples of the data-parallel width (dp x ep) times a power of two, so every
  shard gets the same number of rows;
- prompt buckets: powers of two from 16;
- cache buckets: powers of two from 128, large enough for the longest sequence plus one verify
  window (k + 1 slots), capped at max_model_len + k + 1 rounded up to a multiple of 128. The
  slack guarantees that every cache and token-buffer write of a running sequence lands inside
  the bucket.

Why 128: the cap is the bucket of the longest contexts, and XLA's attention GEMMs tile the
slots by up to 128. At a cap of 8224 slots (a multiple of 16 only) XLA padded, i.e. copied, the
whole value cache in every layer and step: Qwen3-8B at batch 8, context 8192 took 10.5 ms a
step, against 7.4 ms at 8320 slots (BENCHMARKS.md). The decode-attention kernel also splits a
128-multiple into full 128-slot blocks.
"""

from __future__ import annotations

MIN_PROMPT_BUCKET = 16
MIN_CACHE_BUCKET = 128
CACHE_SLOT_MULTIPLE = 128  # a multiple of the attention tiles; see above


def next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def batch_bucket(num_seqs: int, width: int) -> int:
  return width * next_pow2(-(-num_seqs // width))


def prompt_bucket(max_prompt_len: int, cache_len: int) -> int:
  return min(max(MIN_PROMPT_BUCKET, next_pow2(max_prompt_len)), cache_len)


def max_cache_slots(max_model_len: int, k: int) -> int:
  """The largest cache bucket: max_model_len + k + 1, rounded up to a multiple of 128."""
  return -(-(max_model_len + k + 1) // CACHE_SLOT_MULTIPLE) * CACHE_SLOT_MULTIPLE


def cache_bucket(max_total_len: int, k: int, max_model_len: int) -> int:
  """Slots for a sequence of `max_total_len` tokens (<= max_model_len) decoded k drafts a step."""
  needed = max_total_len + k + 1
  return min(max(MIN_CACHE_BUCKET, next_pow2(needed)), max_cache_slots(max_model_len, k))
