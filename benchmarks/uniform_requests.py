"""The default scheduler against the wave scheduler on ordinary requests, with latency.

    python benchmarks/uniform_requests.py --model qwen3-8b --batch 1 8 64 --methods none mtp ngram
    python benchmarks/uniform_requests.py --model demo --batch 1 8 --prompt-len 128 --max-tokens 256

Every request of a call has the same prompt length and output length (`ignore_eos`, greedy),
as a user's first batch usually has. The same weights and the same prompts go through
`batching="continuous"` (the default) and `batching="waves"` in one process; each row is the
median of --repeats calls after a warm-up call (compilation excluded), the two schedulers
alternating so that drift hits both. Columns: end-to-end tokens/s (prefill included), ms
per generated token per request, the ratio default / waves, and the latency a serving user
reads (jspec.timing): time to first token (median over requests), inter-token latency
between chunks (p50 / p99 over every request's gaps) and TPOT. The tokens of the two
schedulers are compared too (random weights in bfloat16: a near-tie can flip).

Presets (Qwen3-8B shapes, random weights) draw random prompt tokens; `--model demo` (the
trained demo model, real acceptance) cuts its prompts from Python's standard-library sources.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

import jspec
from continuous_batching import build, demo_prompts

SCHEDULERS = ("continuous", "waves")


def call(llm, prompts, args):
  params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
  outs = llm.generate(prompts, params, use_tqdm=False)
  assert all(len(o.token_ids) == args.max_tokens for o in outs)
  return outs


def summary(outs) -> dict:
  m = outs.metrics
  return dict(wall_time_s=m.wall_time_s, tokens_per_second=m.tokens_per_second,
              ms_per_token=1e3 * m.wall_time_s / (m.num_generated_tokens / len(outs)),
              ttft_ms=1e3 * m.ttft_s, itl_p50_ms=1e3 * (m.itl_p50_s or 0),
              itl_p99_ms=1e3 * (m.itl_p99_s or 0), tpot_ms=1e3 * (m.tpot_s or 0),
              mean_acceptance_length=m.mean_acceptance_length,
              num_dispatches=outs.num_dispatches, num_iterations=outs.num_iterations)


def measure(llms, prompts, args, label):
  """Rows for both schedulers on the same prompts: warm-up, then alternating repeats."""
  runs = {name: [] for name in llms}
  tokens = {}
  for name, llm in llms.items():
    start = time.perf_counter()
    tokens[name] = [o.token_ids for o in call(llm, prompts, args)]
    print(f"  {label} {name}: warm-up (compiling) {time.perf_counter() - start:.1f} s",
          flush=True)
  for _ in range(args.repeats):
    for name, llm in llms.items():
      runs[name].append(summary(call(llm, prompts, args)))
  rows = []
  for name, results in runs.items():
    median = min(results, key=lambda r: abs(r["wall_time_s"] - statistics.median(
        x["wall_time_s"] for x in results)))
    rows.append(dict(label, batching=name, repeats=len(results),
                     walls_s=[r["wall_time_s"] for r in results], **median))
  same = sum(a == b for a, b in zip(*tokens.values()))
  for row in rows:
    row["requests_with_equal_tokens"] = f"{same}/{len(prompts)}"
    print(json.dumps(row), flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b")
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
  parser.add_argument("--methods", nargs="+", default=["none", "mtp", "ngram"])
  parser.add_argument("--prompt-len", type=int, default=512)
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--prefill-chunk", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--profile", action="store_true",
                      help="then one call of each scheduler at the first batch under the "
                           "profiler: GPU time by op, and how much of the wall the GPU was busy")
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  args.max_model_len = args.prompt_len + args.max_tokens + 16
  args.max_num_seqs = max(args.batch)

  rng = np.random.default_rng(0)
  if args.model == "demo":
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(jspec.demo_model_path())
    prompts = demo_prompts(rng, tokenizer, [args.prompt_len] * max(args.batch))
  else:
    from jspec.bench.presets import PRESETS
    vocab = PRESETS[args.model].vocab_size if args.model in PRESETS else 1000
    prompts = [rng.integers(0, vocab, size=args.prompt_len).tolist()
               for _ in range(max(args.batch))]

  rows = []
  for method in args.methods:
    llms = {name: build(args, method, name) for name in SCHEDULERS}
    for batch in args.batch:
      label = dict(model=args.model, method=method, batch=batch, prompt_len=args.prompt_len,
                   max_tokens=args.max_tokens, device=jax.devices()[0].device_kind)
      try:
        rows += measure(llms, prompts[:batch], args, label)
      except Exception as err:  # one failing row must not hide the rest
        print(f"FAILED {label}: {err!r}"[:2000], flush=True)
      if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)
    if args.profile:
      from jspec.bench.profile import profile, summary
      for name, llm in llms.items():
        wall, times = profile(lambda: call(llm, prompts[:args.batch[0]], args))
        print(f"\n== profile: {method} batch {args.batch[0]} {name}\n{summary(wall, times, 15)}",
              flush=True)

  by_key = {(r["method"], r["batch"], r["batching"]): r for r in rows}
  print(f"\n{'method':6s} {'batch':>5s} {'default tok/s':>13s} {'waves tok/s':>11s} "
        f"{'ratio':>6s} {'ms/token':>9s} {'TTFT ms':>8s} {'ITL p50':>8s} {'ITL p99':>8s} "
        f"{'TPOT':>6s} {'equal':>6s}")
  for (method, batch, name), row in by_key.items():
    if name != "continuous" or (method, batch, "waves") not in by_key:
      continue
    waves = by_key[method, batch, "waves"]
    print(f"{method:6s} {batch:5d} {row['tokens_per_second']:13.1f} "
          f"{waves['tokens_per_second']:11.1f} "
          f"{row['tokens_per_second'] / waves['tokens_per_second']:5.3f}x "
          f"{row['ms_per_token']:9.2f} {row['ttft_ms']:8.1f} {row['itl_p50_ms']:8.2f} "
          f"{row['itl_p99_ms']:8.2f} {row['tpot_ms']:6.2f} "
          f"{row['requests_with_equal_tokens']:>6s}")
    print(f"{'':6s} {'':5s} {'(waves)':>13s} {'':11s} {'':6s} {waves['ms_per_token']:9.2f} "
          f"{waves['ttft_ms']:8.1f} {waves['itl_p50_ms']:8.2f} {waves['itl_p99_ms']:8.2f} "
          f"{waves['tpot_ms']:6.2f}")


if __name__ == "__main__":
  sys.exit(main())
