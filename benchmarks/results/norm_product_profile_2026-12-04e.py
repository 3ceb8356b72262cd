"""The one-kernel residual add + RMSNorm + projection partials (norm_product.py at 6789d02,
path given) against the two kernels a step runs (add + RMSNorm, then XLA's K-slice GEMM for
bf16 or the Mosaic GPU few-row kernel for FP8), by the profiler: each kernel's own time in a
chain of 24 layers at one row, µs a layer by kernel name.

    git show 6789d02:jspec/pallas_kernels/norm_product.py > /tmp/norm_product.py
    PYTHONPATH=. python3 benchmarks/results/norm_product_profile_2026-12-04e.py /tmp/norm_product.py
"""
import collections
import importlib.util
import sys

import jax
import jax.numpy as jnp

from jspec.bench.profile import call_kernel_events
from jspec.pallas_kernels import fp8_gemm
from jspec.pallas_kernels.residual_norm import rms_norm
from jspec.sharding.tensor_parallel import k_slice_partials

spec = importlib.util.spec_from_file_location("norm_product", sys.argv[1])
norm_product = importlib.util.module_from_spec(spec)
spec.loader.exec_module(norm_product)
EPS, LAYERS = 1e-6, 24


def weights(key, fp8, d, n):
  out = []
  for k in jax.random.split(key, LAYERS):
    if not fp8:
      out.append((jax.random.normal(k, (d, n), jnp.bfloat16) * d ** -0.5, None))
    else:
      w8 = jnp.clip(jax.random.normal(k, (n, d), jnp.float32) * 100, -448, 448)
      out.append((w8.astype(jnp.float8_e4m3fn),
                  jnp.full((n // 128, d // 128), d ** -0.5 / 100, jnp.float32)))
  return out


def two(x, delta, scale, w, ws):
  h, normed = rms_norm(x, scale, delta, eps=EPS)
  if ws is None:
    return h, k_slice_partials(normed, w, 4, rows_last=True)
  return h, fp8_gemm.fp8_partials_many(normed, (w,), (ws,))[0]


def one(x, delta, scale, w, ws):
  return norm_product.add_norm_partials(x, delta, scale, w, ws, eps=EPS)


def chain(form):
  def run(x, delta, scale, layers):
    for w, ws in layers:
      h, parts = form(x, delta, scale, w, ws)
      x, delta = h, delta * (1 + (parts[0, 0, 0] > 1e30)).astype(delta.dtype)
    return x
  return jax.jit(run)


print(jax.devices()[0].device_kind, f"{LAYERS} layers chained, 1 row; µs a layer by kernel")
for d, n in ((2048, 5120), (4096, 6144), (4096, 2048), (2048, 4096)):
  x = jax.random.normal(jax.random.key(0), (1, d), jnp.bfloat16)
  delta = jax.random.normal(jax.random.key(1), (1, d), jnp.bfloat16)
  scale = jnp.ones((d,), jnp.bfloat16)
  for fp8 in (False, True):
    layers = weights(jax.random.key(d + n), fp8, d, n)
    mb = layers[0][0].nbytes / 1e6
    for name, form in (("two kernels", two), ("one kernel", one)):
      events = call_kernel_events(chain(form), x, delta, scale, layers)
      by = collections.defaultdict(float)
      for begin, end, kname in events:
        by[kname[:40]] += (end - begin) / 1e3 / LAYERS
      top = sorted(by.items(), key=lambda kv: -kv[1])
      busy = sum(by.values())
      print(f"{d}x{n} {'fp8' if fp8 else 'bf16'} ({mb:.1f} MB) {name}: busy {busy:.2f} | "
            + ", ".join(f"{k} {v:.2f}" for k, v in top[:4]), flush=True)
