"""`jspec demo`: the built-in trained model, with and without MTP speculation, on CPU or GPU."""

from __future__ import annotations

import jspec

# Both prompts at most 16 tokens: one prompt bucket, so each LLM compiles one program.
DEMO_PROMPTS = (
    "In the beginning God created",
    "def read_config(path):\n    \"\"\"Return the parsed config.\"\"\"\n",
)


def run_demo(args):
  path = jspec.demo_model_path()
  params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
  print(f"jspec demo: {path}\n")
  baseline = jspec.LLM(model=path, dtype="float32", max_model_len=512)
  speculative = jspec.LLM(model=path, dtype="float32", max_model_len=512,
                          speculative_config={"method": "mtp", "num_speculative_tokens": args.k})
  rows = []
  for prompt in DEMO_PROMPTS:
    for llm in (baseline, speculative):  # warm-up: compiles this prompt's bucket
      llm.generate([prompt], params)
    plain = baseline.generate([prompt], params)
    spec = speculative.generate([prompt], params)
    assert spec[0].token_ids == plain[0].token_ids, "greedy speculation must not change the text"
    print("-" * 72)
    print(prompt + spec[0].text)
    rows.append((prompt.splitlines()[0][:32], plain.metrics, spec.metrics))
  print("-" * 72)
  print(f"\n{'prompt':34s} {'tok/s plain':>12s} {'tok/s MTP':>10s} {'speedup':>8s} "
        f"{'accept len':>10s}  acceptance per position")
  for name, plain, spec in rows:
    rates = " ".join(f"{r:.2f}" for r in spec.acceptance_rate_per_position)
    print(f"{name:34s} {plain.tokens_per_second:12.1f} {spec.tokens_per_second:10.1f} "
          f"{spec.tokens_per_second / plain.tokens_per_second:7.2f}x "
          f"{spec.mean_acceptance_length:10.2f}  [{rates}]")
