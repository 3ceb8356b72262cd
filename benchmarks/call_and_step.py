"""A `generate` call's fixed cost against its per-step cost, bf16 and FP8, the same preset
shapes with random weights: the median time of calls of --short and of --long new tokens
(greedy, ignore_eos, batch --batch, --prompt-len tokens), so that

    step  = (long call - short call) / (long - short)   the decode step, prefill excluded
    fixed = short call - (short - 1) * step              prefill, launches, the harvest

and jspec's own TPOT (`metrics.tpot_s` of the long call: its time after the first token,
per token), which carries the dispatch program's launch. XLA_FLAGS apply to both precisions.
`--mesh` (dp,tp,ep triples) runs each precision on each mesh: where TPOT exceeds the step,
the excess is the call's own cost spread over its tokens.

    python benchmarks/call_and_step.py --model qwen3-30b-a3b --batch 1
    python benchmarks/call_and_step.py --model qwen3-8b --precisions bf16 --batch 8 \
        --prompt-len 512 --long 130 --mesh 1,1,1 1,2,1
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import os
import statistics
import time

import numpy as np

import jspec
from jspec.bench.presets import PRESETS


def timed_calls(llm, prompts, max_tokens: int, repeats: int):
  params = jspec.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
  times, tpots = [], []
  for _ in range(repeats):
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    times.append(time.perf_counter() - start)
    tpots.append(outs[0].metrics.tpot_s)
  return statistics.median(times), statistics.median(tpots)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--short", type=int, default=2)
  parser.add_argument("--long", type=int, default=34)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"],
                      choices=["bf16", "fp8"])
  parser.add_argument("--mesh", nargs="+", default=["1,1,1"], help="dp,tp,ep triples")
  args = parser.parse_args()
  if args.long <= args.short:
    parser.error(f"--long ({args.long}) must exceed --short ({args.short})")
  config = PRESETS[args.model]
  if args.layers:
    config = dataclasses.replace(config, num_layers=args.layers)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, config.vocab_size, args.prompt_len).tolist()
             for _ in range(args.batch)]
  rows = []
  for mesh_text, precision in itertools.product(args.mesh, args.precisions):
    dp, tp, ep = (int(v) for v in mesh_text.split(","))
    shaped = (dataclasses.replace(config, fp8_block=(128, 128)) if precision == "fp8"
              else config)
    llm = jspec.LLM.from_random(shaped, None, mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep),
                                max_model_len=args.prompt_len + args.long + 16,
                                max_num_seqs=args.batch)
    for n in (args.short, args.long):  # compiles: both lengths run the same programs
      timed_calls(llm, prompts, n, 1)
    short, _ = timed_calls(llm, prompts, args.short, args.repeats)
    long, tpot = timed_calls(llm, prompts, args.long, args.repeats)
    step = (long - short) / (args.long - args.short)
    rows.append((mesh_text, precision, 1e3 * short, 1e3 * long, 1e3 * step,
                 1e3 * (short - (args.short - 1) * step), 1e3 * tpot))
    print(f"{mesh_text} {precision}: calls of {args.short} / {args.long} tokens "
          f"{rows[-1][2]:.2f} / {rows[-1][3]:.2f} ms", flush=True)
    del llm
    gc.collect()
  print(f"\n{args.model} ({config.num_layers} layers), batch {args.batch}, prompt "
        f"{args.prompt_len}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"{'mesh':7s} {'precision':9s} {'short ms':>9s} {'long ms':>9s} {'step ms':>8s} "
        f"{'fixed ms':>9s} {'TPOT ms':>8s}")
  for mesh_text, precision, short, long, step, fixed, tpot in rows:
    print(f"{mesh_text:7s} {precision:9s} {short:9.2f} {long:9.2f} {step:8.3f} {fixed:9.2f} "
          f"{tpot:8.3f}")
  by_run = {(mesh_text, precision): (step, fixed, tpot)
            for mesh_text, precision, _, _, step, fixed, tpot in rows}
  for mesh_text in args.mesh:
    if (mesh_text, "bf16") in by_run and (mesh_text, "fp8") in by_run:
      ratios = [f / b for f, b in zip(by_run[mesh_text, "fp8"], by_run[mesh_text, "bf16"])]
      print(f"{mesh_text} fp8 / bf16: step {ratios[0]:.3f}x, fixed {ratios[1]:.3f}x, "
            f"TPOT {ratios[2]:.3f}x")


if __name__ == "__main__":
  main()
