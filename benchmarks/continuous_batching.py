"""Continuous batching on request sets with long-tailed output lengths (issue "batch generation").

    python benchmarks/continuous_batching.py --model qwen3-8b --methods none mtp ngram
    python benchmarks/continuous_batching.py --model demo --batching continuous waves
    python benchmarks/continuous_batching.py --model qwen3-8b --dispatch-cost

Two request sets with the same prompts and the same total of output tokens:
  skewed:  output lengths log-normal around --median-output (--sigma), except a fraction
           --tail-fraction of the requests at --tail-factor x the median;
  uniform: every request the mean of the skewed lengths.
Prompt lengths are uniform in [--min-prompt, --max-prompt]. Output lengths are set with
max_tokens and ignore_eos, so every request generates exactly its length. Presets (Qwen3-8B
shapes, random weights) draw random prompt tokens; `--model demo` (the trained demo model,
real acceptance) takes its prompts from Python standard-library sources, text it was
trained on.

No scheduler beats the longest request: a set runs at least max(longest output, total output
/ slots) steps. With 512 requests on 64 slots and 5% at 20x the median, the sigma = 0.5 set
needs 20 m steps for its tail against 16.6 m for its total (0.83x of uniform at best); the
default sigma = 1 set has 20.5 m of total per slot, so the bound is not what is measured.
The summary prints each set's bound.

`--batching waves` runs the former scheduler (LLM(batching="waves"): batches of
max_num_seqs sorted by prompt length, each running until its longest request ends).
tokens/s counts generated tokens over the time spent running (compilation excluded: the
engine compiles a program before it starts timing).

`--dispatch-cost`: the host's cost per dispatch at batch 1. The same requests run twice, in
one dispatch (Finished rows for every request, no iteration budget) and in dispatches of
--dispatch-budget iterations; the difference in wall time over the difference in dispatches is
what a dispatch boundary costs, set against the step time. The per-dispatch timings split it
into the idle time between launches and the launch of an empty dispatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

import jspec
from jspec.bench.presets import PRESETS


def output_lengths(rng, num: int, median: int, tail_fraction: float, tail_factor: int,
                   sigma: float):
  lengths = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(num))), 1,
                    tail_factor * median)
  tail = rng.choice(num, size=int(round(tail_fraction * num)), replace=False)
  lengths[tail] = tail_factor * median
  return lengths.astype(int)


def uniform_like(lengths):
  total, num = int(np.sum(lengths)), len(lengths)
  even = np.full(num, total // num)
  even[:total % num] += 1
  return even


def demo_prompts(rng, tokenizer, lengths):
  """Token-id prompts cut from the standard library's sources at random places."""
  files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
  ids = []
  for path in files[:60]:
    with open(path, encoding="utf-8", errors="ignore") as f:
      ids += tokenizer(f.read(), add_special_tokens=False)["input_ids"]
  ids = np.asarray(ids)
  starts = rng.integers(0, len(ids) - max(lengths), size=len(lengths))
  return [ids[s:s + n].tolist() for s, n in zip(starts, lengths)]


def build(args, method: str, batching: str, **overrides):
  spec = None if method == "none" else {"method": method, "num_speculative_tokens": args.k}
  common = dict(dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, speculative_config=spec, batching=batching,
                prefill_chunk_size=args.prefill_chunk)
  common.update(overrides)
  if args.model == "demo":
    return jspec.LLM(model=jspec.demo_model_path(), **common)
  if args.model in PRESETS:
    key = ("weights",)
    if key not in BUILT:
      config = PRESETS[args.model]
      mtp = jspec.MTPSpec("qwen3_next", 1, is_moe=config.is_moe)
      BUILT[key] = jspec.LLM.from_random(config, mtp, **common)
    base = BUILT[key]
    modules = (None, base.config, base.target, base.mtp, base.mtp_spec)
    return jspec.LLM(_modules=modules, **common)
  return jspec.LLM(model=args.model, **common)


BUILT = {}


