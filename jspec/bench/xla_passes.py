"""Where XLA's compile of each program goes, pass by pass, from XLA's own log.

With `TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1` in a process's environment
before jax is imported, XLA logs each pass pipeline it starts on a module ("Running HLO pass
pipeline on module jit_start_fn: ...") and each pass's time ("HLO pass: priority-fusion time:
3.07 s ..."), on the thread that compiles the module. Why this and not a profiler trace: the
passes' own names and times, for every program compiled side by side, at no cost to the
compile (BENCHMARKS.md, "Mosaic GPU modules emptied at their call sites: …", found the FP8
warm-up's extra time this way).

A pipeline nested in another is a pass of its parent too, so a program's rows can sum past its
time in passes; `seconds` (the first to the last of its log lines) does not.
"""

from __future__ import annotations

import collections
import dataclasses
import re

ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "hlo_pass_pipeline=1"}

# glog's prefix: severity and date, time, thread, source.
_LINE = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+)\s+(\d+) hlo_pass_pipeline\.cc:\d+\] "
                   r"(.*)$")
_RUNNING = re.compile(r"Running HLO pass pipeline on module (\S+?):? ")
_TIMED = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s)\b")
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
# JAX names a program's module after its function ("jit_start_fn"); the modules XLA compiles
# inside a pass (the autotuner's fusions: "gemm_fusion_dot.6") belong to the program whose
# pass compiles them.
_PROGRAM = re.compile(r"^(jit|pmap)_|^jspec_")


@dataclasses.dataclass
class ModulePasses:
  """A program's compile on one thread: its passes' seconds by name, and `seconds` from its
  first log line to its last (for a program compiled once, its time in passes; one compiled
  several times spans the time between them too)."""
  module: str
  thread: str
  passes: collections.Counter
  first_s: float
  last_s: float

  @property
  def seconds(self) -> float:
    return self.last_s - self.first_s


def module_passes(lines) -> list[ModulePasses]:
  """The compiles in `lines` (a log's lines; others are skipped), longest first. A thread's
  lines belong to the program it last started a pipeline on (a module compiled inside a pass
  belongs to it too); a program compiled again on the same thread adds to the same entry."""
  found, current = {}, {}
  for line in lines:
    match = _LINE.match(line.rstrip("\n"))
    if not match:
      continue
    hours, minutes, seconds, thread, message = match.groups()
    now = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    running = _RUNNING.search(message)
    if running and (_PROGRAM.match(running.group(1)) or thread not in current):
      current[thread] = running.group(1)
    if thread not in current:
      continue
    key = (current[thread], thread)
    entry = found.setdefault(key, ModulePasses(key[0], thread, collections.Counter(), now, now))
    entry.last_s = now
    timed = _TIMED.search(message)
    if timed:
      entry.passes[timed.group(1)] += float(timed.group(2)) * _UNIT[timed.group(3)]
  return sorted(found.values(), key=lambda entry: -entry.seconds)


def report(compiles: list[ModulePasses], modules: int = 3, passes: int = 8) -> str:
  """The `modules` longest compiles, each with its `passes` longest passes."""
  out = []
  for entry in compiles[:modules]:
    out.append(f"  {entry.module} (thread {entry.thread}): {entry.seconds:.2f} s from its first "
               f"pass to its last")
    out.extend(f"    {seconds:7.2f} s  {name}"
               for name, seconds in entry.passes.most_common(passes))
  return "\n".join(out)
