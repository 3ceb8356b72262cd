"""Module-level settings of jspec compared in ONE process on the same weights: the bench's
decode step (`jspec.bench.steps.StepTimer`, the slope timer) recompiled under each setting in
turn, for several rounds, against the defaults timed between them.

Why one process: `jspec bench` runs of the same code in separate processes spread by up to 5%
on one H200 (2.629-2.770 ms for Qwen3-30B-A3B at batch 1, BENCHMARKS.md, "The step timer's
slope ..."). One compiled program on one set of buffers repeats within 0.1%, but each round
here compiles again and draws new caches, and the same program then spread by up to 3.8% in
one process (the first runs of this script): judge a setting over rounds against that spread,
and confirm a winner in other processes. Only settings read when a program is traced take
effect: the model is built once, before any setting changes, so a value read while building
it (a layer's choice of path, a cached sharded function) stays at its default. Each variant's
program text digest is printed for reference; it differs between compiles of the same program
(kernel names), so two digests differing proves nothing.

    python3 benchmarks/settings_in_one_process.py --model qwen3-30b-a3b --rounds 2 \\
        jspec.pallas_kernels.short_attention.SPLIT_BLOCK_SLOTS=128 \\
        jspec.pallas_kernels.router_topk.SLICE_ROWS=256

Each setting is module.NAME=value (several joined by commas), as benchmarks/with_setting.py
takes them; the defaults are restored after each.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics

import jax

import jspec
from jspec.bench import steps
from jspec.bench.presets import PRESETS
from with_setting import parse  # this folder's module: run as benchmarks/<script>.py


def timed(llm, settings, batch: int, context: int) -> tuple[float, str]:
  """(seconds a decode step, a digest of the compiled program's text) under `settings`."""
  saved = [(module, name, getattr(module, name)) for module, name, _ in settings]
  try:
    for module, name, value in settings:
      setattr(module, name, value)
    jax.clear_caches()  # kernels' jitted wrappers read the settings when traced
    timer = steps.StepTimer(llm)
    seconds = timer.measure(batch, context, {1})[("target", 1)]
    text = timer.programs[("target", 1)].as_text()
    return seconds, hashlib.sha256(text.encode()).hexdigest()[:12]
  finally:
    for module, name, value in saved:
      setattr(module, name, value)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("settings", nargs="+", help="module.NAME=value[,...] per variant")
  parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--context", type=int, default=512)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--fp8", action="store_true", help="128 x 128 block-scaled FP8 weights")
  args = parser.parse_args()
  variants = {"defaults": []} | {text: parse(text) for text in args.settings}
  config = PRESETS[args.model]
  if args.layers:
    config = dataclasses.replace(config, num_layers=args.layers,
                                 layer_types=config.layer_types[:args.layers])
  if args.fp8:
    config = dataclasses.replace(config, fp8_block=(128, 128))
  max_len = args.context + 16
  config = dataclasses.replace(config, max_position_embeddings=max(
      config.max_position_embeddings, max_len))
  llm = jspec.LLM.from_random(config, None, max_model_len=max_len, max_num_seqs=args.batch)
  times = {name: [] for name in variants}
  digests = {}
  for r in range(args.rounds):
    for name, settings in variants.items():  # the defaults first in every round
      seconds, digest = timed(llm, settings, args.batch, args.context)
      times[name].append(seconds)
      digests.setdefault(name, digest)
      print(f"round {r}: {name or 'defaults'}: {1e3 * seconds:.4f} ms a step", flush=True)
  base = statistics.mean(times["defaults"])
  print(f"\n{args.model} ({config.num_layers} layers{', FP8' if args.fp8 else ''}), batch "
        f"{args.batch}, context {args.context}, {jax.devices()[0].device_kind}")
  print("| setting | ms a step, by round | mean | / defaults | program text digest |")
  print("| --- | --- | ---: | ---: | --- |")
  for name, values in times.items():
    mean = statistics.mean(values)
    print(f"| {name} | {' / '.join(f'{1e3 * v:.4f}' for v in values)} | {1e3 * mean:.4f} | "
          f"{mean / base:.4f}x | {digests[name]} |")


if __name__ == "__main__":
  main()
