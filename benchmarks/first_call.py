"""A model's first `generate` call (tracing, lowering and compiling its programs, then a few
tokens) and the part of it spent learning the drafter's state layout
(jspec.loop.slots.draft_state_shape), on a deep narrow model: a preset's layer kinds and
count at a small width, so that the host's trace and compile work is a real model's and the
weights are small enough for a CPU.

    python benchmarks/first_call.py --model qwen3-8b --layers 36
    python benchmarks/first_call.py --model qwen3-8b --layers 36 --method mtp --k 3
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jspec
from jspec.bench.presets import PRESETS
from jspec.loop import slots


def narrow(config, layers: int):
  """`config` at `layers` layers and width 256 (4 heads of 64, 2 KV heads, vocabulary 1024)."""
  return dataclasses.replace(config, num_layers=layers or config.num_layers, hidden_size=256,
                             intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                             vocab_size=1024)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="the preset's count where 0")
  parser.add_argument("--method", default=None, choices=[None, "ngram", "mtp"],
                      help="the drafter (mtp: a random one-layer MTP head)")
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--dtype", default="float32")
  args = parser.parse_args()
  config = narrow(PRESETS[args.model], args.layers)
  spec = args.method and {"method": args.method, "num_speculative_tokens": args.k}
  mtp = (jspec.MTPSpec("deepseek_v3" if config.mla else "qwen3_next", 1, is_moe=config.is_moe)
         if args.method == "mtp" else None)
  llm = jspec.LLM.from_random(config, mtp, max_model_len=256, max_num_seqs=1,
                              dtype=args.dtype, speculative_config=spec or None)
  probes = []
  probe = slots.draft_state_shape

  def timed(*probe_args, **kwargs):
    start = time.perf_counter()
    layout = probe(*probe_args, **kwargs)
    probes.append(time.perf_counter() - start)
    return layout

  slots.draft_state_shape = timed
  params = jspec.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
  start = time.perf_counter()
  llm.generate([[1, 2, 3]], params, use_tqdm=False)
  first = time.perf_counter() - start
  print(f"{args.model} at {config.num_layers} layers, width 256, {args.dtype}, drafter "
        f"{args.method or 'none'}: first generate {first:.2f} s, of which the drafter's state "
        f"layout {sum(probes):.3f} s ({len(probes)} probes: "
        f"{', '.join(f'{p:.3f}' for p in probes)})")


if __name__ == "__main__":
  main()
