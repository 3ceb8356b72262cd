"""Token trees against chains on the trained demo model (real acceptance), greedy, batch 1:
mean accepted length per step and tokens/s (prefill included), each prompt its own call.

    python benchmarks/token_trees.py --prompts 8 --prompt-len 128 --max-tokens 256

Rows: no speculation, MTP chains of k = 1..4, and the trees of TREES (vLLM's
`speculative_token_tree` spelling), each beside the chain of its depth.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from transformers import AutoTokenizer

import jspec
from continuous_batching import demo_prompts

TREES = {
    "7 nodes, depth 3": "[(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]",
    "10 nodes, depth 4": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), "
                         "(0, 1, 0), (0, 0, 0, 0)]",
    "16 nodes, depth 5": "[(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), "
                         "(2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), "
                         "(0, 0, 0, 0, 0)]",
    # A deep chain with branches near the root: the shape that suits a drafter whose first
    # candidate is usually right (the demo head's).
    "16 nodes, depth 6": "[(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0), "
                         "(0, 0, 1), (0, 1, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0), "
                         "(0, 0, 0, 0, 1), (0, 0, 0, 0, 0, 0)]",
    "16 nodes, depth 8": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), "
                         "(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), "
                         "(0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0, 0), "
                         "(0, 2)]",
}


def run(llm, prompts, max_tokens: int, repeats: int):
  """(tokens/s over the prompts' calls, the median of `repeats` passes; mean accepted length)."""
  params = jspec.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
  llm.generate(prompts[:1], params, use_tqdm=False)  # compile
  rates, accepted, steps = [], 0, 0
  for _ in range(repeats):
    tokens, seconds = 0, 0.0
    for prompt in prompts:
      start = time.perf_counter()
      out = llm.generate([prompt], params, use_tqdm=False)[0]
      seconds += time.perf_counter() - start
      tokens += len(out.token_ids)
      accepted += out.metrics.num_accepted_tokens
      steps += out.metrics.num_steps
    rates.append(tokens / seconds)
  return float(np.median(rates)), 1 + accepted / max(steps, 1)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--max-tokens", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--chains", type=int, nargs="+", default=[1, 2, 3, 4, 5])
  parser.add_argument("--trees", nargs="+", default=list(TREES)[:3], choices=list(TREES))
  args = parser.parse_args()
  tokenizer = AutoTokenizer.from_pretrained(jspec.demo_model_path())
  prompts = demo_prompts(np.random.default_rng(0), tokenizer, [args.prompt_len] * args.prompts)
  configs = [("none", None)] + [(f"chain k={k}", {"method": "mtp", "num_speculative_tokens": k})
                                for k in args.chains]
  for name in args.trees:
    paths = TREES[name]
    configs.append((f"tree {name}", {"method": "mtp", "num_speculative_tokens": paths.count("("),
                                     "speculative_token_tree": paths}))
  rows = []
  for name, spec in configs:
    llm = jspec.LLM(model=jspec.demo_model_path(), max_model_len=1024, max_num_seqs=1,
                    speculative_config=spec)
    rate, accept = run(llm, prompts, args.max_tokens, args.repeats)
    rows.append(dict(config=name, tokens_per_second=round(rate, 1),
                     mean_accepted_length=round(accept, 3)))
    print(json.dumps(rows[-1]), flush=True)
  base = rows[0]["tokens_per_second"]
  print("\n| config | mean accepted length | tok/s | vs none |")
  print("| --- | ---: | ---: | ---: |")
  for r in rows:
    print(f"| {r['config']} | {r['mean_accepted_length']} | {r['tokens_per_second']} | "
          f"{r['tokens_per_second'] / base:.3f}x |")


if __name__ == "__main__":
  main()
