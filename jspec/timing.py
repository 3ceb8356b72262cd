"""When each generated token was available, read off the loop's clock.

The decode loop runs on device with no host round trip, so the host never sees a token
appear. Instead every token carries the loop's clock value at which it was emitted
(`DecodeState.emitted_at_BS`: 0 for a first token of the batched prefill, step + 1 for a
token of decode step `step`), and the host knows when each dispatch (a run of clock values)
began and ended. A token's time is its clock value placed linearly inside its dispatch:

    t(v) = start_i + (v - clock_{i-1}) / (clock_i - clock_{i-1}) x (end_i - start_i)

for the dispatch i with clock_{i-1} < v <= clock_i. Within a dispatch the steps are taken as
equally long: exact while only decode steps run (a whole call whose requests fit the slots),
an estimate where a dispatch also prefills prompts admitted on the way (those rounds are
longer). Times count from the call's start: offline requests all arrive then, so a
request's time to first token includes any wait for a slot.

Latency figures, as serving benchmarks (vLLM's, SGLang's) define them:
  - TTFT: time to the first token;
  - ITL: the gaps between successive *chunks* of a completion, a chunk being the tokens that
    became available together (a speculative step emits up to k + 1 at once, as a stream
    would deliver them);
  - TPOT: (time of the last token - TTFT) / (tokens - 1), the mean time per token after the
    first.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jspec import interrupt


@dataclasses.dataclass(frozen=True)
class Segment:
  """Clock values (clock_begin, clock_end] ran from start_s to end_s (from the call's start)."""
  clock_begin: int
  clock_end: int
  start_s: float
  end_s: float


class Clock:
  """Maps clock values to seconds from the call's start, over the segments seen so far."""

  def __init__(self, zero_s: float):
    self.zero_s = zero_s  # when clock value 0 was reached (the batched prefill's end)
    self.segments: list[Segment] = []

  def add(self, clock_end: int, start_s: float, end_s: float):
    """The next dispatch: it ran from start_s (or the end of the last one, if later) to end_s
    and left the clock at clock_end."""
    last = self.segments[-1] if self.segments else None
    begin = last.clock_end if last else 0
    if last is None and end_s <= self.zero_s:
      # The first dispatch, which needs the prefill's outputs, ended before the prefill was
      # seen ready: the thread that stamps that time woke late (a busy host). The dispatch's
      # launch is the better estimate, so that its tokens still come after the prefill's.
      self.zero_s = start_s
    start_s = max(start_s, last.end_s if last else self.zero_s)
    self.segments.append(Segment(begin, clock_end, start_s, max(end_s, start_s)))

  def seconds(self, values) -> np.ndarray:
    values = np.asarray(values, np.float64)
    if not self.segments:
      return np.full(values.shape, self.zero_s)
    ends = np.asarray([s.clock_end for s in self.segments])
    index = np.minimum(np.searchsorted(ends, values, side="left"), len(self.segments) - 1)
    begin = np.asarray([s.clock_begin for s in self.segments])[index]
    end = ends[index]
    start_s = np.asarray([s.start_s for s in self.segments])[index]
    end_s = np.asarray([s.end_s for s in self.segments])[index]
    fraction = np.clip((values - begin) / np.maximum(end - begin, 1), 0.0, 1.0)
    return np.where(values <= 0, self.zero_s, start_s + fraction * (end_s - start_s))


@dataclasses.dataclass(frozen=True)
class Latency:
  ttft_s: float | None
  tpot_s: float | None
  itl_p50_s: float | None
  itl_p99_s: float | None


def chunk_gaps(token_times_s) -> np.ndarray:
  """Gaps between successive distinct availability times (chunks) of one completion."""
  return np.diff(np.unique(np.asarray(token_times_s, np.float64)))


def _percentiles(gaps) -> tuple[float | None, float | None]:
  if not len(gaps):
    return None, None
  p50, p99 = np.percentile(np.asarray(gaps, np.float64), [50, 99])
  return float(p50), float(p99)


def _tpot(times: np.ndarray) -> float | None:
  return float((times[-1] - times[0]) / (times.size - 1)) if times.size > 1 else None


def latency(token_times_s) -> Latency:
  """One completion's TTFT, TPOT and ITL percentiles (None where it has too few tokens)."""
  times = np.asarray(token_times_s, np.float64)
  if times.size == 0:
    return Latency(None, None, None, None)
  return Latency(float(times[0]), _tpot(times), *_percentiles(chunk_gaps(times)))


def pooled_latency(completions_token_times_s) -> Latency:
  """Over many completions: the median TTFT and TPOT, ITL percentiles over every gap."""
  times = [np.asarray(t, np.float64) for t in completions_token_times_s if len(t)]
  if not times:
    return Latency(None, None, None, None)
  tpots = [x for x in map(_tpot, times) if x is not None]
  gaps = np.concatenate([chunk_gaps(t) for t in times])
  return Latency(float(np.median([t[0] for t in times])),
                 float(np.median(tpots)) if tpots else None, *_percentiles(gaps))


class ReadyTime:
  """The time (perf_counter) at which a device array became ready, waited for on a thread
  of its own so that the caller goes on launching work."""

  def __init__(self, array):
    self._time = None
    self._thread = interrupt.start_thread(self._wait, array, name="jspec-ready-time")

  def _wait(self, array):
    jax.block_until_ready(array)
    self._time = time.perf_counter()

  def get(self) -> float:
    self._thread.join()
    return self._time