def run(llm, prompts, lengths, label: dict):
  params = [jspec.SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True)
            for n in lengths]
  start = time.perf_counter()
  outs = llm.generate(prompts, params, use_tqdm=False)
  m = outs.metrics
  row = dict(label, device=jax.devices()[0].device_kind, num_prompts=len(prompts),
             num_generated_tokens=m.num_generated_tokens, wall_time_s=m.wall_time_s,
             tokens_per_second=m.tokens_per_second,
             mean_acceptance_length=m.mean_acceptance_length,
             seconds_with_compile=time.perf_counter() - start,
             num_dispatches=getattr(outs, "num_dispatches", None),
             host_seconds_per_dispatch=getattr(outs, "host_seconds_per_dispatch", None),
             num_iterations=getattr(outs, "num_iterations", None),
             dispatches=[dataclasses.asdict(t) for t in getattr(outs, "dispatches", [])])
  if row["num_iterations"]:
    row["ms_per_iteration"] = 1e3 * row["wall_time_s"] / row["num_iterations"]
  assert all(len(o.token_ids) == n for o, n in zip(outs, lengths))
  print(json.dumps(row), flush=True)
  return row


def dispatch_anatomy(timings: list[dict]) -> dict:
  """Where a boundary's time goes, from one call's dispatch timings (launching thread):
  the idle time between one launch's return and the next launch's start; the last launch,
  which found nothing to do (the launch and the program's setup alone); and a least-squares
  fit seconds = fixed + per_iteration x iterations over the other dispatches (on a GPU a launch
  lasts as long as its loop)."""
  gaps = [b["start_s"] - (a["start_s"] + a["seconds"]) for a, b in zip(timings, timings[1:])]
  busy = [t for t in timings if t["iterations"]]
  fit = {}
  if len({t["iterations"] for t in busy}) > 1:
    per_iteration, fixed = np.polyfit([t["iterations"] for t in busy],
                                      [t["seconds"] for t in busy], 1)
    fit = dict(fit_fixed_seconds=float(fixed), fit_seconds_per_iteration=float(per_iteration))
  return dict(gap_seconds_median=float(np.median(gaps)) if gaps else None,
              gap_seconds_max=float(max(gaps)) if gaps else None,
              empty_launch_seconds=timings[-1]["seconds"] if timings else None, **fit)


