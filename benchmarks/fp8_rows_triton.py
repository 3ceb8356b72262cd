"""The few-row FP8 product as Triton programs (jspec.pallas_kernels.fp8_rows_triton) against the
Mosaic GPU kernel the models run (fp8_block_kernel through fp8_gemm) and XLA's bf16 product of
the same shapes: each product kernel's own time from the profiler, µs per weight and the
weight's bytes over it.

--layers different weights of each shape in one jitted program (no weight read twice), one x.
Routes: "e4m3" (x quantized per row and 128-K group beforehand, as the norm kernels hand it
over: FP8 x FP8 products), "bfloat16" (x as it is, each e4m3 tile widened), "bf16" (XLA's dot
over a bf16 weight). A Triton tiling is "block_n,warps,stages,programs_per_sm[,splits]".

    python benchmarks/fp8_rows_triton.py --rows 1 8 --tilings 128,4,4,4 64,4,4,8
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profile import call_kernel_events
from jspec.pallas_kernels import fp8_gemm
from jspec.pallas_kernels.fp8_rows_triton import TritonRowsTiling, fp8_rows_partials

SHAPES = ("4096x24576", "12288x4096", "4096x6144", "4096x4096", "2048x5120", "4096x2048")


def parse_tiling(text: str) -> TritonRowsTiling:
  values = [int(v) for v in text.split(",")]
  block_n, warps, stages, per_sm = values[:4]
  return TritonRowsTiling(block_n=block_n, num_warps=warps, num_stages=stages,
                          programs_per_sm=per_sm, splits=values[4] if len(values) > 4 else None)


def program(kind: str, route: str, tiling=None):
  """Each weight's product: kind "mosaic", "triton" or "xla" (route bf16)."""
  def run(x, x8, x_scale, ws, scales):
    outs = []
    for w, s in zip(ws, scales):
      if kind == "xla":
        outs.append(jnp.dot(x, w))
      elif kind == "triton":
        outs.append(fp8_rows_partials(x8, w, s, x_scale, tiling=tiling) if route == "e4m3"
                    else fp8_rows_partials(x, w, s, tiling=tiling))
      elif route == "e4m3":
        outs.append(fp8_gemm.fp8_partials_many(
            x8, (w,), (s,), act_lanes_X=fp8_gemm.act_lanes(x_scale), rows_first=True)[0])
      else:
        outs.append(fp8_gemm.fp8_partials_many(x, (w,), (s,), rows_first=True)[0])
    return outs
  return jax.jit(run)


def kernel_us(fn, args, prefix: str, layers: int) -> tuple[float, float]:
  """(µs a weight of the kernels named `prefix`, or the longest kernel's where None; of all)."""
  totals = collections.defaultdict(int)
  for start, end, name in call_kernel_events(fn, *args):
    totals[name] += end - start
  main = prefix or max(totals, key=totals.get)
  main_ns = sum(ns for name, ns in totals.items() if name.startswith(main))
  return main_ns / layers / 1e3, sum(totals.values()) / layers / 1e3


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="K x N")
  parser.add_argument("--routes", nargs="+", default=["e4m3", "bfloat16"])
  parser.add_argument("--tilings", nargs="+", default=["128,4,4,4"])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--no-xla", action="store_true")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  print(f"# {jax.devices()[0].device_kind}; µs a weight (the product kernel alone), TB/s of "
        f"its weight bytes, µs of all kernels; max |diff| / max |mosaic|")
  rows_out = []
  for shape in args.shapes:
    k, n = (int(v) for v in shape.split("x"))
    ws = [jnp.asarray(rng.standard_normal((n, k)) * 0.5, jnp.float8_e4m3fn)
          for _ in range(args.layers)]
    scales = [jnp.asarray(rng.uniform(0.5, 2.0, (n // 128, k // 128)) * 1e-2, jnp.float32)
              for _ in range(args.layers)]
    for m in args.rows:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      x8, x_scale = fp8_gemm.quantize_activations(x)
      operands = (x, x8, x_scale, ws, scales)
      if not args.no_xla:
        w16 = [w.astype(jnp.bfloat16).T for w in ws]
        us, all_us = kernel_us(program("xla", "bf16"), (x, x8, x_scale, w16, scales), None,
                               args.layers)
        rows_out.append((shape, m, "bf16", "xla", us, 2 * n * k / us / 1e6, all_us, 0.0))
        print(rows_out[-1], flush=True)
      for route in args.routes:
        mosaic_fn = program("mosaic", route)
        want = np.asarray(mosaic_fn(*operands)[0]).sum(0)[:m]
        us, all_us = kernel_us(mosaic_fn, operands, "fp8_block_gemm", args.layers)
        rows_out.append((shape, m, route, "mosaic", us, n * k / us / 1e6, all_us, 0.0))
        print(rows_out[-1], flush=True)
        for text in args.tilings:
          fn = program("triton", route, parse_tiling(text))
          got = np.asarray(fn(*operands)[0]).sum(0)[:, :m].T
          error = float(np.abs(got - want).max() / np.abs(want).max())
          us, all_us = kernel_us(fn, operands, "fp8_rows_triton", args.layers)
          rows_out.append((shape, m, route, text, us, n * k / us / 1e6, all_us, error))
          print(rows_out[-1], flush=True)
  print("\n| K x N | rows | route | kernel | µs a weight | TB/s | all kernels µs | error |")
  print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
  for shape, m, route, kind, us, tbs, all_us, error in rows_out:
    print(f"| {shape} | {m} | {route} | {kind} | {us:.2f} | {tbs:.2f} | {all_us:.2f} "
          f"| {error:.1e} |")


if __name__ == "__main__":
  main()
