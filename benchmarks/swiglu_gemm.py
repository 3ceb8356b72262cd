"""SwiGLU's gate / up product and activation in one kernel (jspec.pallas_kernels.swiglu_gemm)
against XLA's GEMM and its SiLU x up kernel: the kernels' time per layer from the profiler.

Qwen3-8B's gate / up weight (4096 x 2 x 12288 in bf16; a tp = 2 shard's 6144 columns with
`--columns 6144`), `--layers` different weights in one program (as a step's layers: no weight
read from L2). Tilings: "auto" (the module's) or "block_k,block_n,stages,warps".

    python benchmarks/swiglu_gemm.py --rows 1 8 --columns 12288 6144
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profile import call_kernel_events
from jspec.pallas_kernels import swiglu_gemm as kernel_lib

HIDDEN = 4096


def xla_program():
  def run(x, ws):
    outs = []
    for w in ws:
      gate_up = jnp.einsum("md,dcf->mcf", x, w)
      outs.append(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1])
    return outs
  return jax.jit(run)


def kernel_program(tiling: str):
  given = {}
  if tiling != "auto":
    block_k, block_n, stages, warps = (int(v) for v in tiling.split(","))
    given = dict(block_k=block_k, block_n=block_n, num_stages=stages, num_warps=warps)
  return jax.jit(lambda x, ws: [kernel_lib.swiglu_gemm(x, w, **given) for w in ws])


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--columns", type=int, nargs="+", default=[12288, 6144],
                      help="F: the intermediate size (a tp shard's)")
  parser.add_argument("--tilings", nargs="+",
                      default=["auto", "128,64,3,4", "128,128,4,4", "256,64,4,4", "64,64,6,4",
                               "128,64,4,8", "256,128,3,8"])
  parser.add_argument("--layers", type=int, default=8)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  print(f"# {jax.devices()[0].device_kind}; us per layer (the program's kernels / layers)")
  rows_out = []
  for f in args.columns:
    ws = [jnp.asarray(rng.standard_normal((HIDDEN, 2, f)) / 64.0, jnp.bfloat16)
          for _ in range(args.layers)]
    nbytes = HIDDEN * 2 * f * 2
    for rows in args.rows:
      x = jnp.asarray(rng.standard_normal((rows, HIDDEN)), jnp.bfloat16)
      want = None
      for name, fn in [("xla", xla_program())] + [(t, kernel_program(t)) for t in args.tilings]:
        try:
          out = np.asarray(fn(x, ws)[0], np.float32)
        except jax.errors.JaxRuntimeError as error:  # e.g. more shared memory than the SM has
          print(f"# {f} {rows} {name}: {str(error).splitlines()[0]}", flush=True)
          continue
        want = out if want is None else want
        times = collections.defaultdict(float)
        for begin, end, kernel in call_kernel_events(fn, x, ws):
          times[kernel] += (end - begin) / 1e3 / args.layers
        total = sum(times.values())
        longest = max(times, key=times.get)
        row = (f, rows, name, times[longest], nbytes / times[longest] / 1e6, total,
               float(np.abs(out - want).max()), len(times))
        rows_out.append(row)
        print(row, flush=True)
  print("\n| F | rows | setting | main kernel us | its TB/s | all kernels us | max diff to XLA "
        "| kernels |")
  print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
  for f, rows, name, main_us, tbs, total, diff, count in rows_out:
    print(f"| {f} | {rows} | {name} | {main_us:.2f} | {tbs:.2f} | {total:.2f} | {diff:.1e} "
          f"| {count} |")


if __name__ == "__main__":
  main()
