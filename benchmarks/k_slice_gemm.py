"""K slices' float32 partials of a few rows times a weight in one kernel
(jspec.pallas_kernels.k_slice_gemm) against XLA's batched GEMM for them
(tensor_parallel.k_slice_partials with the kernel off): the kernels' time per product from the
profiler.

Qwen3-8B's tp = 2 shards by default: o (2048 x 4096), fused q / k / v (4096 x 3072), down
(6144 x 4096), and one GPU's q / k / v (4096 x 6144); `--layers` different weights in one
program (as a step's layers: no weight read from L2). Tilings: "auto" (the module's) or
"block_k,block_n,stages,warps".

    python benchmarks/k_slice_gemm.py --rows 2 8 16
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profile import call_kernel_events
from jspec.pallas_kernels import k_slice_gemm as kernel_lib
from jspec.sharding.tensor_parallel import k_slice_partials

SHAPES = {"o-tp2": (2048, 4096), "qkv-tp2": (4096, 3072), "down-tp2": (6144, 4096),
          "qkv-1gpu": (4096, 6144)}


def xla_program(slices: int, rows_last: bool):
  def run(x, ws):
    kernel_lib.ENABLED = False
    try:
      return [k_slice_partials(x, w, slices, rows_last=rows_last) for w in ws]
    finally:
      kernel_lib.ENABLED = True
  return jax.jit(run)


def kernel_program(slices: int, rows_last: bool, tiling: str):
  given = {}
  if tiling != "auto":
    block_k, block_n, stages, warps = (int(v) for v in tiling.split(","))
    given = dict(block_k=block_k, block_n=block_n, num_stages=stages, num_warps=warps)
  return jax.jit(lambda x, ws: [kernel_lib.k_slice_gemm(x, w, slices=slices,
                                                        rows_last=rows_last, **given)
                                for w in ws])


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, nargs="+", default=[2, 8])
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
  parser.add_argument("--slices", type=int, default=4)
  parser.add_argument("--tilings", nargs="+",
                      default=["auto", "128,64,3,4", "64,64,4,4", "256,64,3,4", "128,128,3,4",
                               "128,32,4,4", "128,64,4,8"])
  parser.add_argument("--layers", type=int, default=8)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  print(f"# {jax.devices()[0].device_kind}; us per product (the program's kernels / layers)")
  rows_out = []
  for shape in args.shapes:
    k, n = SHAPES[shape]
    ws = [jnp.asarray(rng.standard_normal((k, n)) / 64.0, jnp.bfloat16)
          for _ in range(args.layers)]
    nbytes = k * n * 2
    rows_last = shape.startswith("qkv")  # the q / k kernel reads its partials rows last
    for rows in args.rows:
      x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
      want = None
      programs = [("xla", xla_program(args.slices, rows_last))] + [
          (t, kernel_program(args.slices, rows_last, t)) for t in args.tilings]
      for name, fn in programs:
        try:
          out = np.asarray(fn(x, ws)[0], np.float32)
        except (jax.errors.JaxRuntimeError, ValueError) as error:
          print(f"# {shape} {rows} {name}: {str(error).splitlines()[0]}", flush=True)
          continue
        want = out if want is None else want
        times = collections.defaultdict(float)
        for begin, end, kernel in call_kernel_events(fn, x, ws):
          times[kernel] += (end - begin) / 1e3 / args.layers
        total = sum(times.values())
        longest = max(times, key=times.get)
        row = (shape, rows, name, times[longest], nbytes / times[longest] / 1e6, total,
               float(np.abs(out - want).max()), len(times))
        rows_out.append(row)
        print(row, flush=True)
  print("\n| shape | rows | setting | main kernel us | its TB/s | all kernels us | max diff to "
        "XLA | kernels |")
  print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
  for shape, rows, name, main_us, tbs, total, diff, count in rows_out:
    print(f"| {shape} | {rows} | {name} | {main_us:.2f} | {tbs:.2f} | {total:.2f} | {diff:.1e} "
          f"| {count} |")


if __name__ == "__main__":
  main()
