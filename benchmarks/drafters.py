"""Step costs of the separate drafters (EAGLE-3 head, draft model) on real-size random weights.

    python benchmarks/drafters.py --target llama-3.1-8b --draft-model llama-3.2-1b --batch 1 8
    python benchmarks/drafters.py --target mixtral-8x7b --mesh 1,1,2 --batch 2 16 --methods none eagle3

For each batch size and method, the step time is wall / verify steps of a greedy generation
with fixed lengths (ignore_eos). Random weights give meaningless acceptance, so what is
measured is cost; the speedup a trained drafter would give is derived from it:
  - verify cost: the n-gram step at the same k (its drafting is a few vector compares), so
    draft cost per token = (step(method) - step(ngram)) / k;
  - derived speedup at an acceptance length tau (tokens emitted per step):
    tau * step(none) / step(method), printed for a few tau;
  - roofline: the least bytes a plain decode step reads (jspec.bench.roofline.step_bytes)
    over the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import jax
import numpy as np

import jspec
from jspec.bench.presets import PRESETS
from jspec.bench.roofline import hbm_bandwidth, step_bytes
from jspec.models.eagle3 import Eagle3Config, default_aux_layers

TAUS = (1.5, 2.0, 2.5, 3.0, 3.5)


def eagle3_config(target: jspec.ModelConfig, draft_vocab: int) -> Eagle3Config:
  """The shapes of the published Llama-3.1-8B EAGLE-3 head (one Llama layer of the target's
  width, a 32k draft vocabulary), for any Llama-shaped target."""
  layer = target.replace(num_layers=1, tie_word_embeddings=False,
                              intermediate_size=target.intermediate_size
                              or target.moe.intermediate_size,
                              moe=None)
  return Eagle3Config(layer=layer, draft_vocab_size=draft_vocab,
                      target_hidden_size=target.hidden_size,
                      aux_layer_ids=default_aux_layers(target.num_layers))


def timed(llm, prompts, params, repeats: int) -> dict:
  llm.generate(prompts, params)  # compiles this bucket
  runs = [llm.generate(prompts, params) for _ in range(repeats)]
  wall = statistics.median(r.metrics.wall_time_s for r in runs)
  steps = max(o.metrics.num_steps for o in runs[0])
  return dict(step_ms=1e3 * wall / steps, tokens_per_second=runs[0].metrics.num_generated_tokens
              / wall, mean_acceptance_length=runs[0].metrics.mean_acceptance_length)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--target", default="llama-3.1-8b", choices=list(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="override the target's layer count")
  parser.add_argument("--draft-model", default="llama-3.2-1b", choices=list(PRESETS))
  parser.add_argument("--draft-vocab", type=int, default=32000)
  parser.add_argument("--methods", nargs="+", default=["none", "ngram", "eagle3", "draft_model"])
  parser.add_argument("--k", type=int, nargs="+", default=[3])
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--mesh", default="1,1,1", help="dp,tp,ep")
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--max-model-len", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--moe-backend", default="auto")
  parser.add_argument("--out", default="")
  args = parser.parse_args()

  dp, tp, ep = (int(x) for x in args.mesh.split(","))
  mesh = jspec.MeshConfig(dp=dp, tp=tp, ep=ep)
  target_cfg = PRESETS[args.target]
  if args.layers:
    target_cfg = dataclasses.replace(target_cfg, num_layers=args.layers)
  common = dict(mesh=mesh, dtype="bfloat16", max_model_len=args.max_model_len,
                max_num_seqs=max(args.batch), moe_backend=args.moe_backend)
  base = jspec.LLM.from_random(target_cfg, **common)
  modules = (None, target_cfg, base.target, None, None)
  drafts = {"eagle3": eagle3_config(target_cfg, args.draft_vocab),
            "draft_model": PRESETS[args.draft_model]}
  bandwidth = hbm_bandwidth()["read"]
  rng = np.random.default_rng(0)
  rows = []
  for method in args.methods:
    for k in ([0] if method == "none" else args.k):
      spec = None if method == "none" else {"method": method, "num_speculative_tokens": k}
      if method in drafts:
        spec["model"] = "<random>"  # the drafter's weights are built on device, not read
        llm = _with_random_draft(modules, target_cfg, drafts[method], spec, common)
      else:
        llm = jspec.LLM(_modules=modules, speculative_config=spec, **common)
      for batch in args.batch:
        prompts = [rng.integers(0, target_cfg.vocab_size, args.prompt_len).tolist()
                   for _ in range(batch)]
        params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                      ignore_eos=True)
        row = dict(method=method, k=k, batch=batch, **timed(llm, prompts, params, args.repeats))
        context = args.prompt_len + args.max_tokens // 2
        # One device's least read (a mesh splits it unevenly: attention is replicated over ep).
        row["roofline_ms"] = (1e3 * step_bytes(target_cfg, batch, 1, context) / bandwidth
                              if dp * tp * ep == 1 else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
      del llm

  by = {(r["method"], r["k"], r["batch"]): r for r in rows}
  print(f"\n{args.target} ({target_cfg.num_layers} layers), mesh dp,tp,ep = {args.mesh}, "
        f"read bandwidth {bandwidth / 1e12:.2f} TB/s, {jax.devices()[0].device_kind}")
  print("| method | k | batch | step ms | roofline share | draft ms / token | "
        + " | ".join(f"speedup at tau {t}" for t in TAUS) + " |")
  print("| --- " * (6 + len(TAUS)) + "|")
  for r in rows:
    none = by.get(("none", 0, r["batch"]))
    verify = by.get(("ngram", r["k"], r["batch"]))
    share = (r["roofline_ms"] / r["step_ms"] if r["method"] == "none" and r["roofline_ms"]
             else None)
    draft_ms = ((r["step_ms"] - verify["step_ms"]) / r["k"]
                if verify and r["method"] in drafts else None)
    speedups = [t * none["step_ms"] / r["step_ms"] if none and r["k"] else None for t in TAUS]
    r.update(draft_ms_per_token=draft_ms, derived_speedup=dict(zip(map(str, TAUS), speedups)))
    cell = lambda x, f="{:.3f}": "" if x is None else f.format(x)
    print(f"| {r['method']} | {r['k']} | {r['batch']} | {r['step_ms']:.3f} | "
          f"{cell(share, '{:.1%}')} | {cell(draft_ms)} | "
          + " | ".join(cell(s, "{:.2f}x") for s in speedups) + " |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(target=args.target, layers=target_cfg.num_layers, mesh=args.mesh,
                     device=jax.devices()[0].device_kind, read_bandwidth=bandwidth, rows=rows),
                f, indent=1)


def _with_random_draft(modules, target_cfg, draft_config, spec, common):
  """An LLM over the shared target weights with a random drafter of `draft_config`."""
  from jspec.models.drafts import init_random_drafter
  base = jspec.LLM(_modules=modules, **common)  # the mesh and rules the drafter is placed on
  draft = init_random_drafter(draft_config, target_cfg, base.dtype, base.mesh, base.draft_rules,
                              seed=1)
  return jspec.LLM(_modules=modules, _draft=draft, speculative_config=spec, **common)


if __name__ == "__main__":
  main()
