"""Inside the few-row FP8 product kernel: where each program's time goes, from the Mosaic GPU
profiler (fp8_block_kernel.PROFILE): the programs' start skew, the prologue's loads, the first
tile's wait, each step's wait and products ("widen": each e4m3 tile widened; "wgmma": the
products, each block's widening included since it runs between them), the final store, and each
program's span.

Mind the clock: times within a program are cycles, and the profiled call follows its build,
with the GPU idle before it; if the SM clock has dropped below --clock-ghz then, the times are
longer than shown. --hold-clock keeps the GPU busy up to the profiled call and prints the
unprofiled kernel's CUPTI time beside the spans (what a call costs outside its programs).

Each shape is K x N[,N2,...] (several weights of one K share a call, as q / k / v do). The
profiled call is the first of a fresh build (the profiler writes one trace per build), the
third: weights that fit the L2 may be there from the two before. Starts are each program's
globaltimer (ns).

    python benchmarks/fp8_kernel_inside.py --shapes 4096x4096 4096x24576 --x-dtypes bfloat16 float16
    python benchmarks/fp8_kernel_inside.py --hold-clock   # the clock held up; CUPTI beside
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp8_kernel_routes import profiled_kernels, weights
from jspec.pallas_kernels import fp8_block_kernel, platform
from jspec.pallas_kernels.fp8_gemm import default_tiling, scale_lanes
from jspec.pallas_kernels.fp8_layout import choose_splits

PROFILE_RANGES = 256  # named ranges a program may record (each step records about four)


def busy_program():
  """A jitted chain of bf16 matmuls (about 0.1-0.2 s on a Hopper GPU), compiled: dispatched
  right before a call, it keeps the GPU busy up to it, so that the SM clock is up."""
  a = jnp.full((8192, 8192), 1e-4, jnp.bfloat16)
  chain = jax.jit(lambda a: lax.fori_loop(0, 100, lambda i, a: (a @ a) + 1e-4, a))
  jax.block_until_ready(chain(a))
  return lambda: chain(a)


def problem(k: int, ns: tuple, rows: int, x_dtype):
  """(x, weights, their scales' lanes, K slices) of a call over `ns`' weights."""
  rng = np.random.default_rng(0)
  ws, lanes = [], []
  for n in ns:
    w8, scales = weights(k, n, 1, rng)
    ws.append(w8[0])
    lanes.append(scale_lanes(scales[0]))
  x = jnp.asarray(rng.standard_normal((rows, k)), x_dtype)
  return x, ws, lanes, choose_splits(k, sum(ns), platform.num_sms())


def kernel_call(splits: int, rows: int):
  return jax.jit(lambda x, ws, lanes: fp8_block_kernel.partials(
      x, tuple(ws), tuple(lanes), None, splits, default_tiling(rows)))


def profiled_trace(args: tuple, rows: int, trace_dir: str, busy=None) -> str:
  """The trace file of one profiled call (`problem`'s args); `busy`: a busy_program run right
  before it."""
  *operands, splits = args
  fp8_block_kernel.PROFILE = plgpu.CompilerParams(profile_space=PROFILE_RANGES,
                                                  profile_dir=trace_dir)
  try:
    for _ in range(3):
      jax.clear_caches()  # a fresh build: its first call writes a trace
      compiled = kernel_call(splits, rows).lower(*operands).compile()
      if busy is not None:
        busy()
      jax.block_until_ready(compiled(*operands))
  finally:
    fp8_block_kernel.PROFILE = None
  return sorted(glob.glob(os.path.join(trace_dir, "*.json")), key=os.path.getmtime)[-1]


def cupti_us(args: tuple, rows: int) -> float:
  """The unprofiled kernel's time under CUPTI, one call (after a warm one)."""
  *operands, splits = args
  jax.clear_caches()
  totals = profiled_kernels(kernel_call(splits, rows), *operands)
  return sum(ns for name, (_, ns) in totals.items() if name.startswith("fp8_block_gemm")) / 1e3


def program_times(path: str, clock_ghz: float) -> dict:
  """{what: [µs per program or per step]} from a trace: "start" (after the first program's),
  "span" (start to last event), and per named range its durations ("wait" split into the
  first and the later ones)."""
  by_program = {}
  for event in json.load(open(path))["traceEvents"]:
    by_program.setdefault(event["tid"], []).append(event)
  times = {"start": [], "span": [], "first wait": [], "wait": []}
  for events in by_program.values():
    t0 = events[0]["ts"]
    to_us = lambda ts, t0=t0: (ts - t0) * 1e3 / (clock_ghz * 1e3)  # noqa: E731
    times["start"].append(t0)
    opened, waits, last = {}, [], 0.0
    for event in events:
      if event["ph"] == "B":
        opened[event["name"]] = event["ts"]
        continue
      duration = to_us(event["ts"]) - to_us(opened.pop(event["name"]))
      last = max(last, to_us(event["ts"]))
      if event["name"] == "wait":
        waits.append(duration)
      else:
        times.setdefault(event["name"], []).append(duration)
    if waits:
      times["first wait"].append(waits[0])
      times["wait"] += waits[1:]
    times["span"].append(last)
  first = min(times["start"])
  times["start"] = [t - first for t in times["start"]]
  return times


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x4096,1024,1024",
                                                      "12288x4096", "4096x24576"])
  parser.add_argument("--rows", type=int, default=1)
  parser.add_argument("--x-dtypes", nargs="+", default=["bfloat16"],
                      choices=["bfloat16", "float16"])
  parser.add_argument("--clock-ghz", type=float, default=1.98)
  parser.add_argument("--hold-clock", action="store_true",
                      help="keep the GPU busy (bf16 matmuls) up to the profiled call, and "
                           "print the unprofiled kernel's CUPTI time beside the spans")
  args = parser.parse_args()
  busy = busy_program() if args.hold_clock else None
  print(f"device: {jax.devices()[0].device_kind}; µs, min / median / max over programs")
  for shape in args.shapes:
    k_text, n_text = shape.split("x")
    k, ns = int(k_text), tuple(int(n) for n in n_text.split(","))
    for x_dtype in args.x_dtypes:
      call_args = problem(k, ns, args.rows, jnp.dtype(x_dtype))
      with tempfile.TemporaryDirectory() as trace_dir:
        times = program_times(profiled_trace(call_args, args.rows, trace_dir, busy),
                              args.clock_ghz)
      cupti = (f", unprofiled {cupti_us(call_args, args.rows):.2f} µs under CUPTI"
               if args.hold_clock else "")
      print(f"K={k} N={ns} rows={args.rows} x {x_dtype}: {call_args[-1]} K slices, "
            f"{len(times['span'])} programs{cupti}")
      for name, values in times.items():
        if values:
          print(f"  {name:12s} {min(values):7.2f} {statistics.median(values):7.2f} "
                f"{max(values):7.2f}", flush=True)


if __name__ == "__main__":
  main()
