"""Where the test suite's time goes: a pytest plugin that writes, per test, its wall time, JAX's
tracing, lowering and XLA compile seconds, and each program XLA compiled (name, count,
seconds; a program shared from tests/shared_executables' in-memory cache takes under 20 ms and
is not counted).

    PYTHONPATH=benchmarks SUITE_PROFILE=/tmp/profile.jsonl XLA_FLAGS=... \
        .venv/bin/python -m pytest -q -n 2 -m "not gpu" -p suite_compile_profile tests

(with `make test`'s XLA_FLAGS and environment). Each pytest-xdist worker appends its own lines
to SUITE_PROFILE (default suite_profile.jsonl); the summary is printed by running this file on
it: `python benchmarks/suite_compile_profile.py /tmp/profile.jsonl`.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest

COMPILE_EVENTS = ("backend_compile_duration", "jaxpr_trace_duration",
                  "jaxpr_to_mlir_module_duration")
SHARED_HIT_S = 0.02  # a compile this short was the shared executable, not XLA's work

_durations = collections.Counter()
_programs = []
_installed = False


def _install():
  import jax.monitoring
  from jax._src import compiler
  from jax._src.lib.mlir import ir

  def listener(event, duration, **kwargs):
    _durations[event.rsplit("/", 1)[-1]] += duration

  jax.monitoring.register_event_duration_secs_listener(listener)
  inner = compiler.backend_compile_and_load

  def timed(backend, module, *args, **kwargs):
    name = ir.StringAttr(module.operation.attributes["sym_name"]).value
    start = time.perf_counter()
    executable = inner(backend, module, *args, **kwargs)
    _programs.append((name.split(".")[0], time.perf_counter() - start))
    return executable

  compiler.backend_compile_and_load = timed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  global _installed
  if not _installed:
    _install()
    _installed = True
  _durations.clear()
  _programs.clear()
  start = time.perf_counter()
  yield
  compiled = collections.defaultdict(lambda: [0, 0.0])
  for name, seconds in _programs:
    if seconds >= SHARED_HIT_S:
      compiled[name][0] += 1
      compiled[name][1] += round(seconds, 3)
  line = dict(test=item.nodeid, wall_s=round(time.perf_counter() - start, 3),
              **{event: round(_durations[event], 3) for event in COMPILE_EVENTS},
              compiled=dict(compiled))
  with open(os.environ.get("SUITE_PROFILE", "suite_profile.jsonl"), "a") as out:
    out.write(json.dumps(line) + "\n")


def summary(path: str, top: int = 8) -> str:
  rows = [json.loads(line) for line in open(path)]
  wall = sum(r["wall_s"] for r in rows)
  lines = [f"{len(rows)} tests, {wall:.0f} worker-seconds"]
  for event in COMPILE_EVENTS:
    seconds = sum(r[event] for r in rows)
    lines.append(f"  {event:32s} {seconds:7.0f} s  {seconds / wall:6.1%}")
  programs = collections.defaultdict(lambda: [0, 0.0])
  for r in rows:
    for name, (count, seconds) in r["compiled"].items():
      programs[name][0] += count
      programs[name][1] += seconds
  lines.append("programs compiled (count, seconds, share of the worker-seconds):")
  for name, (count, seconds) in sorted(programs.items(), key=lambda kv: -kv[1][1])[:top]:
    lines.append(f"  {name:32s} {count:6d} {seconds:7.0f} s  {seconds / wall:6.1%}")
  return "\n".join(lines)


if __name__ == "__main__":
  print(summary(sys.argv[1]))
