"""Where a program's device time goes: a `jax.profiler` trace, read back with
`jax.profiler.ProfileData`, summed per XLA op on one device.

Used by `benchmarks/profile_generate.py` to explain a step time (collectives vs matmuls vs
attention, and how much of the wall time the device was idle).
"""

from __future__ import annotations

import collections
import glob
import math
import os
import re
import tempfile
import time
from typing import Callable, NamedTuple

import jax
from jax.profiler import ProfileData

# Op-name prefixes of collectives in XLA's GPU op names ("all-reduce-start.3", "all-gather.1").
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def category(op_name: str) -> str:
  name = op_name.lower()
  if name.startswith(COLLECTIVES) or "nccl" in name:
    return "collective"
  if any(key in name for key in ("gemm", "gemv", "cublas", "cutlass", "dot", "matmul", "triton")):
    return "matmul"
  if name.startswith(("fusion", "loop_", "input_", "wrapped_")):
    return "fusion"
  return "other"


def _device_plane(space: ProfileData, device_index: int):
  wanted = f"/device:GPU:{device_index}"
  for plane in space.planes:
    if plane.name == wanted:
      return plane
  names = [plane.name for plane in space.planes]
  raise ValueError(f"trace has no plane {wanted!r}; planes: {names}")


def trace_data(trace_dir: str) -> ProfileData:
  """The newest `jax.profiler` trace under `trace_dir`, read back."""
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not paths:
    raise ValueError(f"no .xplane.pb under {trace_dir}")
  return ProfileData.from_file(paths[-1])


def op_times(trace_dir: str, device_index: int = 0) -> dict:
  """{op name: (count, total ns)} on one GPU, from its "XLA Ops" line (HLO-level names), or,
  where the trace has no such line, by kernel name from its stream lines. Key None holds the
  kernels' summed time on the stream lines."""
  plane = _device_plane(trace_data(trace_dir), device_index)
  xla_ops = collections.defaultdict(lambda: [0, 0])
  kernels = collections.defaultdict(lambda: [0, 0])
  for line in plane.lines:
    target = xla_ops if line.name == "XLA Ops" else (
        kernels if line.name.startswith("Stream") else None)
    if target is None:
      continue
    for event in line.events:
      target[event.name][0] += 1
      target[event.name][1] += event.duration_ns
  kernel_ns = sum(ns for _, ns in kernels.values())
  result = {name: tuple(v) for name, v in (xla_ops or kernels).items()}
  result[None] = (0, kernel_ns)
  return result


class Idle(NamedTuple):
  """A GPU's kernels between its first and last: their span, the time some kernel ran, and
  the idle gaps summed by the kernel that ended each ({name: (gaps, ns)})."""
  span_ns: int
  busy_ns: int
  gaps_ns: list
  before: dict


def kernel_events(trace_dir: str, device_index: int = 0) -> list:
  """(start ns, end ns, kernel name) of every kernel on one GPU's stream lines, sorted."""
  plane = _device_plane(trace_data(trace_dir), device_index)
  return sorted((e.start_ns, e.end_ns, e.name) for line in plane.lines
                if line.name.startswith("Stream") for e in line.events)


