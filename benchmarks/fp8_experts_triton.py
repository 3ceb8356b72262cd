"""FP8 routed experts at decode sizes: the Mosaic GPU decode path (`fp8_experts_decode`, as the
backend runs it) against the whole-K Triton programs (`fp8_experts_triton`) at several tilings.

    PYTHONPATH=. python3 benchmarks/fp8_experts_triton.py --models qwen3-30b-a3b deepseek-v3 \
        --tokens 1 2 4 8
    PYTHONPATH=. python3 benchmarks/fp8_experts_triton.py --dense --tokens 1 8
    PYTHONPATH=. python3 benchmarks/fp8_experts_triton.py --tiny     # interpret mode: smoke

Per model shape and token count T, --layers layers of distinct expert weights (so that no
layer's experts are served from L2) are chained in one jitted program, each layer's output the
next one's x, each layer routing its T tokens to top-k distinct random experts. Printed: µs a
layer (median over timed batches, `seconds_per_call`), the e4m3 bytes of the experts routed
over that time, and each path's largest difference from the Mosaic path relative to its
output's largest value.

--dense: one weight [N, K] of Qwen3-8B's shapes in place of the experts, --layers distinct
weights times one x of T rows in one program: `fp8_matmul` (its scale lanes made beforehand,
as a model makes them once per dispatch; its K-slice sum included) against the Triton down
kernel as a dense product (one slot, x padded to 16 rows beforehand).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from jspec.bench.roofline import seconds_per_call
from jspec.pallas_kernels.fp8_experts import Fp8Experts, experts_fp8_decode
from jspec.pallas_kernels.fp8_experts_triton import (ROWS, TritonExpertsTiling, down_weighted,
                                                     experts_fp8_triton)
from jspec.pallas_kernels.fp8_gemm import fp8_matmul, scale_lanes

MODELS = {  # name: (experts E, top-k K, hidden D, expert intermediate F)
    "deepseek-v3": (32, 8, 7168, 2048),  # 32 of its 256 experts: the bytes routed are the same
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "tiny": (8, 2, 256, 128),
}
# (gate / up columns, blocks a step, down columns, blocks a step, warps, stages)
TILINGS = ("32,2,32,2,4,3", "16,2,16,2,4,3", "64,2,64,2,4,3", "32,4,32,4,4,3",
           "32,1,32,1,4,4", "32,2,32,2,4,2", "32,2,32,2,4,4", "16,4,32,2,4,3",
           "32,2,32,2,8,3", "64,1,32,2,4,4")


def random_fp8(key, num_experts, out, inner) -> Fp8Experts:
  k_w, k_s = jax.random.split(key)
  w8 = jax.jit(lambda k: jnp.clip(jax.random.normal(k, (num_experts, out, inner)) * 60, -448,
                                  448).astype(jnp.float8_e4m3fn))(k_w)
  scale = jax.random.uniform(k_s, (num_experts, out // 128, inner // 128), jnp.float32,
                             0.5, 1.5) / (60 * inner ** 0.5)
  return Fp8Experts(w8, scale)


def tiling_of(text: str) -> TritonExpertsTiling:
  gu_cols, gu_blocks, down_cols, down_blocks, warps, stages = (int(v) for v in text.split(","))
  return TritonExpertsTiling(gu_cols, gu_blocks, down_cols, down_blocks, warps, stages)


def chain(experts_fn):
  def run(x, layers):
    for ids, weights, gate, up, down in layers:
      x = experts_fn(x, ids, weights, gate, up, down)
    return x
  return jax.jit(run)


def bench(name, tokens, num_layers, tilings, interpret):
  num_experts, top_k, dim, ffn = MODELS[name]
  key = jax.random.key(11)
  weights = []
  for layer in range(num_layers):
    k = jax.random.split(jax.random.fold_in(key, layer), 3)
    weights.append((random_fp8(k[0], num_experts, ffn, dim),
                    random_fp8(k[1], num_experts, ffn, dim),
                    random_fp8(k[2], num_experts, dim, ffn)))
  paths = {"mosaic": chain(experts_fp8_decode)}
  for text in tilings:
    tiling = tiling_of(text)
    paths[f"triton {text}"] = chain(
        lambda x, i, w, g, u, d, tiling=tiling: experts_fp8_triton(
            x, i, w, g, u, d, tiling=tiling, interpret=interpret))
  rows = []
  for num_tokens in tokens:
    arg_sets = []
    for s in range(2):
      k = jax.random.fold_in(key, 1000 * num_tokens + s)
      layers = []
      for layer, (gate, up, down) in enumerate(weights):
        kr, kw = jax.random.split(jax.random.fold_in(k, layer))
        ids = jnp.argsort(jax.random.uniform(kr, (num_tokens, num_experts)), axis=1)[:, :top_k]
        layers.append((ids.astype(jnp.int32),
                       jax.nn.softmax(jax.random.normal(kw, (num_tokens, top_k)), -1),
                       gate, up, down))
      x = jax.random.normal(jax.random.fold_in(k, 99), (num_tokens, dim), jnp.bfloat16)
      arg_sets.append((x, layers))
    routed = sum(int(jnp.unique(ids).size) for ids, *_ in arg_sets[0][1]) / num_layers
    e4m3_bytes = routed * 3 * dim * ffn
    want = paths["mosaic"](*arg_sets[0]).astype(jnp.float32)
    for path, fn in paths.items():
      seconds = seconds_per_call(fn, arg_sets, batches=3 if interpret else None) / num_layers
      got = fn(*arg_sets[0]).astype(jnp.float32)
      row = {"model": name, "T": num_tokens, "path": path, "us_per_layer": seconds * 1e6,
             "e4m3_TB_s": e4m3_bytes / seconds / 1e12,
             "rel_diff": float(jnp.abs(got - want).max() / jnp.abs(want).max())}
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


DENSE_SHAPES = ("4096x24576", "12288x4096", "4096x6144", "4096x4096")  # K x N, Qwen3-8B's


def bench_dense(tokens, num_layers, tilings, interpret):
  rows = []
  for shape in DENSE_SHAPES:
    k, n = (int(v) for v in shape.split("x"))
    key = jax.random.fold_in(jax.random.key(12), k * n)
    weights = [random_fp8(jax.random.fold_in(key, layer), 1, n, k) for layer in range(num_layers)]
    lanes = [scale_lanes(w.scale[0]) for w in weights]
    one = jnp.ones((1, 32), jnp.float32)
    slot = jnp.zeros((1,), jnp.int32)
    count = jnp.ones((1,), jnp.int32)

    def mosaic(x, weights, lanes):
      return sum(fp8_matmul(x, w.w8[0], w.scale[0], lanes_NbX=l).astype(jnp.float32)
                 for w, l in zip(weights, lanes))

    def triton(x16, weights, tiling):
      return sum(down_weighted(x16, w, slot, count, one, tiling, interpret)[0]
                 for w in weights)

    for num_tokens in tokens:
      x = jax.random.normal(jax.random.fold_in(key, num_tokens), (num_tokens, k), jnp.bfloat16)
      x16 = jnp.pad(x, ((0, ROWS - num_tokens), (0, 0)))[None]
      want = jax.jit(mosaic)(x, weights, lanes)
      paths = {"mosaic": (jax.jit(mosaic), (x, weights, lanes))}
      for text in tilings:
        tiling = tiling_of(text)
        paths[f"triton {text}"] = (jax.jit(lambda x16, w, tiling=tiling: triton(x16, w, tiling)),
                                   (x16, weights))
      for path, (fn, args) in paths.items():
        seconds = seconds_per_call(fn, [args], batches=3 if interpret else None) / num_layers
        got = fn(*args)[:num_tokens]
        row = {"model": f"dense {shape}", "T": num_tokens, "path": path,
               "us_per_layer": seconds * 1e6, "e4m3_TB_s": k * n / seconds / 1e12,
               "rel_diff": float(jnp.abs(got - want).max() / jnp.abs(want).max())}
        rows.append(row)
        print(json.dumps(row), flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3"])
  parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--tilings", nargs="+", default=list(TILINGS))
  parser.add_argument("--dense", action="store_true", help="Qwen3-8B's dense products too")
  parser.add_argument("--tiny", action="store_true", help="interpret mode, tiny shapes")
  args = parser.parse_args()
  if args.tiny:
    args.models, args.tokens, args.layers, args.tilings = ["tiny"], [1, 3], 2, args.tilings[:2]
  rows = []
  for name in args.models:
    rows += bench(name, args.tokens, args.layers, args.tilings, interpret=args.tiny)
  if args.dense:
    rows += bench_dense(args.tokens, args.layers, args.tilings, interpret=args.tiny)
  print(f"\n{'model':<14} {'T':>3} {'path':<28} {'us/layer':>9} {'e4m3 TB/s':>9} {'rel diff':>9}")
  for row in rows:
    print(f"{row['model']:<14} {row['T']:>3} {row['path']:<28} {row['us_per_layer']:>9.2f} "
          f"{row['e4m3_TB_s']:>9.2f} {row['rel_diff']:>9.2e}")


if __name__ == "__main__":
  main()
