"""One decode step's kernels (or one n-gram verify step's, `--ngram K`) on GPU 0, in the order
they ran: each kernel's time and the idle gap before it, summed by kernel over the step, then
the sequence itself from `--from`.

A profiled `generate` call (random weights, greedy), cut into steps as jspec.bench.step_trace
says.

    python benchmarks/step_kernels.py --model qwen3-8b --mesh 1,2,1 --show 40
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

import jspec
from jspec.bench.presets import PRESETS
from jspec.bench.step_trace import middle_step, step_report, traced_kernels


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
  parser.add_argument("--mesh", default="1,1,1", help="dp,tp,ep")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--top", type=int, default=24)
  parser.add_argument("--from", dest="start", type=int, default=0)
  parser.add_argument("--show", type=int, default=40)
  parser.add_argument("--fp8", action="store_true",
                      help="the preset as an FP8 checkpoint (e4m3, 128 x 128 block scales)")
  parser.add_argument("--ngram", type=int, default=0, metavar="K",
                      help="n-gram speculation of K drafts: each step a verify window of K + 1 "
                           "tokens (its drafting and acceptance included)")
  args = parser.parse_args()
  config = PRESETS[args.model]
  if args.layers:
    config = dataclasses.replace(config, num_layers=args.layers)
  if args.fp8:
    config = dataclasses.replace(config, fp8_block=(128, 128))
  dp, tp, ep = (int(x) for x in args.mesh.split(","))
  spec = args.ngram and {"method": "ngram", "num_speculative_tokens": args.ngram}
  llm = jspec.LLM.from_random(config, None, max_model_len=1024, max_num_seqs=args.batch,
                              mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep),
                              speculative_config=spec or None)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, config.vocab_size, args.prompt_len).tolist()
             for _ in range(args.batch)]
  params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
  llm.generate(prompts, params)  # compiles
  start = time.perf_counter()
  llm.generate(prompts, params)
  plain = time.perf_counter() - start
  kernels = traced_kernels(lambda: llm.generate(prompts, params))
  print(f"== {args.model}{' FP8' if args.fp8 else ''} mesh {args.mesh} batch {args.batch}"
        f"{f' n-gram k={args.ngram}' if args.ngram else ''}: "
        f"{plain * 1e3:.2f} ms a call "
        f"unprofiled, {len(kernels)} kernels profiled")
  print(step_report(middle_step(kernels), args.top, args.start, args.show), flush=True)


if __name__ == "__main__":
  main()
