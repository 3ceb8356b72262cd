"""The benchmarks' call timer (jspec.bench.roofline.seconds_per_call) against a simulated
device whose every time is known: a host that spends `host_s` dispatching each call and a
device that runs calls one after another, `device_s` each, starting a call once it is both
dispatched and the previous one is done. Its throughput, the figure the timer must return, is
max(host_s, device_s) a call, whatever fixed wait a batch adds at its start and its end."""

import numpy as np
import pytest

from jspec.bench import roofline

RUN_SEED = 20261203


class SimulatedDevice:
  """A clock and a queue: `call` dispatches (the host's clock moves on by host_s), and the
  returned handle's block_until_ready moves the clock to the call's end on the device."""

  def __init__(self, host_s: float, device_s: float, sync_s: float = 0.0):
    self.host_s, self.device_s, self.sync_s = host_s, device_s, sync_s
    self.now = 0.0
    self.device_free = 0.0
    self.args_seen = []

  def clock(self) -> float:
    return self.now

  def call(self, *args):
    self.args_seen.append(args)
    self.now += self.host_s
    self.device_free = max(self.now, self.device_free) + self.device_s
    return _Pending(self, self.device_free)


class _Pending:
  def __init__(self, device: SimulatedDevice, done: float):
    self.device, self.done = device, done

  def block_until_ready(self):
    self.device.now = max(self.device.now, self.done) + self.device.sync_s
    return self


def _timed(device, arg_sets, **kwargs):
  return roofline.seconds_per_call(device.call, arg_sets, clock=device.clock, **kwargs)


@pytest.mark.parametrize("case", range(12))
def test_the_figure_is_the_throughput_and_a_batchs_fixed_wait_does_not_enter(case):
  rng = np.random.default_rng([RUN_SEED, case])
  device_s = float(rng.uniform(1e-4, 0.2))   # short kernels to long programs
  # Dispatch from a tenth of the call (overlapped) to twice it (the host the limit).
  host_s = device_s * float(rng.choice([0.1, 0.5, 0.9, 2.0]))
  sync_s = float(rng.uniform(0, 5e-3))       # the wait for the last call's result
  device = SimulatedDevice(host_s, device_s, sync_s)
  got = _timed(device, [("a",), ("b",)])
  assert got == pytest.approx(max(host_s, device_s), rel=1e-9)


def test_calls_rotate_over_the_argument_sets():
  """Two warm-up calls, one alone, then a batch of 5 and one of 15 (calls of 1 ms, 5 ms a
  batch at least), the sets in turn from the call alone on, across batches (one pair:
  `batches=1`): no batch starts on the set the call before it used."""
  device = SimulatedDevice(0.0, 1e-3)
  _timed(device, [(0,), (1,), (2,)], batches=1)
  seen = [a[0] for a in device.args_seen]
  assert seen == [0, 1, 0] + [(1 + i) % 3 for i in range(5 + 15)]


@pytest.mark.parametrize("first_s,expected_short,pairs",
                         [(4e-4, 12, 3), (2e-2, 2, 3), (0.2, 1, 3)])
def test_batch_lengths_follow_the_calls_duration(first_s, expected_short, pairs):
  """Calls of 0.4 ms: batches of 12 and 36 (5 ms at least); of 20 ms: 2 and 6; over 50 ms:
  1 and 3; 3 pairs, after 2 warm-up calls and one timed alone."""
  device = SimulatedDevice(0.0, first_s)
  _timed(device, [()])
  assert len(device.args_seen) == 2 + 1 + pairs * 4 * expected_short


def test_a_slope_lost_in_the_clocks_jitter_falls_back_to_the_long_batches_mean():
  """Every batch takes the same time whatever its calls (all of it the final wait): the
  slope is zero, and the figure is the long batch's time per call, never zero or negative."""
  device = SimulatedDevice(0.0, 0.0, sync_s=2e-3)
  got = _timed(device, [()])
  assert got > 0
  assert got == pytest.approx(2e-3 / 6, rel=1e-9)   # 2 ms a call alone: batches of 2 and 6



class NoisyDevice(SimulatedDevice):
  """One batch in every `period` waits `stall_s` more at its end (another process on the GPU,
  a clock change): the medians must keep that batch out of the figure."""

  def __init__(self, host_s, device_s, stall_s, period):
    super().__init__(host_s, device_s)
    self.stall_s, self.period, self.blocks = stall_s, period, 0

  def call(self, *args):
    pending = super().call(*args)
    original = pending.block_until_ready

    def block():
      self.blocks += 1
      original()
      if self.blocks % self.period == 0:
        self.now += self.stall_s
      return pending
    pending.block_until_ready = block
    return pending


def test_a_stalled_batch_does_not_enter_the_figure():
  """Every fifth wait stalls 50 ms (warm-ups and the call alone included): the first pair's
  long batch. The medians leave it out; a mean of the batches would put the figure 4 ms off
  the device's 10 ms."""
  device = NoisyDevice(1e-3, 1e-2, stall_s=0.05, period=5)
  got = _timed(device, [()])
  assert got == pytest.approx(1e-2, rel=1e-9)
