"""A few rows' product as K slices' float32 partials: the Triton kernel
(jspec.pallas_kernels.k_slice_gemm) against XLA's batched GEMM (tensor_parallel's
k_slice_partials), the kernels' time per product from the profiler. With `--direct`, the
whole product in x's dtype: `row_gemm` (no K slices) against the models' one-GPU product
(skinny_gemm.project: XLA's GEMM, two equal rows for one).

Qwen3-8B's products as a decode step hands them over: o and down (row products, [S, M, N]) and
the fused q / k / v (`rows_last`, [S, N, M]), one GPU's and a tp = 2 shard's; `--layers`
different weights in one program (as a step's layers: no weight read from L2). Tilings:
"auto" (the module's, with --slices' first count) or "block_k,block_n,stages,warps,slices".

    python benchmarks/k_slice_gemm.py --rows 2 8
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profile import call_kernel_events
from jspec.pallas_kernels import k_slice_gemm as kernel_lib
from jspec.pallas_kernels.skinny_gemm import project
from jspec.sharding.tensor_parallel import k_slice_partials

# name: (K, N, rows_last), Qwen3-8B (hidden 4096, 32 q heads and 8 KV heads of 128, MLP 12288)
PRODUCTS = {
    "o": (4096, 4096, False), "down": (12288, 4096, False), "qkv": (4096, 6144, True),
    "o/2": (2048, 4096, False), "down/2": (6144, 4096, False), "qkv/2": (4096, 3072, True),
    # Qwen3-30B-A3B (hidden 2048, 32 q heads and 4 KV heads of 128)
    "a3b-o": (4096, 2048, False), "a3b-qkv": (2048, 5120, False),
    "gate_up": (4096, 24576, False),
}
DIRECT_TILINGS = ["128,32,4,4", "128,16,4,4", "256,32,3,4", "128,64,4,4", "64,32,4,4",
                  "256,16,4,4", "128,32,4,8", "128,32,5,4"]


KSLICE_TILINGS = ["auto", "128,64,4,4,2", "128,64,4,4,8", "256,64,3,4,4", "64,64,4,4,4",
                  "128,128,4,4,4", "128,32,4,4,4", "128,64,3,8,4"]


def xla_program(slices: int, rows_last: bool):
  return jax.jit(lambda x, ws: [k_slice_partials(x, w, slices, rows_last) for w in ws])


def kernel_program(tiling: str, slices: int, rows_last: bool):
  given = {}
  if tiling != "auto":
    block_k, block_n, stages, warps, slices = (int(v) for v in tiling.split(","))
    given = dict(block_k=block_k, block_n=block_n, num_stages=stages, num_warps=warps)
  return jax.jit(lambda x, ws: [kernel_lib.k_slice_gemm(x, w, slices, rows_last, **given)
                                for w in ws])


def project_program():
  return jax.jit(lambda x, ws: [project(x[None], w)[0] for w in ws])


def row_program(tiling: str):
  block_k, block_n, stages, warps = (int(v) for v in tiling.split(","))
  return jax.jit(lambda x, ws: [kernel_lib.row_gemm(x, w, block_k=block_k, block_n=block_n,
                                                    num_stages=stages, num_warps=warps)
                                for w in ws])


def summed(out, rows: int, rows_last: bool):
  out = np.asarray(out, np.float64).sum(axis=0)
  return out[:, :rows].T if rows_last else out[:rows]


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, nargs="+", default=[2, 8])
  parser.add_argument("--products", nargs="+", default=list(PRODUCTS), choices=list(PRODUCTS))
  parser.add_argument("--slices", type=int, default=4, help="XLA's and auto's K slices")
  parser.add_argument("--tilings", nargs="+", help="default: the mode's list above")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--direct", action="store_true",
                      help="row_gemm (tilings block_k,block_n,stages,warps) against project")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  print(f"# {jax.devices()[0].device_kind}; us per product (the program's kernels / layers; "
        f"span: first kernel's start to last kernel's end)")
  table = []
  for product in args.products:
    k, n, rows_last = PRODUCTS[product]
    ws = [jnp.asarray(rng.standard_normal((k, n)) / 64.0, jnp.bfloat16)
          for _ in range(args.layers)]
    nbytes = k * n * 2
    for rows in args.rows:
      x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
      want = None
      if args.direct:
        programs = [("project", project_program())]
        programs += [(t, row_program(t)) for t in args.tilings or DIRECT_TILINGS]
      else:
        programs = [("xla", xla_program(args.slices, rows_last))]
        programs += [(t, kernel_program(t, args.slices, rows_last))
                     for t in args.tilings or KSLICE_TILINGS]
      for name, fn in programs:
        try:
          out = fn(x, ws)[0]
          out = (np.asarray(out, np.float64) if args.direct
                 else summed(out, rows, rows_last))
        except (jax.errors.JaxRuntimeError, ValueError) as error:
          print(f"# {product} {rows} {name}: {str(error).splitlines()[0]}", flush=True)
          continue
        want = out if want is None else want
        times = collections.defaultdict(float)
        events = call_kernel_events(fn, x, ws)
        for begin, end, kernel in events:
          times[kernel] += (end - begin) / 1e3 / args.layers
        span = (max(e for _, e, _ in events) - min(b for b, _, _ in events)) / 1e3 / args.layers
        total = sum(times.values())
        row = (product, rows, name, total, nbytes / total / 1e6, span,
               float(np.abs(out - want).max()), len(times))
        table.append(row)
        print(row, flush=True)
  print("\n| product | rows | setting | kernels us | TB/s | span us | max diff to XLA | kernels |")
  print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
  for product, rows, name, total, tbs, span, diff, count in table:
    print(f"| {product} | {rows} | {name} | {total:.2f} | {tbs:.2f} | {span:.2f} | {diff:.1e} "
          f"| {count} |")


if __name__ == "__main__":
  main()