def call_kernel_events(fn: Callable, *args, device_index: int = 0) -> list:
  """`kernel_events` of one call fn(*args), profiled after an unprofiled call (which compiles
  and warms it)."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    jax.block_until_ready(fn(*args))
    jax.profiler.stop_trace()
    return kernel_events(trace_dir, device_index)


def idle_time(trace_dir: str, device_index: int = 0) -> Idle:
  """Where a GPU waited: every stream's kernels merged in time, each gap between them charged
  to the kernel that followed it (after an all-reduce, the kernel that waited on it)."""
  return idle_from_events(kernel_events(trace_dir, device_index))


def idle_from_events(events) -> Idle:
  """`idle_time` of (start ns, end ns, kernel name) triples, in any order, streams overlapping."""
  events = sorted(events)
  before = collections.defaultdict(lambda: [0, 0])
  gaps, busy = [], 0
  run_start = run_end = events[0][0]
  for start, end, name in events:
    if start > run_end:  # a gap: no kernel ran from run_end to start
      gaps.append(start - run_end)
      before[name][0] += 1
      before[name][1] += start - run_end
      busy += run_end - run_start
      run_start = start
    run_end = max(run_end, end)
  busy += run_end - run_start
  return Idle(run_end - events[0][0], busy, gaps, {k: tuple(v) for k, v in before.items()})


def idle_summary(idle: Idle, top: int = 12) -> str:
  gaps = sorted(idle.gaps_ns)
  # Gaps under 2 us are a graph's kernel-to-kernel launch latency: many, each small.
  tiny = [g for g in gaps if g <= 2_000]
  small = sum(g for g in gaps if 2_000 < g <= 20_000)
  large = sum(g for g in gaps if g > 20_000)
  lines = [f"span {idle.span_ns / 1e6:.2f} ms, busy {idle.busy_ns / 1e6:.2f} ms "
           f"({100 * idle.busy_ns / idle.span_ns:.0f}%), idle in {len(gaps)} gaps: "
           f"{sum(tiny) / 1e6:.2f} ms in {len(tiny)} gaps of at most 2 us, "
           f"{small / 1e6:.2f} ms in gaps of 2-20 us, {large / 1e6:.2f} ms in longer ones",
           f"  {'idle before':40s} {'gaps':>6s} {'us':>9s}"]
  for name, (count, ns) in sorted(idle.before.items(), key=lambda kv: -kv[1][1])[:top]:
    lines.append(f"  {name[:40]:40s} {count:6d} {ns / 1e3:9.1f}")
  return "\n".join(lines)


def profile(fn: Callable[[], object], device_index: int = 0,
            with_idle: bool = False) -> tuple[float, dict] | tuple[float, dict, Idle]:
  """Runs `fn` (already compiled) once under the profiler: (wall seconds, op_times), and the
  GPU's idle gaps (`idle_time`) where `with_idle`."""
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    start = time.perf_counter()
    jax.block_until_ready(fn())
    wall = time.perf_counter() - start
    jax.profiler.stop_trace()
    times = op_times(trace_dir, device_index)
    if with_idle:
      return wall, times, idle_time(trace_dir, device_index)
    return wall, times


def summary(wall_s: float, times: dict, top: int = 12) -> str:
  """A short table: time by category, then the `top` ops, each as a share of the wall time."""
  kernel_ns = times.get(None, (0, 0))[1]
  ops = {name: v for name, v in times.items() if name is not None}
  by_category = collections.Counter()
  for name, (_, ns) in ops.items():
    by_category[category(name)] += ns
  wall_ns = wall_s * 1e9
  lines = [f"wall {wall_s * 1e3:.2f} ms; GPU kernels {kernel_ns / 1e6:.2f} ms "
           f"({100 * kernel_ns / wall_ns:.0f}% of wall)"]
  for cat, ns in by_category.most_common():
    lines.append(f"  {cat:11s} {ns / 1e6:8.2f} ms {100 * ns / wall_ns:5.1f}%")
  lines.append(f"  {'op':40s} {'count':>6s} {'ms':>8s} {'% wall':>7s}")
  for name, (count, ns) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]:
    lines.append(f"  {name[:40]:40s} {count:6d} {ns / 1e6:8.2f} {100 * ns / wall_ns:6.1f}%")
  return "\n".join(lines)


# Element sizes of HLO types, for the bytes of an instruction's output.
HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
              "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
HLO_ARRAY = re.compile(r"\b(" + "|".join(HLO_BYTES) + r")\[([\d,]*)\]")
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
# Instructions that name or forward buffers without moving their bytes.
_NO_MOVE = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
            "constant", "call", "after-all", "opt-barrier", "copy-done", "async-done"}


class Move(NamedTuple):
  """One instruction of an optimized HLO module and the bytes of its output."""
  op: str      # "copy", "fusion", "custom-call", ...
  name: str    # its name without the ".N" suffix: "copy", "input_scatter_fusion"
  shape: str   # its output type without layouts or comments: "bf16[64,8,1024,128]"
  mb: float
  line: str


def large_moves(hlo_text: str, min_bytes: float) -> list[Move]:
  """Each instruction of an optimized HLO module whose output (all arrays of a tuple summed)
  holds at least `min_bytes`: the copies, scatters and fusions that may move a whole cache.
  An in-place update (a dynamic-update-slice fusion) is listed too: its output is the whole
  buffer although it writes a slice; the profile tells which ones cost."""
  found, inside_fusion = [], False
  for line in hlo_text.splitlines():
    header = _HLO_COMPUTATION.match(line)
    if header:  # instructions inside a fusion are counted by the fusion that calls them
      inside_fusion = header.group(1).startswith(("fused", "wrapped", "command_buffer"))
      continue
    match = _HLO_INSTRUCTION.match(line)
    if inside_fusion or not match or match.group(3) in _NO_MOVE:
      continue
    name, out_type, op = match.groups()
    size = sum(HLO_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in HLO_ARRAY.findall(out_type))
    if size >= min_bytes:
      found.append(Move(op, re.sub(r"[.\d]+$", "", name), re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", out_type),
                        size / 2**20, line.strip()))
  return found
