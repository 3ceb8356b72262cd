"""Where a preset's warm-up goes, bf16 against FP8: the first `generate` of a fresh LLM (tracing,
lowering, XLA's compile of every program), summed by phase and by program from JAX's own
compile events, then the TPOT of the next two calls and of the three after them.

    python benchmarks/warmup.py --model qwen3-30b-a3b --layers 12
    python benchmarks/warmup.py --model qwen3-30b-a3b --layers 12 --host-events

Each precision runs in a process of its own (`--same-process`: one after the other in this one;
a process's first compile also pays its one-time costs). `--pass-log` adds XLA's per-pass log
to those processes and prints, per precision, the longest programs' passes
(jspec.bench.xla_passes).

`--host-events` traces the warm-up with `jax.profiler` instead (host events only: XLA's passes,
PTX -> cubin, the Mosaic GPU kernels' compiles) and prints the largest totals by event name;
events on parallel compile threads overlap, so their totals can exceed the wall time. The
persistent compilation cache is off in this process (a hit would hide the compile).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# What is measured is the compile: a persistent-cache hit would hide it.
os.environ["JSPEC_COMPILATION_CACHE"] = "off"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec import interrupt  # noqa: E402
from jspec.bench import xla_passes  # noqa: E402
from jspec.bench.presets import PRESETS  # noqa: E402
from jspec.bench.profile import trace_data  # noqa: E402
from jspec.pallas_kernels import precompile  # noqa: E402


def host_event_totals(trace_dir: str, width: int = 90) -> dict:
  """{event name: [count, total ns]} over the host planes of a trace."""
  totals = collections.defaultdict(lambda: [0, 0])
  for plane in trace_data(trace_dir).planes:
    if plane.name.startswith("/host"):
      for line in plane.lines:
        for event in line.events:
          totals[event.name[:width]][0] += 1
          totals[event.name[:width]][1] += event.duration_ns
  return totals


# Written to stderr as a precision's warm-up starts: its process's XLA log is read from here on
# (the weights' random draws compile before it).
WARM_UP_MARK = "== warm-up starts"

# Event names, "*" ending a prefix. "Compile" alone is a Mosaic GPU kernel's compile.
TIMELINE = ("lower_sharding_computation", "PjRtCApiClient::CompileAndLoad*", "Compile",
            "backend_compile_and_load", "PjitFunction(jit(start_fn))",
            "PjitFunction(jit(dispatch_fn))", "[0] GpuExecutable::ExecuteThunks")


def _named(name: str, names) -> bool:
  return any(name == n or n.endswith("*") and name.startswith(n[:-1]) for n in names)


def host_timeline(trace_dir: str, names=TIMELINE) -> list:
  """(start s from the trace's first host event, seconds, thread, name) of the host events whose
  name starts with one of `names`, in start order: which phases overlap."""
  rows, first = [], None
  for plane in trace_data(trace_dir).planes:
    if plane.name.startswith("/host"):
      for line in plane.lines:
        for event in line.events:
          first = event.start_ns if first is None else min(first, event.start_ns)
          if _named(event.name, names):
            rows.append((event.start_ns, event.duration_ns, line.name, event.name[:60]))
  return [((start - first) / 1e9, ns / 1e9, line, name) for start, ns, line, name in sorted(rows)]


def compile_events():
  """A listener of JAX's duration events and its {(phase, program): [count, seconds]}."""
  events = collections.defaultdict(lambda: [0, 0.0])

  def listener(event, duration, **kwargs):
    phase = event.rsplit("/", 1)[-1]
    events[(phase, kwargs.get("fun_name", ""))][0] += 1
    events[(phase, kwargs.get("fun_name", ""))][1] += duration

  jax.monitoring.register_event_duration_secs_listener(listener)
  return events


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layers")
  parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"],
                      choices=["bf16", "fp8"])
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--same-process", action="store_true",
                      help="every precision in this process, one after the other (the first "
                           "compile of a process also pays its one-time costs)")
  parser.add_argument("--pass-log", action="store_true",
                      help="XLA's per-pass log in each precision's process, and its longest "
                           "programs' passes (jspec.bench.xla_passes)")
  parser.add_argument("--rows-to", default=None, help=argparse.SUPPRESS)  # a child's rows
  parser.add_argument("--host-events", action="store_true",
                      help="trace the warm-up and print host events by name instead")
  parser.add_argument("--top", type=int, default=40)
  parser.add_argument("--timeline", action="store_true",
                      help="with --host-events: the compile phases' host events in time order")
  parser.add_argument("--one-by-one", action="store_true",
                      help="interrupt.SIDE_BY_SIDE off: a shape's programs compile one after "
                           "the other, as before they compiled side by side")
  parser.add_argument("--lower-first", action="store_true",
                      help="interrupt.COMPILE_WHILE_LOWERING off: a shape's programs all lowered "
                           "before any compiles")
  parser.add_argument("--no-precompile", action="store_true",
                      help="precompile.ENABLED off: Mosaic GPU kernels compile when their "
                           "programs load")
  parser.add_argument("--no-precompile-at-lowering", action="store_true",
                      help="precompile.AT_LOWERING off: each program's kernels handed over "
                           "once it is lowered, instead of as each custom call is emitted")
  return parser.parse_args()


