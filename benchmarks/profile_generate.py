"""Where one `generate` call's device time goes, per mesh and batch: a profiler trace summed by
XLA op on GPU 0 (collectives, matmuls, fusions; the top ops), after a warm-up call.

    python benchmarks/profile_generate.py --model qwen3-8b --mesh 1,1,1 1,4,1 --batch 1 8
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

import jspec
from jspec.bench.presets import PRESETS
from jspec.bench.profile import idle_summary, profile, summary
from jspec.sharding.rules import ShardingRules


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", choices=list(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
  parser.add_argument("--mesh", nargs="+", default=["1,1,1"], help="dp,tp,ep triples")
  parser.add_argument("--batch", type=int, nargs="+", default=[1])
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--top", type=int, default=12)
  parser.add_argument("--vocab-replicated", action="store_true",
                      help="keep the embedding and lm_head whole on every tp shard")
  parser.add_argument("--all-reduce-backend", default="auto",
                      choices=["auto", "partitioner", "xla", "kernel"])
  parser.add_argument("--method", default="none", choices=["none", "mtp"],
                      help="mtp: a random one-layer MTP head drafts (nothing is accepted)")
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--tree", help="with --method mtp: a speculative_token_tree (vLLM's paths; "
                                     "k becomes its node count)")
  parser.add_argument("--draft-vocab-size", type=int, default=0,
                      help="with --method mtp: the head drafts from the first N token ids only "
                           "(speculative_config's draft_vocab)")
  parser.add_argument("--fp8", action="store_true",
                      help="the preset as an FP8 checkpoint (e4m3, 128 x 128 block scales)")
  parser.add_argument("--idle", action="store_true",
                      help="also where GPU 0 sat idle: gaps summed by the kernel after them")
  args = parser.parse_args()

  config = PRESETS[args.model]
  if args.layers:
    config = dataclasses.replace(config, num_layers=args.layers)
  if args.fp8:
    config = dataclasses.replace(config, fp8_block=(128, 128))
  rng = np.random.default_rng(0)
  params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
  mtp_spec = speculative = None
  if args.method == "mtp":
    mtp_spec = jspec.MTPSpec("qwen3_next", 1, is_moe=config.is_moe)
    speculative = {"method": "mtp", "num_speculative_tokens": args.k}
    if args.tree:
      speculative.update(num_speculative_tokens=args.tree.count("("),
                         speculative_token_tree=args.tree)
    if args.draft_vocab_size:
      speculative["draft_vocab"] = list(range(args.draft_vocab_size))
  for mesh_text in args.mesh:
    dp, tp, ep = (int(x) for x in mesh_text.split(","))
    # Room for the prompt and its new tokens (at least the 1024 slots the script always had).
    max_len = max(1024, args.prompt_len + args.max_tokens + 16)
    llm = jspec.LLM.from_random(config, mtp_spec, max_model_len=max_len,
                                max_num_seqs=max(args.batch), speculative_config=speculative,
                                mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep),
                                sharding_rules=(ShardingRules(vocab=None) if args.vocab_replicated
                                                else None),
                                all_reduce_backend=args.all_reduce_backend)
    for batch in args.batch:
      prompts = [rng.integers(0, config.vocab_size, args.prompt_len).tolist()
                 for _ in range(batch)]
      llm.generate(prompts, params)  # compiles
      outputs = []
      wall, times, *idle = profile(lambda: outputs.append(llm.generate(prompts, params)),
                                   with_idle=args.idle)
      # A call of one new token takes no decode step: its time is the prefill alone.
      steps = max(1, max(o.metrics.num_steps for o in outputs[0]))
      name = args.model + (" FP8" if args.fp8 else "")
      print(f"\n== {name} mesh {mesh_text} batch {batch}: {steps} steps, "
            f"{1e3 * wall / steps:.2f} ms/step (prefill included, profiler on)")
      print(summary(wall, times, args.top), flush=True)
      if idle:
        print(idle_summary(idle[0], args.top), flush=True)


if __name__ == "__main__":
  main()
