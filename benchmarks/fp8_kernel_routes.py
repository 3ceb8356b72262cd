"""The few-row FP8 product kernel's own time per activation route, from the profiler: what
holds its stream (the e4m3 tile's widening in registers, or the stream itself).

For each weight shape and row count, --layers different e4m3 weights [N, K] (128 x 128 block
scales) multiply one x in one jitted program, under the profiler, for each route of
jspec.pallas_kernels.fp8_gemm.fp8_matmul (`activations`): "bfloat16" (x as it is, each e4m3
tile widened to bfloat16 through float16 and float32: four conversions per two values),
"float16" (x scaled per row into float16, the tile widened in one conversion per two values),
"e4m3" (x quantized per row and 128-K group, e4m3 x e4m3 wgmma: no widening). And XLA's bf16
product of the same shapes as the baseline, and XLA's own product of the e4m3 weight times its
scales (what XLA fuses into its GEMM, with or without
`--xla_gpu_experimental_enable_subchannel_dequantisation_fusion`): "xla_f32" (the library's
fallback: the weight times the repeated scale in float32, cast to bfloat16), "xla_bf16" (the
weight widened to bfloat16 times the repeated scale in bfloat16), "xla_rows" (the scale
repeated over the weight's N rows beforehand, [N, K/128] bfloat16, times each 128-K group).
Columns: µs per weight of the product kernel alone (`fp8_block_gemm_*`; XLA's longest kernel
for its routes), its weight bytes over that time, and µs per weight of every kernel the route
runs (x's passes, the K-slice sums, XLA's separate dequantization where it does not fuse it).

    python benchmarks/fp8_kernel_routes.py --rows 1 8
    python benchmarks/fp8_kernel_routes.py --routes bfloat16 --tilings 0,0,0 2,6,0 1,4,0
    XLA_FLAGS=--xla_gpu_experimental_enable_subchannel_dequantisation_fusion=true \
      python benchmarks/fp8_kernel_routes.py --routes bf16 bfloat16 xla_f32 xla_bf16 xla_rows
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profile import call_kernel_events
from jspec.pallas_kernels.fp8_block_kernel import Fp8Tiling
from jspec.pallas_kernels.fp8_gemm import fp8_matmul
from jspec.pallas_kernels.residual_norm import rms_norm
from jspec.pallas_kernels.shared import dequantize

ROUTES = ("bf16", "bfloat16", "float16", "e4m3", "xla_f32", "xla_bf16", "xla_rows")
XLA_ROUTES = ("bf16", "xla_f32", "xla_bf16", "xla_rows")
SHAPES = ("4096x24576", "12288x4096", "4096x6144", "4096x4096")  # K x N, Qwen3-8B's


def weights(k: int, n: int, layers: int, rng):
  w8 = [jnp.asarray(rng.standard_normal((n, k)) * 0.5, jnp.float8_e4m3fn)
        for _ in range(layers)]
  scales = [jnp.asarray(rng.uniform(0.5, 2.0, (n // 128, k // 128)) * 1e-2, jnp.float32)
            for _ in range(layers)]
  return w8, scales


def xla_product(route: str, x, w8, scale):
  """x [M, K] times the e4m3 weight [N, K] with its scales, as XLA's einsum of the scaled weight;
  xla_rows' scale is [N, K/128] (repeated over rows beforehand)."""
  if route == "xla_f32":
    scaled = dequantize(w8, scale, 1, (128, 128), jnp.bfloat16, jnp)
  elif route == "xla_bf16":
    full = jnp.repeat(jnp.repeat(scale.astype(jnp.bfloat16), 128, 0), 128, 1)
    scaled = w8.astype(jnp.bfloat16) * full
  else:
    n, k = w8.shape
    grouped = w8.astype(jnp.bfloat16).reshape(n, k // 128, 128) * scale[:, :, None]
    scaled = grouped.reshape(n, k)
  return jnp.einsum("mk,nk->mn", x, scaled)


def chained_x(x_MK, y_MN):
  """The next product's x from this one's output, through the residual add and RMSNorm kernel
  a step runs between its products (x's width: y sliced or zero-padded to it)."""
  k, n = x_MK.shape[1], y_MN.shape[1]
  delta = y_MN[:, :k] if n >= k else jnp.pad(y_MN, ((0, 0), (0, k - n)))
  _, normed = rms_norm(delta.astype(x_MK.dtype), jnp.ones((k,), x_MK.dtype), x_MK, eps=1e-6)
  return normed


def program(route: str, tiling: Fp8Tiling | None = None, splits: int | None = None,
            chain: bool = False):
  def run(x, ws, scales):
    outs = []
    for w, s in zip(ws, scales):
      if chain and outs:
        x = chained_x(x, outs[-1])
      if route == "bf16":
        outs.append(jnp.dot(x, w))
      elif route in XLA_ROUTES:
        outs.append(xla_product(route, x, w, s))
      else:
        outs.append(fp8_matmul(x, w, s, activations=route, tiling=tiling, splits=splits))
    return outs
  return jax.jit(run)


def parse_tiling(text: str):
  """"blocks_per_step,num_stages,splits" (0: the library's choice) -> (tiling, splits)."""
  blocks, stages, splits = (int(v) for v in text.split(","))
  tiling = Fp8Tiling(blocks_per_step=blocks, num_stages=stages) if blocks else None
  return tiling, splits or None


def profiled_kernels(fn, *args) -> dict:
  """{kernel name: (count, total ns)} of one call of the compiled `fn`."""
  totals = collections.defaultdict(lambda: [0, 0])
  for start, end, name in call_kernel_events(fn, *args):
    totals[name][0] += 1
    totals[name][1] += end - start
  return totals


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
  parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--tilings", nargs="+", default=["0,0,0"],
                      help="FP8 routes under each blocks_per_step,num_stages,splits (0: the "
                           "library's choice)")
  parser.add_argument("--chain", action="store_true",
                      help="each product's x made from the one before's output by the residual "
                           "add and RMSNorm kernel, as in a step (the products then wait on it)")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  print(f"device: {jax.devices()[0].device_kind}")
  print(f"{'K x N':>12s} {'rows':>4s} {'route':>9s} {'tiling':>7s} {'kernel us':>9s} {'TB/s':>6s} "
        f"{'all us':>8s}  kernels")
  for shape in args.shapes:
    k, n = (int(v) for v in shape.split("x"))
    w8, scales = weights(k, n, args.layers, rng)
    w16 = [w.astype(jnp.bfloat16).T for w in w8]
    rows_scales = [jnp.repeat(s, 128, 0).astype(jnp.bfloat16) for s in scales]
    for rows in args.rows:
      x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
      for route, tiling_text in [(r, t) for r in args.routes
                                 for t in (args.tilings if r not in XLA_ROUTES else ["0,0,0"])]:
        ws = w16 if route == "bf16" else w8
        ss = rows_scales if route == "xla_rows" else scales
        totals = profiled_kernels(program(route, *parse_tiling(tiling_text), args.chain),
                                  x, ws, ss)
        main_name = "fp8_block_gemm" if route not in XLA_ROUTES else None
        if main_name is None:  # XLA's product: its longest kernel
          main_name = max(totals, key=lambda name: totals[name][1])
        main_ns = sum(ns for name, (_, ns) in totals.items() if name.startswith(main_name))
        all_ns = sum(ns for _, ns in totals.values())
        nbytes = n * k * (2 if route == "bf16" else 1)
        per = main_ns / args.layers
        names = ", ".join(f"{name[:28]} x{c // args.layers}" for name, (c, _) in
                          sorted(totals.items(), key=lambda kv: -kv[1][1])[:4])
        print(f"{shape:>12s} {rows:4d} {route:>9s} {tiling_text:>7s} {per / 1e3:9.2f} "
              f"{nbytes / per / 1e3:6.2f} "
              f"{all_ns / args.layers / 1e3:8.2f}  {names}", flush=True)


if __name__ == "__main__":
  main()
