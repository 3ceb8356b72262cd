"""What each Mosaic GPU call site adds to XLA's compile of a program: N chained products of one
shape, [256 or 1, 2048] x [2048, 2048], each against its own weight, compiled as one program:

  bf16        XLA's dot
  fp8         the FP8 prefill kernel (fp8_prefill: x quantized to e4m3 by XLA ops, the kernel,
              its K slices summed)
  fp8_decode  the FP8 few-row kernel on the first row (fp8_gemm)

Every call site of one kind is the same kernel (one Mosaic compile, reused), so the compile's
growth with N is XLA's own work per call site. Why: FP8's warm-up grows faster with the layer
count than bf16's (BENCHMARKS.md, "FP8 warm-up"), and an unrolled model holds one call site per
layer and product.

    python benchmarks/mosaic_compile_cost.py --counts 1 16 64 192
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp

from jspec.pallas_kernels import fp8_gemm, fp8_prefill

ROWS, K, N = 256, 2048, 2048


def chained(kind: str, count: int):
  def run(x, ws, scales):
    for w, scale in zip(ws, scales):
      if kind == "fp8":
        y = fp8_prefill.fp8_prefill_matmul(x, w, scale)
      elif kind == "fp8_decode":
        y = jnp.broadcast_to(fp8_gemm.fp8_matmul(x[:1], w, scale), x.shape)
      else:
        y = x @ w
      x = x + y
    return x

  x = jax.ShapeDtypeStruct((ROWS, K), jnp.bfloat16)
  weight = jax.ShapeDtypeStruct((N, K), jnp.bfloat16 if kind == "bf16" else jnp.float8_e4m3fn)
  scale = jax.ShapeDtypeStruct((N // 128, K // 128), jnp.float32)
  return jax.jit(run).trace(x, [weight] * count, [scale] * count)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--counts", type=int, nargs="+", default=[1, 16, 64, 192])
  parser.add_argument("--kinds", nargs="+", default=["bf16", "fp8", "fp8_decode"])
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}")
  print(f"{'kind':10s} {'N':>4s} {'lower s':>8s} {'compile s':>9s} {'optimized HLO MB':>16s} "
        f"{'Mosaic calls':>12s}")
  for count in args.counts:
    for kind in args.kinds:
      start = time.perf_counter()
      lowered = chained(kind, count).lower()
      lowered_at = time.perf_counter()
      hlo = lowered.compile().as_text()
      compiled_at = time.perf_counter()
      calls = len(re.findall(r'custom_call_target="mosaic_gpu_v2"', hlo))
      print(f"{kind:10s} {count:4d} {lowered_at - start:8.2f} {compiled_at - lowered_at:9.2f} "
            f"{len(hlo) / 1e6:16.2f} {calls:12d}", flush=True)


if __name__ == "__main__":
  main()
