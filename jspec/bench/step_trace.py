"""One decode step's kernels as a GPU ran them, from a profiler trace: each kernel's time and the
idle gap before it, by kernel and in order (benchmarks/step_kernels.py).

A `generate` call's trace is cut into steps at the host copies that end each loop iteration
(MemcpyD2H); `middle_step` takes the middle one of the most common length. Gaps under about
2 us are a graph's kernel-to-kernel launch latency; a negative gap is a kernel that started
before the one before it ended.
"""

from __future__ import annotations

import collections
import tempfile

import jax

from jspec.bench.profile import kernel_events


def traced_kernels(fn) -> list:
  """(start ns, end ns, name) of every kernel GPU 0 ran during fn(), sorted."""
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    jax.block_until_ready(fn())
    jax.profiler.stop_trace()
    return kernel_events(trace_dir)


def middle_step(kernels: list) -> list:
  """The kernels between two host copies, the middle run of the most common length."""
  cuts = [i for i, k in enumerate(kernels) if "MemcpyD2H" in k[2]]
  runs = [(a, b) for a, b in zip(cuts, cuts[1:])]
  if not runs:
    raise ValueError("no MemcpyD2H in the trace: cannot find the steps")
  common = collections.Counter(b - a for a, b in runs).most_common(1)[0][0]
  same = [(a, b) for a, b in runs if b - a == common]
  a, b = same[len(same) // 2]
  return kernels[a:b]


def step_report(step: list, top: int = 24, start: int = 0, show: int = 40) -> str:
  """Kernels summed by name over `step` (count, time, gaps before them), then kernels
  `start` .. `start + show` in order with the gap before each."""
  gaps = [0] + [step[i][0] - step[i - 1][1] for i in range(1, len(step))]
  busy = sum(end - begin for begin, end, _ in step)
  small = [g for g in gaps if 0 < g <= 2_000]
  lines = [f"{len(step)} kernels, span {(step[-1][1] - step[0][0]) / 1e3:.1f} us, busy "
           f"{busy / 1e3:.1f} us; {len(small)} gaps of at most 2 us ({sum(small) / 1e3:.1f} us), "
           f"{sum(g for g in gaps if g > 2_000) / 1e3:.1f} us in longer ones, "
           f"{-sum(g for g in gaps if g < 0) / 1e3:.1f} us overlapped",
           f"  {'kernel':60s} {'n':>4s} {'us':>8s} {'gaps us':>8s}"]
  by_name = collections.defaultdict(lambda: [0, 0, 0])
  for (begin, end, name), gap in zip(step, gaps):
    by_name[name][0] += 1
    by_name[name][1] += end - begin
    by_name[name][2] += gap
  for name, (count, ns, gap_ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
    lines.append(f"  {name[:60]:60s} {count:4d} {ns / 1e3:8.1f} {gap_ns / 1e3:8.1f}")
  lines.append(f"-- kernels {start} to {start + show}:")
  for (begin, end, name), gap in list(zip(step, gaps))[start:start + show]:
    lines.append(f"  {name[:60]:60s} gap {gap / 1e3:6.2f} us, ran {(end - begin) / 1e3:7.2f} us")
  return "\n".join(lines)
