"""Token times read off the loop's clock (jspec.timing): a clock value placed linearly inside
the dispatch that reached it, and the latency figures serving benchmarks report."""

import numpy as np
import pytest

from jspec.timing import Clock, chunk_gaps, latency, pooled_latency


def _clock():
  clock = Clock(zero_s=0.1)           # the batched prefill ended at 0.1 s
  clock.add(10, start_s=0.05, end_s=1.1)  # launched before the prefill ended: starts at 0.1
  clock.add(14, start_s=1.2, end_s=1.6)   # 0.1 s idle between the dispatches
  return clock


@pytest.mark.parametrize("value, seconds", [(0, 0.1), (5, 0.6), (10, 1.1), (11, 1.3),
                                            (14, 1.6)])
def test_a_clock_value_is_placed_linearly_inside_its_dispatch(value, seconds):
  assert _clock().seconds([value])[0] == pytest.approx(seconds)


def test_times_never_go_back_across_dispatches():
  rng = np.random.default_rng(3)
  values = np.sort(rng.integers(0, 15, size=200))
  assert np.all(np.diff(_clock().seconds(values)) >= 0)


def test_a_dispatch_that_starts_before_the_last_ended_starts_at_its_end():
  clock = Clock(zero_s=0.0)
  clock.add(4, 0.0, 1.0)
  clock.add(8, 0.5, 2.0)  # the launch returned while the device still ran the last one
  assert clock.segments[1].start_s == 1.0
  assert clock.seconds([6])[0] == pytest.approx(1.5)


def test_a_prefill_seen_ready_after_the_next_dispatch_ended_is_placed_at_its_launch():
  # The prefill's ready time (0.5 s) came after the first dispatch, which reads its outputs,
  # had ended (0.3 s): the stamp was late. Tokens of that dispatch must still come after the
  # prefill's own (clock 0), not all at one time with them.
  clock = Clock(zero_s=0.5)
  clock.add(4, start_s=0.2, end_s=0.3)
  assert clock.zero_s == 0.2
  times = clock.seconds([0, 1, 4])
  assert times[0] == 0.2 and times[0] < times[1] < times[2] == pytest.approx(0.3)


def test_chunks_are_tokens_available_together():
  times = [1.0, 1.0, 1.0, 2.0, 2.0, 3.5]  # three speculative steps' worth of tokens
  np.testing.assert_allclose(chunk_gaps(times), [1.0, 1.5])
  lat = latency(times)
  assert lat.ttft_s == 1.0
  assert lat.tpot_s == pytest.approx(2.5 / 5)
  assert lat.itl_p50_s == pytest.approx(1.25) and lat.itl_p99_s == pytest.approx(1.495)


def test_one_token_has_a_ttft_and_no_gaps():
  lat = latency([0.25])
  assert (lat.ttft_s, lat.tpot_s, lat.itl_p50_s, lat.itl_p99_s) == (0.25, None, None, None)


def test_pooled_latency_takes_medians_of_completions_and_percentiles_of_all_gaps():
  completions = [[0.1, 0.2, 0.3], [0.2, 0.6], [0.4]]
  lat = pooled_latency(completions)
  assert lat.ttft_s == pytest.approx(0.2)
  assert lat.tpot_s == pytest.approx(np.median([0.1, 0.4]))
  gaps = [0.1, 0.1, 0.4]
  assert lat.itl_p50_s == pytest.approx(np.percentile(gaps, 50))
  assert lat.itl_p99_s == pytest.approx(np.percentile(gaps, 99))
