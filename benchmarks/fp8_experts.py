"""FP8 routed experts at verify and prefill sizes: the grouped FP8 path against the paths it
replaced and against bf16 experts, one MoE layer's routed experts (no router, no shared expert).

    PYTHONPATH=. python3 benchmarks/fp8_experts.py --models deepseek-v3 qwen3-30b-a3b \
        --tokens 128 256 512 2048 8192 --rows-sweep 512 2048
    PYTHONPATH=. python3 benchmarks/fp8_experts.py --decode-tokens 1 2 8 32 --tokens
    PYTHONPATH=. python3 benchmarks/fp8_experts.py --tiny     # interpret mode on CPU: smoke

Per model shape and token count T (skewed seeded top-k routing, as benchmarks/moe_kernels.py):
  bf16       experts_pallas on bf16 experts (the same values as the FP8 ones): the bf16 model
  dequant    every FP8 expert scaled into a bf16 copy, then the bf16 grouped kernels (what
             steps of more than 256 tokens ran before the grouped FP8 path)
  chunked    the FP8 decode path in chunks of 64 tokens (what steps of 65-256 tokens ran),
             up to 256 tokens
  grouped    the grouped FP8 path at its default tile rows (`fp8_experts_grouped.tile_rows`);
             at the --rows-sweep token counts also at 16, 32 and 64 rows
Median device time per call (`seconds_per_call`, two argument sets), "e4m3 GB/s": the e4m3
bytes of the experts the call routed over its time, and the grouped path's error against the
bf16 experts on the same (dequantized) weights: ||y_fp8 - y_bf16|| / ||y_bf16||, the cost of
quantizing x and act to e4m3 (a few percent).

--decode-tokens: the decode path at decode sizes, how each of its choices pays (µs per call):
  bf16        experts_pallas on the bf16 experts
  f16 whole   FP8, x and act through float16 row scales, K whole (x given as float32; the
              path before bfloat16 x went in as it is and K was sliced)
  bf16 whole  FP8, bfloat16 x as it is, K whole
  default     FP8 as the backend runs it (bfloat16 x, K slices where items are few)
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from jspec.bench.roofline import seconds_per_call
from jspec.pallas_kernels import experts_grouped, experts_pallas
from jspec.pallas_kernels.fp8_experts import (CHUNK_TOKENS, Fp8Experts, Fp8ExpertsTiling,
                                              experts_fp8, experts_fp8_decode)
from jspec.pallas_kernels.fp8_experts_grouped import experts_fp8_grouped, tile_rows

MODELS = {  # name: (experts E, top-k K, hidden D, expert intermediate F)
    "deepseek-v3": (256, 8, 7168, 2048),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "tiny": (8, 2, 256, 128),
}
SWEEP_ROWS = (16, 32, 64)
# Steps of up to this many tokens ran the decode path in chunks before the grouped path.
CHUNKED_BEFORE = 4 * CHUNK_TOKENS


def skewed_routing(key, num_tokens, num_experts, top_k, zipf_s=1.0):
  """Top-k distinct experts per token, expert popularity ~ 1 / rank^s (Gumbel top-k)."""
  k_perm, k_gumbel, k_w = jax.random.split(key, 3)
  rank = jax.random.permutation(k_perm, num_experts) + 1
  log_p = -zipf_s * jnp.log(rank.astype(jnp.float32))
  _, ids = jax.lax.top_k(log_p + jax.random.gumbel(k_gumbel, (num_tokens, num_experts)), top_k)
  return ids.astype(jnp.int32), jax.nn.softmax(jax.random.normal(k_w, (num_tokens, top_k)), -1)


def random_fp8(key, num_experts, out, inner) -> Fp8Experts:
  k_w, k_s = jax.random.split(key)
  w8 = jax.jit(lambda k: jnp.clip(jax.random.normal(k, (num_experts, out, inner)) * 60, -448,
                                  448).astype(jnp.float8_e4m3fn))(k_w)
  scale = jax.random.uniform(k_s, (num_experts, out // 128, inner // 128), jnp.float32,
                             0.5, 1.5) / (60 * inner ** 0.5)
  return Fp8Experts(w8, scale)


def layer_weights(keys, num_experts, dim, ffn):
  """(gate, up, down) in FP8 and the same values in bf16 ([E, in, out])."""
  fp8 = (random_fp8(keys[0], num_experts, ffn, dim), random_fp8(keys[1], num_experts, ffn, dim),
         random_fp8(keys[2], num_experts, dim, ffn))
  return fp8, tuple(jax.jit(lambda w: w.dequantized(jnp.bfloat16))(w) for w in fp8)


def argument_sets(key, num_tokens, num_experts, top_k, dim, fp8, bf16):
  """Two (x, ids, weights, *fp8, *bf16) sets of different tokens and routing (weights are
  arguments, never closed over: a closed-over array becomes a constant of the program)."""
  arg_sets = []
  for s in range(2):
    kx, kr = jax.random.split(jax.random.fold_in(key, 10 * num_tokens + s))
    ids, weights = skewed_routing(kr, num_tokens, num_experts, top_k)
    arg_sets.append((jax.random.normal(kx, (num_tokens, dim), jnp.bfloat16), ids, weights,
                     *fp8, *bf16))
  return arg_sets


def bench_model(name, num_experts, top_k, dim, ffn, tokens, sweep_tokens):
  keys = jax.random.split(jax.random.key(7), 4)
  fp8, bf16 = layer_weights(keys, num_experts, dim, ffn)
  paths = {
      "bf16": jax.jit(lambda x, i, w, *weights: experts_pallas(x, i, w, *weights[3:])),
      "dequant": jax.jit(lambda x, i, w, g, u, d, *_: experts_grouped(
          x, i, w, *(m.dequantized(jnp.bfloat16) for m in (g, u, d)))),
      "chunked": jax.jit(lambda x, i, w, g, u, d, *_: experts_fp8(x, i, w, g, u, d)),
  }
  for rows in (None,) + SWEEP_ROWS:
    paths["grouped" if rows is None else f"grouped/{rows}"] = jax.jit(
        lambda x, i, w, g, u, d, *_, rows=rows: experts_fp8_grouped(x, i, w, g, u, d, rows=rows))
  results = []
  for num_tokens in tokens:
    arg_sets = argument_sets(keys[3], num_tokens, num_experts, top_k, dim, fp8, bf16)
    used = int(jnp.unique(arg_sets[0][1]).size)
    row = {"model": name, "T": num_tokens, "experts_used": used,
           "e4m3_bytes": used * 3 * dim * ffn,
           "default_rows": tile_rows(num_tokens * top_k, num_experts)}
    for path, fn in paths.items():
      if ((path == "chunked" and num_tokens > CHUNKED_BEFORE)
          or (path.startswith("grouped/") and num_tokens not in sweep_tokens)):
        continue
      try:
        row[path] = seconds_per_call(fn, arg_sets)
      except Exception as err:  # Record and go on: one failure must not hide the rest.
        print(f"{name} T={num_tokens} {path}: {type(err).__name__}: {str(err)[:400]}",
              file=sys.stderr, flush=True)
    want = paths["bf16"](*arg_sets[0]).astype(jnp.float32)
    got = paths["grouped"](*arg_sets[0]).astype(jnp.float32)
    row["grouped_rel_err"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    results.append(row)
    print(json.dumps(row), flush=True)
  return results


def bench_decode(name, num_experts, top_k, dim, ffn, tokens):
  keys = jax.random.split(jax.random.key(8), 4)
  fp8, bf16 = layer_weights(keys, num_experts, dim, ffn)
  whole = Fp8ExpertsTiling(gate_up_splits=1, down_splits=1)
  paths = {
      "bf16": jax.jit(lambda x, i, w, *weights: experts_pallas(x, i, w, *weights[3:])),
      "f16 whole": jax.jit(lambda x, i, w, g, u, d, *_: experts_fp8_decode(
          x.astype(jnp.float32), i, w, g, u, d, tiling=whole)),
      "bf16 whole": jax.jit(lambda x, i, w, g, u, d, *_: experts_fp8_decode(
          x, i, w, g, u, d, tiling=whole)),
      "default": jax.jit(lambda x, i, w, g, u, d, *_: experts_fp8_decode(x, i, w, g, u, d)),
  }
  lines = []
  for num_tokens in tokens:
    arg_sets = argument_sets(keys[3], num_tokens, num_experts, top_k, dim, fp8, bf16)
    used = int(jnp.unique(arg_sets[0][1]).size)
    times = {path: seconds_per_call(fn, arg_sets) for path, fn in paths.items()}
    rate = used * 3 * dim * ffn / times["default"] / 1e9
    lines.append(f"| {name} | {num_tokens} | {used} | "
                 + " | ".join(f"{1e6 * t:.1f}" for t in times.values())
                 + f" | {times['default'] / times['bf16']:.2f}x | {rate:.0f} |")
    print(lines[-1], flush=True)
  return lines


DECODE_HEADER = ("| model | T | experts used | bf16 µs | f16 whole µs | bf16 whole µs | default µs "
                 "| default / bf16 | default e4m3 GB/s |\n"
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def table(rows):
  columns = ["bf16", "dequant", "chunked", "grouped"] + [f"grouped/{r}" for r in SWEEP_ROWS]
  lines = ["| model | T | experts used | rows | " + " | ".join(f"{c} µs" for c in columns)
           + " | grouped / bf16 | grouped / before | grouped e4m3 GB/s | rel. err |",
           "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in columns)
           + " | ---: | ---: | ---: | ---: |"]
  for r in rows:
    cell = lambda c: f"{r[c] * 1e6:.1f}" if r.get(c) else "-"
    before = r.get("chunked") or r.get("dequant")
    ratio = lambda other: f"{r['grouped'] / other:.2f}x" if r.get("grouped") and other else "-"
    rate = f"{r['e4m3_bytes'] / r['grouped'] / 1e9:.0f}" if r.get("grouped") else "-"
    lines.append(f"| {r['model']} | {r['T']} | {r['experts_used']} | {r['default_rows']} | "
                 + " | ".join(cell(c) for c in columns)
                 + f" | {ratio(r.get('bf16'))} | {ratio(before)} | {rate} "
                 f"| {r['grouped_rel_err']:.3f} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", nargs="+", default=["deepseek-v3", "qwen3-30b-a3b"])
  parser.add_argument("--tokens", type=int, nargs="*", default=[128, 256, 512, 2048, 8192])
  parser.add_argument("--rows-sweep", type=int, nargs="*", default=[512, 2048],
                      help="token counts at which the grouped path also runs at 16/32/64 rows")
  parser.add_argument("--decode-tokens", type=int, nargs="*", default=[],
                      help="also time the decode path's choices at these token counts")
  parser.add_argument("--tiny", action="store_true", help="small shapes: a CPU smoke run")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  models, tokens = (["tiny"], [80, 300]) if args.tiny else (args.models, args.tokens)
  sweep = [300] if args.tiny else args.rows_sweep
  decode_tokens = [1, 5] if args.tiny else args.decode_tokens
  print(f"devices: {jax.devices()}", flush=True)
  rows, decode_lines = [], []
  for name in models:
    if decode_tokens:
      decode_lines += bench_decode(name, *MODELS[name], decode_tokens)
    if tokens:
      rows += bench_model(name, *MODELS[name], tokens, sweep)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
  if decode_lines:
    print(f"\n{jax.devices()[0].device_kind}: the FP8 decode path's choices, µs per call")
    print("\n".join([DECODE_HEADER] + decode_lines))
  if rows:
    print(f"\n{jax.devices()[0].device_kind}: FP8 routed experts, µs per call")
    print(table(rows))


if __name__ == "__main__":
  main()
