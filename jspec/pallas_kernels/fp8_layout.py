"""How a few-row FP8 product's work is laid over the GPU's SMs (jspec.pallas_kernels.fp8_gemm):
how many K slices, or balanced runs (fp8_block_kernel.partials' two forms), chosen by the SMs'
rounds of work items and, where PARTIALS_SHARE is set, by the bytes of the float32 partials the
slices leave at a step's rows."""

from __future__ import annotations

from jspec.pallas_kernels import decode_routing
from jspec.pallas_kernels.fp8_block_kernel import BLOCK

# The share of the persistent grid's rounds of work items (one item per SM a round) that a
# K-slice count must keep busy before a larger count is tried, and the most rounds it may take
# (each item pays its pipeline's fill and drain). 8 rounds were slower on both models timed
# (Qwen3-30B-A3B's q / k / v at 16 slices, whose sums its norm kernel reads: +5% a step), 6
# faster on DeepSeek-V3 in one run (-1.5%) (BENCHMARKS.md, "Norm kernels' loads before ...").
MIN_ROUND_FILL = 0.9
MAX_ROUNDS = 4


def round_fill(n: int, num_sms: int, splits: int) -> float:
  """The share of the persistent grid's rounds that `splits` K slices' items keep busy."""
  items = splits * (n // BLOCK)
  return items / (-(-items // num_sms) * num_sms)


# Where no K-slice count keeps MIN_ROUND_FILL of the rounds busy, the product's items run as
# equal runs of K steps over the programs (balanced_runs.BalancedRuns) instead.
BALANCED = True


# The K-slice partials (float32 [S, R, N], written by the kernel, read by their sum) grow with
# the rows, the weight does not: at 32 rows Qwen3-8B's q / k / v in 8 slices write and read
# half its e4m3 bytes again. PARTIALS_SHARE caps that share (partials_share): more slices are
# not tried, and balanced runs take a product that the slices left fill poorly; from 16 rows
# only (verify windows of several sequences; decode's 8 padded rows as measured, uncapped). A
# quarter: Qwen3-8B FP8's verify of 4 tokens at batch 8 (32 rows) 5.8% shorter (3.75 against
# 3.98 ms, three processes, one H200), 6 tokens 1.3%; an eighth, 2% shorter than a quarter at
# 2 tokens, 3.8% / 6.9% longer at 4 / 6 (BENCHMARKS.md, "The K-slice partials capped ...").
# None: slices by the SMs alone.
PARTIALS_SHARE: float | None = 0.25


def partials_share(k: int, slots: int, rows: int) -> float:
  """`slots` partials of `rows` rows (padded) written and read once, against K x N e4m3 bytes."""
  return 2 * 4 * slots * decode_routing.padded_tokens(rows) / k


def most_splits(k: int, rows: int) -> int | None:
  """The most K slices (a power of two) PARTIALS_SHARE allows at `rows`; None where unset or
  at 8 padded rows or fewer."""
  if PARTIALS_SHARE is None or decode_routing.padded_tokens(rows) <= 8:
    return None
  most = 1
  while 2 * most <= k // BLOCK and partials_share(k, 2 * most, rows) <= PARTIALS_SHARE:
    most *= 2
  return most


def choose_layout(k: int, n: int, num_sms: int, rows: int = 1) -> tuple[int, bool]:
  """(K slices, balanced): choose_splits' slices (at most most_splits(k, rows)) where they fill
  MIN_ROUND_FILL of their rounds, else balanced runs (when BALANCED)."""
  splits = choose_splits(k, n, num_sms, most_splits(k, rows))
  return splits, BALANCED and round_fill(n, num_sms, splits) < MIN_ROUND_FILL


def choose_splits(k: int, n: int, num_sms: int, most: int | None = None) -> int:
  """K slices (a power of two, whole blocks each, at most MAX_ROUNDS rounds of items and at
  most `most`): the fewest whose work items, one per (slice, 128-column block), keep
  MIN_ROUND_FILL of the rounds' SM slots busy (else the fullest, the fewest of equals).

  The items go round-robin over the SMs, so 192 column blocks on 132 SMs (Qwen3-8B's fused
  gate/up, no slices) leave 72 SMs idle in the second round: the product lasts two items'
  time for 1.45 items' work; two slices give 384 half-length items, three rounds 97% full."""
  col_blocks = n // BLOCK
  k_blocks = k // BLOCK
  candidates = [1 << i for i in range(k_blocks.bit_length()) if k_blocks % (1 << i) == 0
                and (i == 0 or (1 << i) * col_blocks <= MAX_ROUNDS * num_sms)
                and (most is None or 1 << i <= most)]
  good = [s for s in candidates if round_fill(n, num_sms, s) >= MIN_ROUND_FILL]
  return min(good) if good else max(candidates, key=lambda s: (round_fill(n, num_sms, s), -s))
