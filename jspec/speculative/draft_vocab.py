"""Choosing a reduced draft vocabulary: the tokens that make up most of some text.

An MTP head drafting over all V tokens reads its whole [D, V] lm_head once per drafted token
(1.24 GB for Qwen3-8B); restricted to the N most frequent tokens it reads N/V of that, and
misses only drafts the target would rarely have produced (FR-Spec, EAGLE-3). Pass the ids as
`speculative_config={"method": "mtp", ..., "draft_vocab": ids}`.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


def most_frequent_tokens(token_streams: Iterable, size: int, vocab_size: int) -> tuple[int, ...]:
  """The `size` most frequent token ids over the streams, most frequent first (ties by id)."""
  if not 1 <= size <= vocab_size:
    raise ValueError(f"size={size} must be in [1, vocab_size={vocab_size}]")
  counts = np.zeros(vocab_size, np.int64)
  for stream in token_streams:
    ids = np.asarray(stream, np.int64).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
      raise ValueError(f"token ids outside [0, {vocab_size}) in the streams")
    counts += np.bincount(ids, minlength=vocab_size)
  order = np.argsort(-counts, kind="stable")
  return tuple(int(t) for t in order[:size])


def coverage(token_streams: Iterable, ids) -> float:
  """Fraction of the streams' tokens that are in `ids`."""
  kept = np.zeros(max(ids) + 1, bool)
  kept[list(ids)] = True
  total = hit = 0
  for stream in token_streams:
    stream = np.asarray(stream, np.int64).ravel()
    total += stream.size
    inside = stream[stream < kept.size]
    hit += int(kept[inside].sum())
  return hit / max(total, 1)