def run_apart(args) -> tuple[list, str]:
  """Each precision in a fresh process of this script (with XLA's pass log where asked): the
  rows they measured and the device's kind. This process does not touch the GPU. Why apart:
  the first warm-up of a process also pays the process's one-time costs; Qwen3-30B-A3B bf16
  (48 layers) took 16.3 s first in a process with FP8 after it, 13.1-13.9 s in its own
  (BENCHMARKS.md, "FP8 prefill: the activations' e4m3 quantisation in one kernel; …")."""
  rows, device_kind = [], ""
  for precision in args.precisions:
    with tempfile.TemporaryDirectory() as scratch:
      rows_path, log_path = os.path.join(scratch, "rows.json"), os.path.join(scratch, "log")
      env = dict(os.environ, **(xla_passes.ENVIRONMENT if args.pass_log else {}))
      # Its stderr goes to the log where XLA's passes are read from it, else to the terminal.
      with open(log_path, "w") if args.pass_log else contextlib.nullcontext() as log:
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--precisions",
                                precision, "--rows-to", rows_path], env=env, stderr=log)
      if child.returncode:
        tail = ""
        if args.pass_log:
          with open(log_path, errors="replace") as log:
            tail = "; the end of its stderr:\n" + "".join(log.readlines()[-30:])
        sys.exit(f"{precision}'s process failed ({child.returncode}){tail}")
      with open(rows_path) as f:
        measured = json.load(f)
      rows += [tuple(row) for row in measured["rows"]]
      device_kind = measured["device_kind"]
      if args.pass_log:
        with open(log_path, errors="replace") as log:
          lines = list(log)
        warm = lines[next((i for i, line in enumerate(lines) if WARM_UP_MARK in line), 0):]
        print(f"\n== {precision}: XLA's passes in the warm-up, longest programs first\n"
              + xla_passes.report(xla_passes.module_passes(warm)), flush=True)
  return rows, device_kind


