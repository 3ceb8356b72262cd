"""The residual add + RMSNorm kernel (jspec.pallas_kernels.residual_norm) at the hidden sizes of
the models, a row read in one masked block (row_block, the default) against row_chunk's pieces:
µs a call in a chain of `--calls` calls (each the next one's residual) in one jitted loop, and
the two forms' outputs side by side.

    python benchmarks/norm_widths.py --widths 4096 5120 7168 8192 --rows 1 8
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.pallas_kernels import residual_norm


def chain(calls: int):
  def run(x, delta, scale):
    def body(_, carry):
      x, delta = carry
      h, normed = residual_norm.rms_norm(x, scale, delta, eps=1e-6)
      return h, normed
    return jax.lax.fori_loop(0, calls, body, (x, delta))
  return jax.jit(run)


def timed(fn, *args, repeats: int = 20) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--widths", type=int, nargs="+", default=[4096, 5120, 7168, 8192])
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--calls", type=int, default=200)
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}; add + RMSNorm, bf16, {args.calls} calls chained")
  print(f"{'width':>6s} {'rows':>4s} {'block':>6s} {'one block us':>12s} {'pieces':>6s} "
        f"{'pieces us':>9s} {'outputs equal':>13s}")
  rng = np.random.default_rng(0)
  for width in args.widths:
    for rows in args.rows:
      x = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
      delta = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
      scale = jnp.asarray(1 + 0.1 * rng.standard_normal(width), jnp.bfloat16)
      results = {}
      for one_block in (True, False):
        residual_norm.ONE_BLOCK = one_block
        jax.clear_caches()  # the kernel's trace reads the flag
        fn = chain(args.calls)
        seconds = timed(fn, x, delta, scale)
        results[one_block] = (residual_norm.row_block(width), 1e6 * seconds / args.calls,
                              np.asarray(fn(x, delta, scale)[1], np.float32))
      residual_norm.ONE_BLOCK = True
      (block, one_us, one_out), (chunk, piece_us, piece_out) = results[True], results[False]
      equal = bool(np.array_equal(one_out, piece_out))
      print(f"{width:6d} {rows:4d} {block:6d} {one_us:12.2f} {chunk:6d} {piece_us:9.2f} "
            f"{str(equal):>13s}", flush=True)


if __name__ == "__main__":
  main()
