"""Where a one-token decode step's time goes, on one GPU.

  1. the step timed exactly as `jspec bench` times it (8 steps in an on-device loop), at 1 and
     2 tokens per sequence;
  2. the same program once under the profiler: kernels per step, their summed time, what is
     left of the timed step between kernels (kernels run a little longer under the profiler,
     so a small negative figure means the kernels fill the step), and the top kernels, each
     with its calls per layer and its time per call (`--fp8`: the preset as an FP8
     checkpoint);
  3. the model's matrix products alone at this batch, each weight shape chained over all
     layers (so no weight is served from L2), as read bandwidth: separate q / k / v and
     gate / up, and the fused shapes (qkv, gate_up) a fused projection would run.

XLA flags are read from `XLA_FLAGS` as usual; the script prints them with its table, so one
command per flag set compares them:

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/decode_step.py --batch 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

import jspec
from jspec.bench.presets import PRESETS
from jspec.bench.profile import profile
from jspec.bench.roofline import hbm_bandwidth, seconds_per_call, step_bytes
from jspec.bench.steps import STEPS_PER_CALL, StepTimer
from jspec.models.projections import PROJECTION_BACKENDS
from jspec.models.row_kernels import NORM_BACKENDS
from jspec.shapes import buckets


def matrix_shapes(cfg) -> dict:
  """{name: (rows K, columns N, how many per forward)} of a dense model's weight matrices."""
  d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  n = cfg.num_layers
  return {"q": (d, q, n), "k (= v)": (d, kv, n), "qkv fused": (d, q + 2 * kv, n),
          "o": (q, d, n), "gate (= up)": (d, f, n), "gate_up fused": (d, 2 * f, n),
          "down": (f, d, n), "lm_head": (d, v, 1)}


def time_matrix_products(cfg, rows: int, dtype=jnp.bfloat16) -> list[dict]:
  """Seconds per product x[rows, K] @ W[K, N], over `count` distinct W in one program."""
  results = []
  key = jax.random.key(0)
  for name, (k, n, count) in matrix_shapes(cfg).items():
    keys = jax.random.split(key, count + 2)
    weights = [jax.random.normal(keys[i], (k, n), dtype) for i in range(count)]
    # A different input per weight: products sharing an input would be merged by XLA (its dot
    # merger concatenates their weights), which is not what a layer stack runs.
    xs = [(jax.random.normal(keys[count + j], (count, rows, k), dtype),) for j in range(2)]
    chain = jax.jit(lambda x, ws: [x[i] @ w for i, w in enumerate(ws)])
    seconds = seconds_per_call(lambda x: chain(x, weights), xs) / count
    results.append(dict(name=name, k=k, n=n, count=count, us=1e6 * seconds,
                        bytes_per_second=k * n * jnp.dtype(dtype).itemsize / seconds))
    del weights
  return results


