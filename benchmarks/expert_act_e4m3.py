"""The FP8 expert path's activation kernel in its two forms, alone: bf16 act for the down kernel
to widen its tiles against (expert_act.gate_up_act) and e4m3 act with per-slot lanes for e4m3 x
e4m3 products (expert_act.gate_up_act_e4m3), µs a call over --calls calls of distinct partials
in one jitted program (as a step's layers run them: one after another, inputs in L2 or HBM).

    python benchmarks/expert_act_e4m3.py --shapes 4x8x768x8 8x8x768x8 1x8x2048x8 4x64x768x8
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jspec.pallas_kernels import expert_act

from fp8_matmul import timed  # this folder's: benchmarks run as scripts


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="+", default=["4x8x768x8", "8x8x768x8", "1x8x2048x8"],
                      help="PxSxFxN: K slices, slots, expert width, padded tokens")
  parser.add_argument("--calls", type=int, default=48)
  parser.add_argument("--warps", type=int, nargs="+", default=[4, 8],
                      help="the e4m3 form's warps a program (expert_act.E4M3_WARPS)")
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}", flush=True)
  print(f"{'P x S x F x N':>16s} {'bf16 act µs':>12s} "
        + " ".join(f"{f'e4m3 {w}w µs':>12s}" for w in args.warps), flush=True)
  for shape in args.shapes:
    splits, slots, ffn, rows = map(int, shape.split("x"))
    keys = jax.random.split(jax.random.key(0), args.calls)
    parts = [jax.random.normal(k, (2, splits, slots, ffn, rows), jnp.float32) for k in keys]
    used = jnp.asarray([slots], jnp.int32)

    @jax.jit
    def bf16_chain(parts):
      return sum(jnp.sum(expert_act.gate_up_act(p, used)[0, 0, :8].astype(jnp.float32))
                 for p in parts)

    def e4m3_chain(warps):
      expert_act.E4M3_WARPS = warps  # read as the chain is traced (the unjitted function)

      @jax.jit
      def chain(parts):
        total = 0.0
        for p in parts:
          act8, lanes = expert_act.gate_up_act_e4m3.__wrapped__(p, used)
          total = total + jnp.sum(act8[0, 0, :8].astype(jnp.float32)) + lanes[0, 0]
        return total
      return chain

    times = [timed(chain, parts) / args.calls * 1e6
             for chain in [bf16_chain] + [e4m3_chain(w) for w in args.warps]]
    print(f"{shape:>16s} " + " ".join(f"{t:12.2f}" for t in times), flush=True)


if __name__ == "__main__":
  main()
