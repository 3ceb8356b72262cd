"""Tokens/s and acceptance for none / mtp / ngram, on real-size random-weight models or a checkpoint.

    python benchmarks/speculative.py --model qwen3-8b --batch 1 8 --methods none mtp ngram --k 3
    python benchmarks/speculative.py --model qwen3-30b-a3b --layers 12 --mesh 1,1,1 2,1,1 1,2,1 1,1,2
    python benchmarks/speculative.py --model path/to/checkpoint --batch 1

Presets build their weights directly on the device(s) (nothing to download). Random weights
give meaningless acceptance: those rows measure step costs; real acceptance needs a trained
model. Each figure is the median of --repeats timed runs after one warm-up run (which compiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import numpy as np

import jspec
from jspec.bench.presets import PRESETS
from jspec.sharding.rules import ShardingRules

def build_models(args, mesh: jspec.MeshConfig):
  """(model label, LLM kwargs that share one set of weights)."""
  common = dict(mesh=mesh, dtype=args.dtype, max_model_len=args.max_model_len,
                moe_backend=args.moe_backend, max_num_seqs=max(args.batch),
                attention_backend=args.attention_backend,
                sharding_rules=ShardingRules(vocab=None) if args.vocab_replicated else None)
  if args.model in PRESETS:
    config = PRESETS[args.model]
    if args.layers:
      config = dataclasses.replace(config, num_layers=args.layers)
    spec = jspec.MTPSpec("qwen3_next", 1, is_moe=config.is_moe)
    base = jspec.LLM.from_random(config, spec, **common)
    label = f"{args.model}" + (f" ({config.num_layers} layers)" if args.layers else "")
    modules = (None, config, base.target, base.mtp, spec)
    return label, lambda spec_cfg: jspec.LLM(_modules=modules, speculative_config=spec_cfg,
                                             **common)
  return args.model, lambda spec_cfg: jspec.LLM(model=args.model, speculative_config=spec_cfg,
                                                **common)


def run_one(llm, prompts, params, repeats):
  llm.generate(prompts, params)  # warm-up: compiles this bucket
  runs = [llm.generate(prompts, params) for _ in range(repeats)]
  walls = [r.metrics.wall_time_s for r in runs]
  m = runs[0].metrics
  wall = statistics.median(walls)
  return dict(tokens_per_second=m.num_generated_tokens / wall, wall_time_s=wall,
              step_ms=1e3 * wall / max(1, max(o.metrics.num_steps for o in runs[0])),
              mean_acceptance_length=m.mean_acceptance_length,
              acceptance_rate_per_position=m.acceptance_rate_per_position,
              num_generated_tokens=m.num_generated_tokens)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", help=f"{list(PRESETS)} or a directory")
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--methods", nargs="+", default=["none", "mtp", "ngram"])
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--mesh", nargs="+", default=["1,1,1"], help="dp,tp,ep triples")
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--max-model-len", type=int, default=1024)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--moe-backend", default="auto")
  parser.add_argument("--attention-backend", default="xla", choices=["auto", "xla", "pallas"])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--vocab-replicated", action="store_true",
                      help="keep the embedding and lm_head whole on every tp shard")
  parser.add_argument("--out", default="")
  args = parser.parse_args()

  rng = np.random.default_rng(0)
  rows = []
  for mesh_text in args.mesh:
    dp, tp, ep = (int(x) for x in mesh_text.split(","))
    mesh = jspec.MeshConfig(dp=dp, tp=tp, ep=ep)
    start = time.perf_counter()
    try:
      label, make = build_models(args, mesh)
    except Exception as err:  # e.g. a mesh the model does not divide over: say so, go on.
      print(f"FAILED {mesh_text}: {err!r}"[:2000], flush=True)
      continue
    print(f"[{mesh_text}] weights ready in {time.perf_counter() - start:.1f} s", flush=True)
    for method in args.methods:
      spec = None if method == "none" else {"method": method, "num_speculative_tokens": args.k}
      llm = make(spec)
      for batch in args.batch:
        vocab = llm.config.vocab_size
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(batch)]
        params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                      ignore_eos=True)
        start = time.perf_counter()
        try:
          result = run_one(llm, prompts, params, args.repeats)
        except Exception as err:  # Record and go on: one failing row must not hide the rest.
          print(f"FAILED {mesh_text} {method} batch={batch}: {err!r}"[:2000], flush=True)
          continue
        row = dict(model=label, mesh=mesh_text, method=method, k=args.k if spec else 0,
                   batch=batch, device=jax.devices()[0].device_kind,
                   bench_seconds=time.perf_counter() - start, **result)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # after every row: a run stopped by a time limit keeps what it measured
          with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
  base = {(r["model"], r["method"], r["batch"]): r["tokens_per_second"]
          for r in rows if r["mesh"] == "1,1,1"}
  print(f"\n{'model':26s} {'mesh':7s} {'method':6s} {'B':>3s} {'tok/s':>9s} {'step ms':>8s} "
        f"{'acc len':>7s} {'vs 1 dev':>8s}")
  for r in rows:
    ref = base.get((r["model"], r["method"], r["batch"]))
    scale = f"{r['tokens_per_second'] / ref:7.2f}x" if ref else "      -"
    print(f"{r['model']:26s} {r['mesh']:7s} {r['method']:6s} {r['batch']:3d} "
          f"{r['tokens_per_second']:9.1f} {r['step_ms']:8.2f} {r['mean_acceptance_length']:7.2f} "
          f"{scale}")


if __name__ == "__main__":
  main()
