"""Expert parallelism: all-gather + reduce-scatter against all-to-all, per token count.

    PYTHONPATH=. python3 benchmarks/ep_strategies.py --ep 2 --tokens 8 32 128 512 2048 8192

One MoE layer of the preset's shapes (default Qwen3-30B-A3B: 128 experts, top-8, hidden 2048,
expert intermediate 768), random bf16 weights sharded by jspec's rules over a (dp=1, ep, tp)
mesh, tokens split over ep, routing from a random router (softmax top-k). Both strategies run
the same expert backend (`--moe-backend`, "auto" = the Pallas kernels on Hopper) through
`jspec.sharding.moe.sharded_experts`; each figure is the median time per call over queued batches
of calls after warm-up. The faster strategy per token count is what `ep_strategy="auto"` should pick.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from jspec.bench.presets import PRESETS
from jspec.bench.roofline import seconds_per_call
from jspec.models.moe import route
from jspec.models.moe_backends import get_experts_fn
from jspec.sharding.moe import sharded_experts
from jspec.sharding.rules import MeshConfig, ShardingRules, global_array


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-30b-a3b")
  parser.add_argument("--ep", type=int, default=2)
  parser.add_argument("--tp", type=int, default=1)
  parser.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128, 512, 2048, 8192])
  parser.add_argument("--moe-backend", default="auto")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--out", default="")
  args = parser.parse_args()

  cfg = PRESETS[args.model]
  mesh = MeshConfig(dp=1, tp=args.tp, ep=args.ep).make_mesh()
  rules = ShardingRules()
  dtype = jnp.dtype(args.dtype)
  e, d, f = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size

  def weights(shape, axes, seed):
    draw = jax.jit(lambda key: (jax.random.normal(key, shape) * shape[1] ** -0.5).astype(dtype),
                   out_shardings=rules.sharding(mesh, axes))
    return draw(jax.random.key(seed))

  w_gate = weights((e, d, f), ("experts", "embed", "moe_mlp"), 1)
  w_up = weights((e, d, f), ("experts", "embed", "moe_mlp"), 2)
  w_down = weights((e, f, d), ("experts", "moe_mlp", "embed"), 3)
  router = jax.random.normal(jax.random.key(4), (d, e), jnp.float32) * d ** -0.5
  base = get_experts_fn(args.moe_backend)
  strategies = {name: jax.jit(sharded_experts(base, mesh, rules, name))
                for name in ("all_gather", "all_to_all")}
  rows = []
  for tokens in args.tokens:
    x = jax.random.normal(jax.random.key(tokens), (tokens, d), jnp.float32)
    ids, w = route(x @ router, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob, dtype)
    put = lambda a, axes: global_array(jax.device_get(a), rules.sharding(mesh, axes))
    inputs = (put(x.astype(dtype), ("batch", None)), put(ids, ("batch", None)),
              put(w, ("batch", None)), w_gate, w_up, w_down)
    times = {name: seconds_per_call(fn, [inputs])
             for name, fn in strategies.items()}
    row = dict(tokens=tokens, ep=args.ep, tp=args.tp, device=jax.devices()[0].device_kind,
               **{f"{name}_us": 1e6 * s for name, s in times.items()},
               faster=min(times, key=times.get))
    rows.append(row)
    print(json.dumps(row), flush=True)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(rows, fh, indent=1)
  print(f"\n{'tokens':>7s} {'all_gather us':>14s} {'all_to_all us':>14s}  faster")
  for r in rows:
    print(f"{r['tokens']:7d} {r['all_gather_us']:14.1f} {r['all_to_all_us']:14.1f}  {r['faster']}")


if __name__ == "__main__":
  main()
