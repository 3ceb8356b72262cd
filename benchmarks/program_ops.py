"""The operations each step program hands to XLA, per layer, bf16 against FP8, with the GPU's
kernel choices, traced on the CPU (no GPU needed):

    python benchmarks/program_ops.py --model qwen3-30b-a3b
    python benchmarks/program_ops.py --model qwen3-8b --kinds prefill --chunk 512

Why: the FP8 warm-up's extra time is XLA's fusion passes over the prefill program
(BENCHMARKS.md, "Mosaic GPU modules emptied at their call sites: …"), which grow with the
operations around the kernels. Each program is traced (jspec.bench.collectives.step_programs)
at 1 and 2 layers of the preset's kind, its equations counted outside kernel bodies
(jspec.bench.program_ops.equation_counts): a layer's operations are the difference. The
vocabulary is cut to 4096 and a MoE preset's routed experts to 16 (neither changes a layer's
operations), the other widths are the preset's. "The GPU's choices": Pallas norm and expert
backends, and the kernels a Hopper GPU takes (interpreted here).
"""

from __future__ import annotations

import argparse
import collections
import gc
import os

os.environ.setdefault("JSPEC_PROGRESS", "0")

import jspec  # noqa: E402
from jspec.bench.collectives import step_programs  # noqa: E402
from jspec.bench.presets import PRESETS  # noqa: E402
from jspec.bench.program_ops import KERNEL_PRIMITIVES, equation_counts  # noqa: E402
from jspec.pallas_kernels import platform  # noqa: E402


def cut(config, layers: int, fp8: bool):
  """`config` at `layers` layers (after its dense ones, where a MoE preset has them), vocabulary
  4096, at most 16 routed experts, FP8 blocks of 128 x 128 where `fp8`."""
  changes = dict(vocab_size=4096, fp8_block=(128, 128) if fp8 else None)
  moe = config.moe
  dense = moe.first_k_dense_replace if moe is not None else 0
  changes["num_layers"] = dense + layers
  if moe is not None and moe.num_experts > 16 and 16 % max(moe.n_group, 1) == 0:
    changes["moe"] = dict(num_experts=16)
  return config.replace(**changes)


def counts(config, kinds, batch: int, chunk: int) -> dict:
  llm = jspec.LLM.from_random(config, None, max_model_len=chunk + 128, max_num_seqs=batch,
                              norm_backend="pallas", moe_backend="pallas")
  found = {kind: equation_counts(traced.jaxpr)
           for kind, traced in step_programs(llm, batch, kinds=kinds, chunk=chunk,
                                             traced=True).items()}
  del llm
  gc.collect()
  return found


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(PRESETS))
  parser.add_argument("--kinds", nargs="+", default=["prefill", "decode"],
                      choices=["prefill", "decode", "verify"])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
  parser.add_argument("--top", type=int, default=12)
  args = parser.parse_args()
  platform.on_hopper = lambda: True  # the GPU's kernel choices, interpreted on the CPU
  base = PRESETS[args.model]
  layer, rest = {}, {}
  for precision in ("bf16", "fp8"):
    try:
      one, two = (counts(cut(base, n, precision == "fp8"), args.kinds, args.batch, args.chunk)
                  for n in (1, 2))
    except ValueError as err:  # e.g. widths that FP8 blocks or its kernels do not take
      parser.error(f"{args.model} in {precision}: {err}")
    for kind in args.kinds:
      layer[precision, kind] = two[kind] - one[kind]
      rest[precision, kind] = one[kind] - layer[precision, kind]
  print(f"\n{args.model}, batch {args.batch}, prefill chunk {args.chunk}: equations XLA gets "
        f"outside kernel bodies (a kernel call counts 1)")
  print(f"{'program':8s} {'precision':9s} {'a layer':>8s} {'the rest':>9s} {'kernel calls':>13s}")
  for kind in args.kinds:
    for precision in ("bf16", "fp8"):
      per_layer = layer[precision, kind]
      calls = sum(per_layer[name] for name in KERNEL_PRIMITIVES)
      print(f"{kind:8s} {precision:9s} {sum(per_layer.values()):8d} "
            f"{sum(rest[precision, kind].values()):9d} {calls:13d}")
  for kind in args.kinds:
    extra = collections.Counter(layer["fp8", kind])
    extra.subtract(layer["bf16", kind])
    shown = [f"{name} {count:+d}" for name, count in extra.most_common() if count][:args.top]
    print(f"{kind}: FP8 - bf16 a layer, by primitive: {', '.join(shown)}")


if __name__ == "__main__":
  main()
