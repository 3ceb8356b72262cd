"""Does a weight read by the kernel before its product make the product faster?

Per layer of a chain of `--layers` distinct weights: a light Pallas Triton kernel of 132
programs, each reading `fraction` of its share of the next weight with real loads (summed into
a small output, so that nothing is dropped; no prefetch hint), then the product of one row with
that weight: XLA's two-row GEMM for a bf16 [K, N] weight, jspec's FP8 few-row kernel for an
e4m3 [N, K] one. Why: the small kernels between a layer's products leave HBM idle, and
`cp.async.bulk.prefetch.L2` hints tried three times made no product faster (BENCHMARKS.md);
loads that surely reach L2 settle whether L2 can hold the next weight at all. CUPTI time by
kernel kind, µs a layer; fraction -1 runs no light kernel.

    python benchmarks/l2_warm_loads.py
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.bench.profile import call_kernel_events
from jspec.pallas_kernels import fp8_gemm, platform

PROGRAMS = 132
BLOCK_ROWS = 8


def blocks_read(rows: int, fraction: float) -> int:
  """BLOCK_ROWS-row blocks each program reads of its share of `rows` (none below fraction 0)."""
  return int(rows // PROGRAMS * max(fraction, 0)) // BLOCK_ROWS


def read_ahead(words_RC, fraction: float):
  """A light kernel whose programs each read `fraction` of their share of words_RC's rows."""
  share = words_RC.shape[0] // PROGRAMS
  blocks = blocks_read(words_RC.shape[0], fraction)

  def body(w_ref, o_ref):
    p = pl.program_id(0)
    acc = jnp.zeros((BLOCK_ROWS, w_ref.shape[1]), jnp.int32)
    for b in range(blocks):
      acc = acc ^ w_ref[pl.ds(p * share + b * BLOCK_ROWS, BLOCK_ROWS), :]
    o_ref[p] = jnp.sum(acc)

  return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((PROGRAMS,), jnp.int32),
                        grid=(PROGRAMS,), name="read_ahead",
                        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
                        interpret=not platform.on_gpu())(words_RC)


def as_words(w):
  """The weight's bytes as int32 [rows, columns / (4 / itemsize)] (a bitcast, no copy)."""
  per_word = 4 // w.dtype.itemsize
  return jax.lax.bitcast_convert_type(w.reshape(w.shape[0], -1, per_word), jnp.int32)


def chain(kind: str, fraction: float):
  def run(x, ws, scales):
    read = jnp.int32(0)
    for w, scale in zip(ws, scales):
      if fraction >= 0:
        read = read + read_ahead(as_words(w), fraction)[0]
      if kind == "bf16":
        y = jnp.dot(jnp.stack([x[0], x[0]]), w)[:1]
      else:
        y = fp8_gemm.fp8_matmul(x, w, scale)
      x = (y[:, :x.shape[1]] * 0.5).astype(x.dtype)
    return x, read
  return jax.jit(run)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=24)
  parser.add_argument("--size", type=int, default=4096, help="K = N")
  parser.add_argument("--fractions", type=float, nargs="+", default=[-1, 0, 0.5, 1])
  args = parser.parse_args()
  k = n = args.size
  key = jax.random.key(0)
  x = jax.random.normal(key, (1, k), jnp.bfloat16)
  weights = {
      "bf16": ([jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.02
                for i in range(args.layers)], [None] * args.layers),
      "fp8": ([jax.random.normal(jax.random.fold_in(key, 100 + i), (n, k)).astype(
          jnp.float8_e4m3fn) for i in range(args.layers)],
              [jnp.full((n // 128, k // 128), 0.01, jnp.float32)] * args.layers),
  }
  print(f"device: {jax.devices()[0].device_kind}; {k} x {n}, {args.layers} layers")
  print(f"{'weight':6s} {'fraction':>8s} {'MB read ahead':>13s} {'read us':>8s} "
        f"{'product us':>10s} {'rest us':>8s} {'span us':>8s}")
  for kind, (ws, scales) in weights.items():
    for fraction in args.fractions:
      events = call_kernel_events(chain(kind, fraction), x, ws, scales)
      by_kind = collections.defaultdict(float)
      for start, end, name in events:
        part = ("read" if "read_ahead" in name else
                "product" if "gemm" in name or "dot" in name else "rest")
        by_kind[part] += (end - start) / 1e3 / args.layers
      rows = ws[0].shape[0]
      read_mb = PROGRAMS * blocks_read(rows, fraction) * BLOCK_ROWS * ws[0].nbytes / rows / 1e6
      span = (events[-1][1] - events[0][0]) / 1e3 / args.layers
      print(f"{kind:6s} {fraction:8.2f} {read_mb:13.1f} {by_kind['read']:8.2f} "
            f"{by_kind['product']:10.2f} {by_kind['rest']:8.2f} {span:8.2f}", flush=True)


if __name__ == "__main__":
  main()
