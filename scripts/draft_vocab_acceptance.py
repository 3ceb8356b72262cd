"""What a reduced draft vocabulary costs in acceptance, on the trained demo model.

    python scripts/draft_vocab_acceptance.py --sizes 512 1024 2048 4096

Token frequencies come from the training split of the Python half of the demo corpus (the
standard library, split as `jspec.train.corpus` splits it); the prompts are 16 held-out
stretches of code. For each draft-vocabulary size: the share of held-out tokens it covers and
the pooled MTP acceptance (k drafts, greedy and T = 0.7). Acceptance does not depend on the
device, so this runs on a CPU.
"""

from __future__ import annotations

import argparse
import json

import jspec
from jspec.config import SamplingParams
from jspec.speculative.draft_vocab import coverage, most_frequent_tokens
from jspec.train import corpus, evaluation


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--out", default="")
  args = parser.parse_args()

  model_dir = jspec.demo_model_path()
  full = jspec.LLM(model=model_dir, dtype="bfloat16", max_model_len=1024)
  tokenizer, vocab = full.tokenizer, full.config.vocab_size
  train, heldout = corpus.split_documents(corpus.python_documents(), 0.05, 0)
  encode = lambda docs: [tokenizer(d.text, add_special_tokens=False)["input_ids"] for d in docs]
  train_ids, heldout_ids = encode(train), encode(heldout)
  prompts = evaluation.heldout_prompts(heldout, "python", args.prompts, 0)

  rows = []
  for size in args.sizes + [vocab]:
    ids = most_frequent_tokens(train_ids, size, vocab)
    spec = {"method": "mtp", "num_speculative_tokens": args.k,
            "draft_vocab": ids if size < vocab else None}
    llm = jspec.LLM(model=model_dir, dtype="bfloat16", max_model_len=1024, seed=0,
                    speculative_config=spec)
    row = {"draft_vocab": size, "heldout_coverage": coverage(heldout_ids, ids)}
    for temperature in (0.0, 0.7):
      params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=0,
                              ignore_eos=True)
      row[f"t{temperature}"] = evaluation.pooled(llm.generate(prompts, params), args.k)
    rows.append(row)
    print(json.dumps(row), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
  print(f"\n{'draft vocab':>11s} {'coverage':>9s} {'A greedy':>9s} {'A T=0.7':>8s}")
  for r in rows:
    print(f"{r['draft_vocab']:11d} {100 * r['heldout_coverage']:8.1f}% "
          f"{r['t0.0']['mean_acceptance_length']:9.2f} {r['t0.7']['mean_acceptance_length']:8.2f}")


if __name__ == "__main__":
  main()
