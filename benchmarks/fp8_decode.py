"""FP8 weights against bf16 end to end: the same preset shapes with random weights in bfloat16
and in the fine-grained FP8 layout (e4m3 projections with 128 x 128 block scales,
jspec.models.quantization), through the default `generate`.

    python benchmarks/fp8_decode.py --model qwen3-8b --batch 1 8

Per precision: the weights' bytes on the device, then per batch size the end-to-end tokens/s
(prompt --prompt-len, --max-tokens new tokens, greedy, ignore_eos; the median of --repeats
calls after a warm-up), the decode step (TPOT: time per output token after the first) and a
prefill of --prefill-len tokens (time to first token of one such prompt). First, the FP8
model's logits through the FP8 kernel against the same weights scaled before XLA's dot.
Random weights: step costs only (the tokens of the two precisions differ, as their weights
do).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

import jspec
from jspec.bench.presets import PRESETS
from jspec.models.row_kernels import NORM_BACKENDS
from jspec.pallas_kernels import fp8_experts, fp8_gemm

BLOCK = (128, 128)


def weight_bytes(llm) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(nnx.state(llm.target)))


def median_call(llm, prompts, max_tokens: int, repeats: int):
  params = jspec.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
  start = time.perf_counter()
  llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles
  print(f"  warm-up of {len(prompts)} x {len(prompts[0])} tokens: "
        f"{time.perf_counter() - start:.1f} s", flush=True)
  metrics = [llm.generate(prompts, params, use_tqdm=False).metrics for _ in range(repeats)]
  middle = statistics.median(m.wall_time_s for m in metrics)
  return min(metrics, key=lambda m: abs(m.wall_time_s - middle))


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layers")
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--prompt-len", type=int, default=512)
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--prefill-len", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--profile", action="store_true",
                      help="also trace one call at the first batch size per precision: GPU "
                           "time by op")
  rows_wanted = parser.add_mutually_exclusive_group()
  rows_wanted.add_argument("--no-prefill", action="store_true", help="skip the long-prompt row")
  rows_wanted.add_argument("--prefill-only", action="store_true",
                           help="only the long-prompt row (no decode rows, no logits check)")
  parser.add_argument("--experts-whole-k", action="store_true",
                      help="FP8 MoE: the decode expert kernels on whole K (no K slices where a "
                           "step's items are few: the path before them), for a before / after")
  parser.add_argument("--qkv-separate", action="store_true",
                      help="FP8: q, k and v as three kernel calls, not one (the path before "
                           "fp8_gemm.fp8_matmul_many), for a before / after comparison")
  parser.add_argument("--norm-backend", default="auto", choices=NORM_BACKENDS,
                      help="LLM(norm_backend): 'xla' for the path before the row kernels")
  parser.add_argument("--fp8-stages", type=int,
                      help="fp8_gemm.TWO_BLOCK_STAGES: the few-row FP8 product's pipeline "
                           "stages up to 16 rows (default: the library's)")
  args = parser.parse_args()
  if args.fp8_stages:
    fp8_gemm.TWO_BLOCK_STAGES = args.fp8_stages
  base = PRESETS[args.model]
  if args.layers:
    base = dataclasses.replace(base, num_layers=args.layers)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, base.vocab_size, args.prompt_len).tolist()
             for _ in range(max(args.batch))]
  long_prompt = [rng.integers(0, base.vocab_size, args.prefill_len).tolist()]
  max_len = max(args.prompt_len + args.max_tokens,
                0 if args.no_prefill else args.prefill_len + 1) + 16
  if args.experts_whole_k:
    fp8_experts.DECODE_TILING = fp8_experts.Fp8ExpertsTiling(gate_up_splits=1, down_splits=1)
  rows = []
  for precision in ("bf16", "fp8"):
    cfg = dataclasses.replace(base, fp8_block=BLOCK if precision == "fp8" else None)
    start = time.perf_counter()
    llm = jspec.LLM.from_random(cfg, None, max_model_len=max_len,
                                max_num_seqs=max(args.batch), norm_backend=args.norm_backend)
    size = weight_bytes(llm)
    if args.qkv_separate:
      for _, node in nnx.iter_graph(llm.target):
        if getattr(node, "fp8_projection", None) is not None:
          node.fp8_projection.many = None  # linear.project_many_named: one call per weight
    print(f"{precision}: built in {time.perf_counter() - start:.1f} s", flush=True)
    # The FP8 kernel's logits against the scaled weights' under XLA.
    if precision == "fp8" and not args.prefill_only:
      xla = jspec.LLM.from_random(cfg, None, max_model_len=max_len, max_num_seqs=1,
                                  projection_backend="xla")
      short = [prompts[0][:16]]  # a prefill of <= 64 rows: through the kernel
      want = xla.compute_logits(short)[0]
      got = llm.compute_logits(short)[0]
      print(f"fp8 kernel vs XLA logits: max |diff| / max |logit| = "
            f"{np.abs(got - want).max() / np.abs(want).max():.2e}, same argmax "
            f"{(got.argmax(-1) == want.argmax(-1)).mean():.2f}", flush=True)
      del xla
    prefill = None if args.no_prefill else median_call(llm, long_prompt, 1, args.repeats)
    if args.prefill_only:
      rows.append(dict(precision=precision, batch=1, weight_gb=size / 1e9,
                       tokens_per_second=float("nan"), tpot_ms=float("nan"),
                       prefill_ms=1e3 * prefill.ttft_s))
      print(rows[-1], flush=True)
    for batch in [] if args.prefill_only else args.batch:
      m = median_call(llm, prompts[:batch], args.max_tokens, args.repeats)
      if args.profile and batch == args.batch[0]:
        from jspec.bench.profile import profile, summary
        params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                      ignore_eos=True)
        wall, times = profile(lambda: llm.generate(prompts[:batch], params, use_tqdm=False))
        print(f"\n== profile: {precision} batch {batch}, {args.max_tokens} tokens\n"
              f"{summary(wall, times, 30)}\n", flush=True)
      rows.append(dict(precision=precision, batch=batch, weight_gb=size / 1e9,
                       tokens_per_second=m.tokens_per_second, tpot_ms=1e3 * m.tpot_s,
                       prefill_ms=1e3 * prefill.ttft_s if prefill else float("nan")))
      print(rows[-1], flush=True)
    del llm
    gc.collect()

  print(f"\n{jax.devices()[0].device_kind}, {args.model}"
        f"{f' ({args.layers} layers)' if args.layers else ''}: prompt {args.prompt_len}, "
        f"{args.max_tokens} tokens; prefill {args.prefill_len} tokens; "
        f"norm_backend={args.norm_backend}")
  print(f"{'precision':9s} {'weights GB':>10s} {'batch':>5s} {'tok/s':>9s} {'TPOT ms':>8s} "
        f"{'vs bf16':>8s} {'prefill ms':>10s} {'vs bf16':>8s}")
  bf16 = {r["batch"]: r for r in rows if r["precision"] == "bf16"}
  for r in rows:
    ref = bf16[r["batch"]]
    print(f"{r['precision']:9s} {r['weight_gb']:10.2f} {r['batch']:5d} "
          f"{r['tokens_per_second']:9.1f} {r['tpot_ms']:8.3f} "
          f"{r['tpot_ms'] / ref['tpot_ms']:7.3f}x {r['prefill_ms']:10.1f} "
          f"{r['prefill_ms'] / ref['prefill_ms']:7.3f}x")


if __name__ == "__main__":
  sys.exit(main())