def measure(args) -> tuple[list, dict]:
  """Rows (precision, build s, warm-up s, TPOT ms of calls 1-2 and 3-5) and host-event totals
  by precision, each precision in this process."""
  precompile.ENABLED = not args.no_precompile
  precompile.AT_LOWERING = not args.no_precompile_at_lowering
  interrupt.SIDE_BY_SIDE = not args.one_by_one
  interrupt.COMPILE_WHILE_LOWERING = not args.lower_first
  base = PRESETS[args.model]
  if args.layers:
    base = dataclasses.replace(base, num_layers=args.layers)
  prompt = [np.random.default_rng(0).integers(0, base.vocab_size, 512).tolist()]
  params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
  events = compile_events()
  rows, traces = [], {}
  for precision in args.precisions:
    config = dataclasses.replace(base, fp8_block=(128, 128) if precision == "fp8" else None)
    start = time.perf_counter()
    llm = jspec.LLM.from_random(config, None, max_model_len=1024, max_num_seqs=1)
    built = time.perf_counter() - start
    events.clear()
    trace_dir = tempfile.mkdtemp()
    print(WARM_UP_MARK, file=sys.stderr, flush=True)
    start = time.perf_counter()
    if args.host_events:
      options = jax.profiler.ProfileOptions()
      options.python_tracer_level = 0  # Python frames would swamp the host events
      options.host_tracer_level = 3
      with jax.profiler.trace(trace_dir, profiler_options=options):
        llm.generate(prompt, params, use_tqdm=False)
    else:
      llm.generate(prompt, params, use_tqdm=False)
    warm = time.perf_counter() - start
    print(f"\n== {precision}: built in {built:.1f} s, warm-up {warm:.1f} s", flush=True)
    if args.host_events:
      traces[precision] = host_event_totals(trace_dir)
      for start_s, seconds, line, name in host_timeline(trace_dir) if args.timeline else ():
        if seconds >= 0.05:
          print(f"  {start_s:7.2f} s  {seconds:6.2f} s  {line[:28]:28s} {name}")
    else:
      by_phase = collections.defaultdict(float)
      for (phase, _), (_, seconds) in events.items():
        by_phase[phase] += seconds
      for phase, seconds in sorted(by_phase.items(), key=lambda item: -item[1]):
        print(f"  {phase:42s} {seconds:8.2f} s")
      for (phase, name), (count, seconds) in sorted(events.items(),
                                                    key=lambda item: -item[1][1])[:12]:
        print(f"    {seconds:7.2f} s x{count:<3d} {phase:40s} {name}")
    # The first calls after the warm-up apart from later ones: at Qwen3-30B-A3B's 48 layers in
    # FP8 the first two's TPOT was well above the step's (BENCHMARKS.md, "FP8 at all 48 ...").
    tpots = [llm.generate(prompt, params, use_tqdm=False).metrics.tpot_s for _ in range(5)]
    rows.append((precision, built, warm, 1e3 * statistics.median(tpots[:2]),
                 1e3 * statistics.median(tpots[2:])))
    del llm
    gc.collect()
  return rows, traces


def print_rows(args, rows, traces, device_kind: str, kernels_line: bool = True):
  if traces:
    names = set().union(*traces.values())
    largest = sorted(names, key=lambda n: -max(t.get(n, [0, 0])[1] for t in traces.values()))
    print(f"\n{'host event':90s} " + " ".join(f"{p + ' s':>9s} {'n':>5s}" for p in traces))
    for name in largest[:args.top]:
      print(f"{name:90s} " + " ".join(f"{t.get(name, [0, 0])[1] / 1e9:9.2f} "
                                      f"{t.get(name, [0, 0])[0]:5d}" for t in traces.values()))
  print(f"\n{device_kind}, {args.model}"
        f"{f', {args.layers} layers' if args.layers else ''}, batch 1, 512-token prompt, "
        f"{args.max_tokens} new tokens{', traced' if traces else ''}")
  print(f"{'precision':9s} {'build s':>8s} {'warm-up s':>9s} {'TPOT ms, calls 1-2':>19s} "
        f"{'calls 3-5':>10s}")
  for precision, built, warm, first, settled in rows:
    print(f"{precision:9s} {built:8.1f} {warm:9.1f} {first:19.3f} {settled:10.3f}")
  if kernels_line and precompile.ENABLED:
    failed = precompile.stats["failed"]
    print(f"Mosaic GPU kernels compiled ahead: {precompile.stats['compiled']}, failed: "
          f"{len(failed)}{f' (first: {failed[0][:200]})' if failed else ''}")
  if len(rows) == 2:
    ratio = lambda i: rows[1][i] / rows[0][i]
    print(f"fp8 / bf16: warm-up {ratio(2):.2f}x, TPOT {ratio(3):.3f}x (calls 1-2), "
          f"{ratio(4):.3f}x (calls 3-5)")


def main():
  args = parse_args()
  if args.rows_to is None and (args.pass_log or len(args.precisions) > 1
                               and not args.same_process):
    rows, device_kind = run_apart(args)
    print_rows(args, rows, {}, device_kind, kernels_line=False)
    return
  rows, traces = measure(args)
  device_kind = jax.devices()[0].device_kind
  if args.rows_to is not None:
    with open(args.rows_to, "w") as f:
      json.dump({"rows": rows, "device_kind": device_kind}, f)
  print_rows(args, rows, traces, device_kind)


if __name__ == "__main__":
  main()