def profile_step(timer: StepTimer, decode_s: float, top: int = 30) -> dict:
  """The one-token step under the profiler: its `top` ops by time, each with its calls per
  step and per layer (a per-layer count of 1 or 2 marks a layer's own kernel, the glue a
  fused layer would remove) and its time per call."""
  wall, times = profile(timer.runs[("target", 1)])
  kernel_ns = times.pop(None)[1]
  launches = sum(count for count, _ in times.values())
  layers = timer.llm.config.num_layers
  ranked = sorted(times.items(), key=lambda kv: -kv[1][1])[:top]
  return dict(
      profiled_step_ms=1e3 * wall / STEPS_PER_CALL,
      kernels_per_step=launches / STEPS_PER_CALL,
      kernel_ms_per_step=kernel_ns / 1e6 / STEPS_PER_CALL,
      between_kernels_ms_per_step=1e3 * decode_s - kernel_ns / 1e6 / STEPS_PER_CALL,
      top=[dict(op=name, per_step=count / STEPS_PER_CALL,
                per_layer=count / STEPS_PER_CALL / layers, us_per_call=ns / 1e3 / count,
                us_per_step=ns / 1e3 / STEPS_PER_CALL) for name, (count, ns) in ranked])


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", choices=list(PRESETS))
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--context", type=int, default=512)
  parser.add_argument("--attention-backend", default="xla", choices=["auto", "xla", "pallas"])
  parser.add_argument("--projection-backend", default="auto", choices=PROJECTION_BACKENDS)
  parser.add_argument("--norm-backend", default="auto", choices=NORM_BACKENDS)
  parser.add_argument("--max-model-len", type=int, default=0,
                      help="default context + 16; sets the largest cache bucket, which a "
                           "long context's steps use")
  parser.add_argument("--no-products", action="store_true", help="skip part 3")
  parser.add_argument("--json", default=None, help="also write the results here")
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
  parser.add_argument("--fp8", action="store_true",
                      help="the preset as an FP8 checkpoint (e4m3, 128 x 128 block scales)")
  parser.add_argument("--top", type=int, default=30, help="profiled ops to list, by time")
  parser.add_argument("--hlo-out", default=None,
                      help="write the one-token step program's optimized HLO here")
  args = parser.parse_args()

  max_model_len = args.max_model_len or args.context + 16
  cfg = PRESETS[args.model]
  if args.layers:
    cfg = dataclasses.replace(cfg, num_layers=args.layers)
  if args.fp8:
    cfg = dataclasses.replace(cfg, fp8_block=(128, 128))
  cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings,
                                                              max_model_len))
  bandwidth = hbm_bandwidth()
  llm = jspec.LLM.from_random(cfg, None, max_model_len=max_model_len, max_num_seqs=1,
                              attention_backend=args.attention_backend,
                              projection_backend=args.projection_backend,
                              norm_backend=args.norm_backend)
  timer = StepTimer(llm)
  seconds = timer.measure(args.batch, args.context, {1, 2})
  cache_slots = buckets.cache_bucket(args.context + 2, 0, max_model_len)
  decode_s = seconds[("target", 1)]
  if args.hlo_out:
    with open(args.hlo_out, "w") as f:
      f.write(timer.programs[("target", 1)].as_text())
  floor_s = step_bytes(cfg, args.batch, 1, args.context) / bandwidth["read"]
  result = dict(model=args.model, batch=args.batch, context=args.context,
                cache_slots=cache_slots,
                attention_backend=args.attention_backend,
                projection_backend=llm.projection_backend, norm_backend=llm.norm_backend,
                xla_flags=os.environ.get("XLA_FLAGS", ""), device=jax.devices()[0].device_kind,
                read_bytes_per_second=bandwidth["read"], decode_ms=1e3 * decode_s,
                two_token_relative=seconds[("target", 2)] / decode_s,
                roofline_fraction=floor_s / decode_s, **profile_step(timer, decode_s, args.top))
  del llm, timer
  if not args.no_products and not cfg.is_moe:
    result["products"] = {str(rows): time_matrix_products(cfg, rows)
                          for rows in sorted({1, 2, args.batch})}

  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  read = bandwidth["read"]
  print(f"\n{args.model} B={args.batch} context={args.context} ({cache_slots} slots) "
        f"attention={args.attention_backend} projections={result['projection_backend']} "
        f"norms={result['norm_backend']} "
        f"XLA_FLAGS={result['xla_flags']!r} on {result['device']}")
  print(f"decode {result['decode_ms']:.3f} ms = {100 * result['roofline_fraction']:.1f}% of the "
        f"roofline (read {read / 1e12:.2f} TB/s); 2 tokens: {result['two_token_relative']:.2f}x")
  print(f"profiled: {result['kernels_per_step']:.0f} kernels/step, "
        f"{result['kernel_ms_per_step']:.3f} ms of kernels/step, "
        f"{result['between_kernels_ms_per_step']:.3f} ms/step between them")
  print(f"  {'op':48s} {'/step':>6s} {'/layer':>6s} {'us/call':>8s} {'us/step':>8s}")
  for row in result["top"]:
    print(f"  {row['op'][:48]:48s} {row['per_step']:6.1f} {row['per_layer']:6.2f} "
          f"{row['us_per_call']:8.2f} {row['us_per_step']:8.1f}")
  for rows, products in result.get("products", {}).items():
    print(f"matrix products, {rows} row(s): {'shape':>14s} {'us':>8s} {'TB/s':>6s} {'% read':>7s}")
    for p in products:
      print(f"  {p['name']:16s} {p['k']:6d}x{p['n']:<7d} {p['us']:8.1f} "
            f"{p['bytes_per_second'] / 1e12:6.2f} {100 * p['bytes_per_second'] / read:6.1f}%")


if __name__ == "__main__":
  main()
