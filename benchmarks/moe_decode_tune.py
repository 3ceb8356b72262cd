"""The decode-path expert kernels at real shapes: correctness, then tilings side by side.

    PYTHONPATH=. python3 benchmarks/moe_decode_tune.py --json moe_decode_tune.json
    PYTHONPATH=. python benchmarks/moe_decode_tune.py --tiny     # interpret mode on CPU

For each shape and tiling variant: experts_decode against experts_reference (relative L2 error,
the worst over the variants is printed; random bf16 weights, a uniform random top-k), the whole
call's time (default tilings), then each variant's time for its slot plan and two GEMM kernels
(combine excluded), timed as chained calls in one program, and the bytes they
must read (the selected experts' weights) over that time against the read bandwidth measured
in the same run. Inputs rotate over four routings and, where they fit in 4 GB, four weight
copies, so that no call is served the previous call's experts from L2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from jspec.bench.roofline import hbm_bandwidth

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_kernels import seconds_per_chained_call  # noqa: E402
from jspec.models.moe_backends import experts_reference
from jspec.pallas_kernels import (DecodeTiling, decode_tilings, down_decode, experts_decode,
                                  gate_up_decode, plan_decode)
from jspec.pallas_kernels.decode_routing import padded_tokens

SHAPES = {
    # name: (experts E, top-k K, hidden D, expert intermediate F), token counts
    "qwen3-30b-a3b": ((128, 8, 2048, 768), (1, 8, 32)),
    "qwen3.5-35b-a3b": ((256, 8, 2048, 512), (1, 8)),
    "deepseek-v3": ((256, 8, 7168, 2048), (1, 8)),
}
# (gate_up tiling, down tiling) variants; num_stages 0 = as many as fit the SMEM budget.
VARIANTS = {
    "default": None,
    "blocking": (DecodeTiling(64, 128, async_mma=False), DecodeTiling(128, 128, async_mma=False)),
    "k256": (DecodeTiling(64, 256), DecodeTiling(128, 256)),
    "down64": (DecodeTiling(64, 128), DecodeTiling(64, 128)),
}


def _weights(key, num_experts, dim, ffn, copies):
  init = jax.jit(lambda k, shape, fan_in: (jax.random.normal(k, shape, jnp.bfloat16)
                                           * fan_in ** -0.5).astype(jnp.bfloat16),
                 static_argnums=(1, 2))
  sets = []
  for c in range(copies):
    k = jax.random.split(jax.random.fold_in(key, c), 3)
    sets.append((init(k[0], (num_experts, dim, ffn), dim), init(k[1], (num_experts, dim, ffn), dim),
                 init(k[2], (num_experts, ffn, dim), ffn)))
  return sets


def _routing(key, num_tokens, num_experts, top_k, pool=0):
  """Each token's top-k distinct experts, uniform over all experts, or (pool > 0) over one
  random set of `pool` experts shared by the call's tokens: a trained or random router at
  batch 32 concentrates its picks on few experts (DeepSeek-V3's 6-layer preset picked 13-49
  distinct experts of 256 at batch 32), which uniform routing does not show."""
  k1, k2, k3 = jax.random.split(key, 3)
  scores = jax.random.uniform(k1, (num_tokens, num_experts))
  if pool:
    chosen = jax.random.permutation(k3, num_experts)[:pool]
    scores = scores + jnp.zeros((num_experts,)).at[chosen].set(2.0)
  ids = jnp.argsort(-scores, axis=1)[:, :top_k]
  weights = jax.nn.softmax(jax.random.normal(k2, (num_tokens, top_k)), axis=-1)
  return ids.astype(jnp.int32), weights


def bench_shape(name, shape, tokens, read_bw, variants, pool=0):
  num_experts, top_k, dim, ffn = shape
  expert_bytes = 3 * dim * ffn * 2
  copies = int(max(1, min(4, 4e9 // (num_experts * expert_bytes))))
  weight_sets = _weights(jax.random.key(0), num_experts, dim, ffn, copies)
  rows = []
  for num_tokens in tokens:
    arg_sets = []
    for i in range(4):
      kx, kr = jax.random.split(jax.random.key(100 * num_tokens + i))
      x = jax.random.normal(kx, (num_tokens, dim), jnp.bfloat16)
      ids, weights = _routing(kr, num_tokens, num_experts, top_k, pool)
      arg_sets.append((x, ids, weights, *weight_sets[i % copies]))
    used = sum(int(jnp.unique(a[1]).size) for a in arg_sets) / len(arg_sets)
    row = {"model": name, "T": num_tokens, "pool": pool, "experts_used": used}
    want = jax.jit(experts_reference)(*arg_sets[0]).astype(jnp.float32)
    for variant, tilings in variants.items():
      try:  # Every variant computes the layer: relative L2 error against the reference.
        got = jax.jit(lambda *a, t=tilings: experts_decode(*a, tilings=t))(*arg_sets[0])
        got = got.astype(jnp.float32)
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        row.setdefault("rel_err", {})[variant] = err if bool(jnp.all(jnp.isfinite(got))) else None
      except Exception as e:
        print(f"{name} T={num_tokens} {variant} check: {type(e).__name__}: {str(e)[:1500]}",
              file=sys.stderr, flush=True)
    for variant, tilings in variants.items():
      tilings = tilings or decode_tilings(dim, ffn)
      n = padded_tokens(num_tokens)

      def gemms(x, ids, weights, w_gate, w_up, w_down, tilings=tilings):
        plan = plan_decode(ids, weights, num_experts)
        act = gate_up_decode(x, w_gate, w_up, plan.slot_expert_S, plan.num_slots_1, n,
                             tilings[0])
        return down_decode(act, w_down, plan.weight_SR, plan.slot_expert_S, plan.num_slots_1,
                           tilings[1])

      try:
        # The whole call (slot plan and combine too) for the default tilings only.
        full = seconds_per_chained_call(experts_decode, arg_sets) if variant == "default" else 0
        kern = seconds_per_chained_call(gemms, arg_sets)
        row[variant] = {"us": full * 1e6, "gemms_us": kern * 1e6,
                        "gemm_bw_frac": used * expert_bytes / kern / read_bw}
      except Exception as e:
        print(f"{name} T={num_tokens} {variant}: {type(e).__name__}: {str(e)[:1500]}",
              file=sys.stderr, flush=True)
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--json", default="moe_decode_tune.json")
  parser.add_argument("--tiny", action="store_true")
  parser.add_argument("--variants", default=",".join(VARIANTS), help="'' for none")
  parser.add_argument("--models", default=",".join(SHAPES))
  parser.add_argument("--tokens", default=None, help="override every model's token counts")
  parser.add_argument("--pools", default="0", help="comma-separated: 0 routes uniformly over "
                      "all experts, P > 0 over one random set of P experts per call")
  args = parser.parse_args()
  print(f"devices: {jax.devices()}", flush=True)
  variants = {v: VARIANTS[v] for v in args.variants.split(",") if v}
  if args.tiny:
    shapes = {"tiny": ((8, 2, 128, 64), (1, 3))}
    variants = {"default": None, "stages2": (DecodeTiling(64, 64, 2), DecodeTiling(64, 64, 2))}
  else:
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else None
    shapes = {m: (SHAPES[m][0], tokens or SHAPES[m][1]) for m in args.models.split(",")}
  bandwidth = hbm_bandwidth(8 << 20 if args.tiny else 2 << 30)
  read_bw = max(bandwidth["read"], bandwidth["copy"])
  rows = []
  for name, (shape, tokens) in shapes.items():
    for pool in (int(p) for p in args.pools.split(",")):
      rows += bench_shape(name, shape, tokens, read_bw, variants, pool)
  with open(args.json, "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "read_bw": bandwidth["read"],
               "copy_bw": bandwidth["copy"], "rows": rows}, f, indent=1)
  print(f"read {bandwidth['read'] / 1e12:.2f} TB/s, copy {bandwidth['copy'] / 1e12:.2f} TB/s")
  print("| model | T | pool | experts | rel err | " + " | ".join(
      f"{v} µs (GEMMs µs, % BW)" for v in variants) + " |")
  print("| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in variants) + " |")
  for r in rows:
    cells = []
    for v in variants:
      c = r.get(v)
      full = f"{c['us']:.1f} " if c and c["us"] else ""
      cells.append(f"{full}({c['gemms_us']:.1f}, {100 * c['gemm_bw_frac']:.0f}%)" if c else "-")
    errs = r.get("rel_err", {})
    worst = max((e if e is not None else float("inf")) for e in errs.values()) if errs else None
    print(f"| {r['model']} | {r['T']} | {r['pool'] or 'all'} | {r['experts_used']:.1f} | "
          f"{'-' if worst is None else f'{worst:.4f}'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
