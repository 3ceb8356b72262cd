"""The residual add + RMSNorm and a projection's K-slice partials in one kernel
(jspec.pallas_kernels.norm_product) against the two kernels a step runs now: the add + norm
kernel (residual_norm.rms_norm with a residual), then the product's partials (bf16: XLA's
batched GEMM over K slices, tensor_parallel.k_slice_partials, with the row doubled as a step
runs it; FP8: the Mosaic GPU few-row kernel, fp8_gemm.fp8_partials_many).

Each form runs `--layers` times in a chain inside one jitted program (a layer's h is the next
layer's x, every layer its own weight, so nothing is served from L2), timed by the slope timer;
µs a layer, and the weight's bytes over that time. Checked first: the fused kernel's partials,
summed, against the two kernels' within bf16 rounding of norm(h).

Both forms carry the chain's dependency, one small XLA kernel a layer, which pulls the ratio
towards 1. The one kernel writes D / 128 slices of partials (16 at D = 2048) where the bf16
form writes `--slices` (4) and the FP8 kernel its own count: their reader (the q / k norm +
RoPE kernel) is not timed here.

    python3 benchmarks/norm_product.py --shapes 2048x5120 4096x6144 --precisions bf16 fp8
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.roofline import seconds_per_call
from jspec.pallas_kernels import fp8_gemm, norm_product
from jspec.pallas_kernels.residual_norm import rms_norm
from jspec.sharding.tensor_parallel import k_slice_partials

EPS = 1e-6


def weights(key, precision: str, d: int, n: int, layers: int):
  keys = jax.random.split(key, layers)
  if precision == "bf16":
    return [(jax.random.normal(k, (d, n), jnp.bfloat16) * d ** -0.5, None) for k in keys]
  out = []
  for k in keys:
    # Clipped to e4m3's range: a value past it casts to NaN.
    w8 = jnp.clip(jax.random.normal(k, (n, d), jnp.float32) * 100, -448, 448)
    w8 = w8.astype(jnp.float8_e4m3fn)
    out.append((w8, jnp.full((n // 128, d // 128), d ** -0.5 / 100, jnp.float32)))
  return out


def two_kernels(x, delta, scale, w, w_scale, slices):
  h, normed = rms_norm(x, scale, delta, eps=EPS)
  if w_scale is None:
    parts = k_slice_partials(normed, w, slices, rows_last=True)
  else:
    parts, _ = fp8_gemm.fp8_partials_many(normed, (w,), (w_scale,))
  return h, parts


def fused(x, delta, scale, w, w_scale, slices):
  return norm_product.add_norm_partials(x, delta, scale, w, w_scale, eps=EPS)


def chain(form, slices):
  def run(x, delta, scale, layers):
    for w, w_scale in layers:
      h, parts = form(x, delta, scale, w, w_scale, slices)
      # The next layer's input depends on this one's partials (no reordering across layers).
      x, delta = h, delta * (1 + (parts[0, 0, 0] > 1e30)).astype(delta.dtype)
    return x
  return jax.jit(run)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="+", default=["2048x5120", "4096x6144"],
                      help="D x N (the norm's width x the product's columns)")
  parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
  parser.add_argument("--layers", type=int, default=24)
  parser.add_argument("--slices", type=int, default=4, help="the bf16 two-kernel form's K slices")
  args = parser.parse_args()
  rows = []
  for shape in args.shapes:
    d, n = (int(v) for v in shape.split("x"))
    for precision in args.precisions:
      key = jax.random.key(d * n)
      x = jax.random.normal(key, (1, d), jnp.bfloat16)
      delta = jax.random.normal(jax.random.key(1), (1, d), jnp.bfloat16)
      scale = jnp.ones((d,), jnp.bfloat16)
      layers = weights(key, precision, d, n, args.layers)
      # Check: the two forms' products of the first layer agree.
      w, w_scale = layers[0]
      _, parts_a = jax.jit(two_kernels, static_argnums=5)(x, delta, scale, w, w_scale,
                                                          args.slices)
      _, parts_b = jax.jit(fused, static_argnums=5)(x, delta, scale, w, w_scale, args.slices)
      prod_a = np.asarray(parts_a, np.float64).sum(axis=0)[:, 0]
      prod_b = np.asarray(parts_b, np.float64).sum(axis=0)[:, 0]
      err = np.abs(prod_a - prod_b).max() / np.abs(prod_a).max()
      assert err < 2e-2, (shape, precision, err)
      weight_bytes = sum(w.nbytes for w, _ in layers) / args.layers
      result = {}
      for name, form in (("two kernels", two_kernels), ("one kernel", fused)):
        program = chain(form, args.slices)
        seconds = seconds_per_call(program, [(x, delta, scale, layers)]) / args.layers
        result[name] = seconds
        print(f"{shape} {precision} {name}: {1e6 * seconds:.2f} µs a layer, "
              f"{weight_bytes / seconds / 1e12:.2f} TB/s", flush=True)
      rows.append((shape, precision, weight_bytes, result, err))
  print(f"\n{jax.devices()[0].device_kind}, {args.layers} layers chained, 1 row")
  print("| D x N | weights | MB | two kernels µs (TB/s) | one kernel µs (TB/s) | one / two | "
        "max rel. diff |")
  print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
  for shape, precision, nbytes, result, err in rows:
    a, b = result["two kernels"], result["one kernel"]
    print(f"| {shape} | {precision} | {nbytes / 1e6:.1f} | {1e6 * a:.2f} ({nbytes / a / 1e12:.2f}) "
          f"| {1e6 * b:.2f} ({nbytes / b / 1e12:.2f}) | {b / a:.3f}x | {err:.1e} |")


if __name__ == "__main__":
  main()
