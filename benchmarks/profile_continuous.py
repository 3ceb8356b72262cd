"""Where a continuous-batching call's device time goes: a profiler trace of one `generate`
over prompts that keep the in-loop prefill busy, summed per XLA op, plus the large copies and
scatters in the compiled dispatch program (a copy of a whole cache inside the loop shows up as
one line here, and as milliseconds per iteration there).

    python benchmarks/profile_continuous.py --model qwen3-8b --max-num-seqs 64 \
        --num-prompts 64 --prompt-len 512 --max-tokens 64 --hlo-out dispatch.hlo.txt

Prints: iterations and ms per iteration, without and with the profiler; the profile summary; every instruction of the
dispatch program that moves at least --min-mb MB (copy, scatter, gather, dynamic-update-slice,
select), with its shape.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

import numpy as np

import jspec
from jspec.bench.presets import PRESETS
from jspec.bench.profile import large_moves, profile, summary


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", choices=list(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
  parser.add_argument("--method", default="none", choices=["none", "mtp", "ngram"])
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--max-num-seqs", type=int, default=64)
  parser.add_argument("--num-prompts", type=int, default=64)
  parser.add_argument("--prompt-len", type=int, default=512)
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--max-model-len", type=int, default=2048)
  parser.add_argument("--prefill-chunk", type=int, default=256)
  parser.add_argument("--top", type=int, default=20)
  parser.add_argument("--min-mb", type=float, default=64.0)
  parser.add_argument("--hlo-out", default="", help="write the dispatch program's HLO here")
  args = parser.parse_args()

  config = PRESETS[args.model]
  if args.layers:
    config = dataclasses.replace(config, num_layers=args.layers)
  spec = (None if args.method == "none" else
          {"method": args.method, "num_speculative_tokens": args.k})
  mtp = jspec.MTPSpec("qwen3_next", 1, is_moe=config.is_moe) if args.method == "mtp" else None
  llm = jspec.LLM.from_random(config, mtp, max_model_len=args.max_model_len,
                              max_num_seqs=args.max_num_seqs, speculative_config=spec,
                              prefill_chunk_size=args.prefill_chunk)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, config.vocab_size, args.prompt_len).tolist()
             for _ in range(args.num_prompts)]
  params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
  llm.generate(prompts, params, use_tqdm=False)  # compiles, warms up
  dispatch_c, = llm.scheduler.dispatch_programs.values()
  text = dispatch_c.as_text()
  if args.hlo_out:
    with open(args.hlo_out, "w") as f:
      f.write(text)
  moves = large_moves(text, args.min_mb * 2**20)
  print(f"\ninstructions of the dispatch program moving >= {args.min_mb:.0f} MB: {len(moves)}, "
        f"{sum(m.mb for m in moves) / 1024:.1f} GB in all; by kind and shape:")
  groups = collections.defaultdict(list)
  for m in moves:
    groups[(m.op, m.name, m.shape)].append(m.mb)
  for (op, name, shape), mbs in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
    print(f"  {len(mbs):4d} x {op:12s} {name[:28]:28s} {mbs[0]:8.1f} MB  {shape[:70]}")

  def report(outs, label):
    iterations = outs.num_iterations
    wall = outs.metrics.wall_time_s
    print(f"\n{label}: {iterations} iterations in {outs.num_dispatches} dispatches, "
          f"{wall:.2f} s, {1e3 * wall / max(iterations, 1):.2f} ms/iteration", flush=True)

  call = lambda: llm.generate(prompts, params, use_tqdm=False)
  report(call(), "without the profiler")
  results = []
  wall, times = profile(lambda: results.append(call()))
  report(results[0], f"== {args.model} method {args.method} slots {args.max_num_seqs}: "
         f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} out, "
         f"profiler on")
  print(summary(wall, times, args.top), flush=True)

if __name__ == "__main__":
  main()
