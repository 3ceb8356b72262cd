"""End-to-end decode speed of `generate` with default settings: random weights in a preset's
shapes, --batch prompts of --prompt-len random tokens, --max-tokens new tokens each (greedy,
ignore_eos), the median of --repeats calls after a warm-up call (compilation).

    PYTHONPATH=. python3 benchmarks/generate_tpot.py --batch 1

One line per batch size: tokens/s (prefill included), TPOT (time per output token after the
first), TTFT and the warm-up. Run it from two checkouts (PYTHONPATH) to compare them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import jspec
from jspec.bench.presets import PRESETS


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
  parser.add_argument("--batch", type=int, nargs="+", default=[1])
  parser.add_argument("--prompt-len", type=int, default=512)
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--max-model-len", type=int, default=2048)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  llm = jspec.LLM.from_random(PRESETS[args.model], None, max_model_len=args.max_model_len)
  params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
  rng = np.random.default_rng(0)
  for batch in args.batch:
    prompts = [rng.integers(0, llm.config.vocab_size, args.prompt_len).tolist()
               for _ in range(batch)]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    warm_up = time.perf_counter() - start
    runs = sorted((llm.generate(prompts, params, use_tqdm=False).metrics
                   for _ in range(args.repeats)), key=lambda m: m.wall_time_s)
    mid = runs[len(runs) // 2]
    print(f"{jspec.__file__} {args.model} B={batch}: {mid.tokens_per_second:.1f} tok/s, "
          f"TPOT {1e3 * mid.tpot_s:.3f} ms, TTFT {1e3 * mid.ttft_s:.1f} ms, "
          f"warm-up {warm_up:.1f} s", flush=True)


if __name__ == "__main__":
  main()
