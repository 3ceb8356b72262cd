"""Where a default (continuous) `generate` call's time goes against the waves, on the trained
demo model: per (method, batch), interleaved timed calls of each scheduler; with --profile,
also the GPU's busy and idle time under the profiler (idle gaps summed by the kernel after
them) and a host-side cProfile of 4 calls (cumulative and own time).

    PYTHONPATH=. python3 benchmarks/call_overhead.py [--calls 8] [--profile]

The table last: median and best call per scheduler, waves / default.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np
import transformers

import jspec
from jspec.bench.profile import idle_summary, profile

sys.path.insert(0, os.path.dirname(__file__))
from continuous_batching import demo_prompts  # noqa: E402


def host_profile(llm, prompts, params):
  pr = cProfile.Profile()
  pr.enable()
  for _ in range(4):
    llm.generate(prompts, params, use_tqdm=False)
  pr.disable()
  for order, lines, rows in (("cumulative", 60, 28), ("tottime", 40, 15)):
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats(order).print_stats(rows)
    print("\n".join(out.getvalue().splitlines()[:lines]), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=8, help="timed calls per scheduler and row")
  parser.add_argument("--profile", action="store_true",
                      help="also the device profile and a host cProfile per row")
  args = parser.parse_args()
  tok = transformers.AutoTokenizer.from_pretrained(jspec.demo_model_path())
  rng = np.random.default_rng(0)
  rows = []
  for method in ("none", "mtp"):
    spec = None if method == "none" else {"method": "mtp", "num_speculative_tokens": 3}
    llms = {b: jspec.LLM(model=jspec.demo_model_path(), max_model_len=512, max_num_seqs=8,
                         speculative_config=spec, batching=b) for b in ("continuous", "waves")}
    for batch in (1, 8):
      prompts = demo_prompts(rng, tok, [128] * batch)
      params = jspec.SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
      tokens = {}
      for b, llm in llms.items():
        for _ in range(2):
          out = llm.generate(prompts, params, use_tqdm=False)
        tokens[b] = [o.outputs[0].token_ids for o in out]
      if tokens["continuous"] != tokens["waves"]:
        raise SystemExit(f"{method} B={batch}: the schedulers' tokens differ")
      times = {b: [] for b in llms}
      for _ in range(args.calls):
        for b, llm in llms.items():
          start = time.perf_counter()
          llm.generate(prompts, params, use_tqdm=False)
          times[b].append(time.perf_counter() - start)
      for b, llm in llms.items():
        if not args.profile:
          break
        wall, _, idle = profile(lambda: llm.generate(prompts, params, use_tqdm=False),
                                with_idle=True)
        print(f"--- {method} B={batch} {b}: profiled wall {wall * 1e3:.2f} ms", flush=True)
        print(idle_summary(idle, 8), flush=True)
        host_profile(llm, prompts, params)
      c, w = np.median(times["continuous"]), np.median(times["waves"])
      rows.append((method, batch, c * 1e3, w * 1e3, w / c, min(times["continuous"]) * 1e3,
                   min(times["waves"]) * 1e3))
  print(f"{'method':6s} {'B':>3s} {'default ms':>10s} {'waves ms':>9s} {'ratio':>6s} "
        f"{'min def':>8s} {'min waves':>9s} {'per-call cost ms':>16s}")
  for r in rows:
    print(f"{r[0]:6s} {r[1]:3d} {r[2]:10.2f} {r[3]:9.2f} {r[4]:6.3f} {r[5]:8.2f} {r[6]:9.2f} "
          f"{r[2] - r[3]:16.2f}")


if __name__ == "__main__":
  main()
