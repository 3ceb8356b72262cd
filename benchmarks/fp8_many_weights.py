"""Several FP8 weights of one x in one kernel call, against one call over the same weights
joined into one: what a call of q, k and v (or gate and up) costs beyond its bytes.

For each group of weights (N_i columns each, all of K inputs) and row count, --layers groups of
different e4m3 weights multiply one x in one jitted program, under the profiler:
`fp8_gemm.fp8_partials_many` over the group as the models call it, and the same over the
group's weights concatenated along N (one weight, the same bytes). Columns: the product
kernel's µs per call (`fp8_block_gemm_*`), each way.

    python benchmarks/fp8_many_weights.py
    python benchmarks/fp8_many_weights.py --groups 2048:4096,512,512 --rows 1
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jspec.pallas_kernels.fp8_gemm import fp8_partials_many
from fp8_kernel_routes import profiled_kernels, weights

# K:N_1,N_2,...: Qwen3-30B-A3B's q / k / v, Qwen3-8B's q / k / v, and two weights of Qwen3-8B's
# gate / up size (the MLP holds gate and up as one weight: a bound on what two weights cost)
GROUPS = ("2048:4096,512,512", "4096:4096,1024,1024", "4096:12288,12288")


def kernel_us(fn, *args, calls: int) -> float:
  """µs per call of the FP8 product kernel in one run of `fn`."""
  totals = profiled_kernels(fn, *args)
  return sum(ns for name, (_, ns) in totals.items() if name.startswith("fp8_block")) / calls / 1e3


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--groups", nargs="+", default=list(GROUPS), help="K:N_1,N_2,...")
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--layers", type=int, default=8)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  print(f"device: {jax.devices()[0].device_kind}")
  print(f"{'K':>5s} {'N per weight':>18s} {'rows':>4s} {'MB':>6s} {'one call us':>11s} "
        f"{'joined us':>9s}")
  for group in args.groups:
    k_text, ns_text = group.split(":")
    k, ns = int(k_text), [int(n) for n in ns_text.split(",")]
    per_weight = [weights(k, n, args.layers, rng) for n in ns]  # (w8s, scales) per weight
    layers = [[(w8s[i], scales[i]) for w8s, scales in per_weight] for i in range(args.layers)]
    joined = [(jnp.concatenate([w for w, _ in ws]), jnp.concatenate([s for _, s in ws]))
              for ws in layers]

    @jax.jit
    def apart(x, layers):
      return [fp8_partials_many(x, tuple(w for w, _ in ws), tuple(s for _, s in ws))[0]
              for ws in layers]

    @jax.jit
    def together(x, joined):
      return [fp8_partials_many(x, (w,), (s,))[0] for w, s in joined]

    for rows in args.rows:
      x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
      one_call = kernel_us(apart, x, layers, calls=args.layers)
      one_weight = kernel_us(together, x, joined, calls=args.layers)
      print(f"{k:5d} {ns_text:>18s} {rows:4d} {k * sum(ns) / 1e6:6.1f} {one_call:11.2f} "
            f"{one_weight:9.2f}", flush=True)


if __name__ == "__main__":
  main()
