"""Which XLA fusions a decode step spends its time in, and what they compute: one traced
`generate` (jspec.bench.profile), then each of the costliest fusions' HLO from XLA's dump of
the optimized modules.

    XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" PYTHONPATH=. \\
        python3 benchmarks/profile_fusions.py --model qwen3-30b-a3b --layers 2 --fp8 \\
        --out fusions.txt

Random weights (step costs only), batch 1, a 512-token prompt and --max-tokens new tokens.
Prints the profile; writes, for each of the --top costliest fusions found in the dump, its
call and the computation it calls (the first 5000 characters) to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re

import numpy as np

import jspec
from jspec.bench.presets import PRESETS
from jspec.bench.profile import profile, summary


def computations(hlo_text: str) -> dict:
  """{computation name: its text} of an HLO module dump."""
  found = {}
  for block in hlo_text.split("\n\n"):
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", block.strip())
    if head:
      found[head.group(1)] = block
  return found


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--fp8", action="store_true", help="FP8 weights (128 x 128 blocks)")
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--top", type=int, default=8)
  parser.add_argument("--dump", default="/tmp/hlo", help="XLA's --xla_dump_to folder")
  parser.add_argument("--out", default="fusions.txt")
  args = parser.parse_args()
  cfg = dataclasses.replace(PRESETS[args.model], num_layers=args.layers,
                            fp8_block=(128, 128) if args.fp8 else None)
  llm = jspec.LLM.from_random(cfg, None, max_model_len=512 + args.max_tokens + 16,
                              max_num_seqs=1)
  prompt = [np.random.default_rng(0).integers(0, cfg.vocab_size, 512).tolist()]
  params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
  llm.generate(prompt, params, use_tqdm=False)  # compiles
  wall, times = profile(lambda: llm.generate(prompt, params, use_tqdm=False))
  print(summary(wall, times, 30), flush=True)
  ranked = sorted((kv for kv in times.items() if kv[0]), key=lambda kv: -kv[1][1])
  top = [name for name, _ in ranked if "fusion" in name][:args.top]
  with open(args.out, "w") as out:
    for path in sorted(glob.glob(os.path.join(args.dump, "*after_optimizations.txt"))):
      text = open(path).read()
      called_by = computations(text)
      for name in top:
        # The profile names "input_reduce_fusion_13" what the dump names "input_reduce_fusion.13".
        hlo_name = re.sub(r"_(\d+)$", r".\1", name)
        call = re.search(r"^\s*(?:ROOT )?%?" + re.escape(hlo_name) + r" = (.*)$", text, re.M)
        if not call:
          continue
        out.write(f"\n=== {os.path.basename(path)}: {name}\n{call.group(0)[:600]}\n")
        callee = re.search(r"calls=%?([\w.\-]+)", call.group(1))
        if callee and callee.group(1) in called_by:
          out.write(called_by[callee.group(1)][:5000] + "\n")
  print(f"costliest fusions: {top}; their HLO in {args.out}")


if __name__ == "__main__":
  main()
