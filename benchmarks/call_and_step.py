"""A `generate` call's fixed cost against its per-step cost, bf16 and FP8, the same preset
shapes with random weights: the median time of calls of --short and of --long new tokens
(greedy, ignore_eos, batch --batch, --prompt-len tokens), so that

    step  = (long call - short call) / (long - short)   the decode step, prefill excluded
    fixed = short call - (short - 1) * step              prefill, launches, the harvest

and jspec's own TPOT (`metrics.tpot_s` of the long call: its time after the first token,
per token), which carries the dispatch program's launch. XLA_FLAGS apply to both precisions.

    python benchmarks/call_and_step.py --model qwen3-30b-a3b --batch 1
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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
  for precision in args.precisions:
    shaped = (dataclasses.replace(config, fp8_block=(128, 128)) if precision == "fp8"
              else config)
    llm = jspec.LLM.from_random(shaped, None, max_model_len=args.prompt_len + args.long + 16,
                                max_num_seqs=args.batch)
    for n in (args.short, args.long):  # compiles: both lengths run the same programs
      timed_calls(llm, prompts, n, 1)
    short, _ = timed_calls(llm, prompts, args.short, args.repeats)
    long, tpot = timed_calls(llm, prompts, args.long, args.repeats)
    step = (long - short) / (args.long - args.short)
    rows.append((precision, 1e3 * short, 1e3 * long, 1e3 * step,
                 1e3 * (short - (args.short - 1) * step), 1e3 * tpot))
    print(f"{precision}: calls of {args.short} / {args.long} tokens {rows[-1][1]:.2f} / "
          f"{rows[-1][2]:.2f} ms", flush=True)
    del llm
    gc.collect()
  print(f"\n{args.model} ({config.num_layers} layers), batch {args.batch}, prompt "
        f"{args.prompt_len}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"{'precision':9s} {'short ms':>9s} {'long ms':>9s} {'step ms':>8s} {'fixed ms':>9s} "
        f"{'TPOT ms':>8s}")
  for precision, short, long, step, fixed, tpot in rows:
    print(f"{precision:9s} {short:9.2f} {long:9.2f} {step:8.3f} {fixed:9.2f} {tpot:8.3f}")
  if len(rows) == 2:
    print(f"fp8 / bf16: step {rows[1][3] / rows[0][3]:.3f}x, fixed {rows[1][4] / rows[0][4]:.3f}x, "
          f"TPOT {rows[1][5] / rows[0][5]:.3f}x")


if __name__ == "__main__":
  main()