def dispatch_cost(args, prompts, rows):
  """Batch 1: one dispatch for every request vs the default dispatches."""
  num = args.dispatch_requests
  lengths = [args.median_output] * num
  prompts = prompts[:num]
  label = dict(model=args.model, method="none", batching="continuous", set="batch1")
  many = build(args, "none", "continuous", max_num_seqs=1)
  one = build(args, "none", "continuous", max_num_seqs=1)
  # Room for every request in both. `many` ends a dispatch every --dispatch-budget iterations
  # (many boundaries, so that their cost stands out of the run-to-run noise); `one` has no
  # iteration budget: a single dispatch.
  for llm, budget in ((many, args.dispatch_budget), (one, 1 << 30)):
    llm.scheduler.finished_rows = 2 * num
    llm.scheduler.budget = budget
  results = {}
  for name, llm in (("dispatches", many), ("one_dispatch", one)):
    llm.generate(prompts[:2], [jspec.SamplingParams(temperature=0.0, max_tokens=2,
                                                    ignore_eos=True)] * 2, use_tqdm=False)
    walls = [run(llm, prompts, lengths, dict(label, variant=name)) for _ in range(args.repeats)]
    results[name] = walls
  median = lambda rs, key: statistics.median(r[key] for r in rs)
  extra = median(results["dispatches"], "num_dispatches") - median(results["one_dispatch"],
                                                                    "num_dispatches")
  per_dispatch = ((median(results["dispatches"], "wall_time_s")
                   - median(results["one_dispatch"], "wall_time_s")) / max(extra, 1))
  steps = num * (args.median_output - 1)
  step = median(results["one_dispatch"], "wall_time_s") / steps
  row = dict(model=args.model, set="batch1-dispatch-cost", requests=num,
             tokens_each=args.median_output, extra_dispatches=extra,
             seconds_per_dispatch=per_dispatch, step_seconds=step,
             dispatch_over_step=per_dispatch / step,
             host_seconds_per_dispatch=median(results["dispatches"],
                                              "host_seconds_per_dispatch"),
             **dispatch_anatomy(results["dispatches"][-1]["dispatches"]),
             xla_flags=os.environ.get("XLA_FLAGS", ""), device=jax.devices()[0].device_kind)
  print(json.dumps(row), flush=True)
  rows.append(row)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", help=f"'demo', {list(PRESETS)} or a dir")
  parser.add_argument("--num-prompts", type=int, default=512)
  parser.add_argument("--min-prompt", type=int, default=16)
  parser.add_argument("--max-prompt", type=int, default=1024)
  parser.add_argument("--median-output", type=int, default=32)
  parser.add_argument("--tail-fraction", type=float, default=0.05)
  parser.add_argument("--tail-factor", type=int, default=20)
  parser.add_argument("--sigma", type=float, default=1.0,
                      help="log-normal spread of the outputs outside the tail")
  parser.add_argument("--max-num-seqs", type=int, default=64)
  parser.add_argument("--methods", nargs="*", default=["none", "mtp", "ngram"])
  parser.add_argument("--batching", nargs="+", default=["continuous"])
  parser.add_argument("--sets", nargs="*", default=["skewed", "uniform"])
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--prefill-chunk", type=int, default=256)
  parser.add_argument("--max-model-len", type=int, default=0,
                      help="default: the longest prompt + the longest output + 16")
  parser.add_argument("--dispatch-cost", action="store_true")
  parser.add_argument("--dispatch-requests", type=int, default=32)
  parser.add_argument("--dispatch-budget", type=int, default=8,
                      help="iterations per dispatch in --dispatch-cost's many-dispatch run")
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  args.max_model_len = args.max_model_len or (args.max_prompt + args.tail_factor
                                              * args.median_output + 16)

  rng = np.random.default_rng(0)
  prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.num_prompts)
  skewed = output_lengths(rng, args.num_prompts, args.median_output, args.tail_fraction,
                          args.tail_factor, args.sigma)
  sets = {"skewed": skewed, "uniform": uniform_like(skewed)}
  if args.model == "demo":
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(jspec.demo_model_path())
    prompts = demo_prompts(rng, tokenizer, prompt_lens)
  else:
    vocab = PRESETS[args.model].vocab_size if args.model in PRESETS else 1000
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in prompt_lens]
  bound = skewed.sum() / args.max_num_seqs / max(skewed.max(), skewed.sum() / args.max_num_seqs)
  print(f"{args.num_prompts} prompts of {prompt_lens.min()}..{prompt_lens.max()} tokens; "
        f"skewed outputs: median {np.median(skewed):.0f}, max {skewed.max()}, total "
        f"{skewed.sum()}; steps bound skewed / uniform {bound:.2f}", flush=True)

  rows = []
  save = lambda: args.out and json.dump(rows, open(args.out, "w"), indent=1)
  if args.dispatch_cost:
    dispatch_cost(args, prompts, rows)
    save()
  for method in args.methods:
    for batching in args.batching:
      llm = build(args, method, batching)
      for name in args.sets:
        try:
          rows.append(run(llm, prompts, sets[name], dict(model=args.model, method=method,
                                                         batching=batching, set=name)))
        except Exception as err:  # one failing row must not hide the rest
          print(f"FAILED {method} {batching} {name}: {err!r}"[:2000], flush=True)
        save()
  tps = {(r["method"], r["batching"], r["set"]): r["tokens_per_second"] for r in rows
         if "method" in r and "variant" not in r}
  print(f"\n{'method':6s} {'batching':10s} {'set':8s} {'tok/s':>9s} {'vs uniform':>10s} "
        f"{'vs waves':>9s}")
  for (method, batching, name), value in tps.items():
    uniform = tps.get((method, batching, "uniform"))
    waves = tps.get((method, "waves", name))
    print(f"{method:6s} {batching:10s} {name:8s} {value:9.1f} "
          f"{value / uniform if uniform else float('nan'):9.2f}x "
          f"{value / waves if waves else float('nan'):8.2f}x")


if __name__ == "__main__":
  sys.exit(main())
