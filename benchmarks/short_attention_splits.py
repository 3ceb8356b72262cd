"""The short-context attention kernel alone, its slots split over programs or not: kernel time
per layer from the profiler (jspec.pallas_kernels.short_attention, with mla_merge's merge).

Qwen3-8B's heads (4 query heads per KV head of 128, bf16), `--layers` different caches in one
program (as a step's layers: no cache read twice), every sequence seeing `seen` slots of a
`slots`-slot cache. Settings: "1" (one program per (sequence, KV head)), "auto" (the
library's choice for this GPU), "splits,block_slots", or "splits,block_slots,stages,warps"
(Triton's pipeline depth and warps; 3 and 4 otherwise).

    python benchmarks/short_attention_splits.py --pairs 1x8 1x4 8x8 8x4 --context 576/640
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profile import call_kernel_events
from jspec.pallas_kernels import platform
from jspec.pallas_kernels import short_attention as short_lib

GROUP, HEAD_DIM = 4, 128


def parse_setting(text: str):
  """"1" / "auto" / "splits,block_slots[,stages,warps]" -> short_attention's (splits,
  block_slots, num_stages, num_warps); None: the library's choice."""
  if text == "auto":
    return None, None, None, None
  if text == "1":
    return 1, None, None, None
  values = [int(v) for v in text.split(",")]
  if len(values) not in (2, 4):
    raise ValueError(f"a setting is 1, auto, splits,block or splits,block,stages,warps: {text}")
  return tuple(values) + (None, None) * (len(values) == 2)


def caches(batch: int, kv_heads: int, slots: int, layers: int, rng):
  shape = (batch, kv_heads, slots, HEAD_DIM)
  return [tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
          for _ in range(layers)]


def program(splits, block_slots, stages=None, warps=None):
  def run(q, kvs, start):
    return [short_lib.short_attention(q, k, v, start, group=GROUP, scale=HEAD_DIM ** -0.5,
                                      splits=splits, block_slots=block_slots,
                                      num_stages=stages, num_warps=warps)
            for k, v in kvs]
  return jax.jit(run)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--pairs", nargs="+", default=["1x8", "1x4", "8x8", "8x4"],
                      help="batch x KV heads (a shard's)")
  parser.add_argument("--context", nargs="+", default=["576/640", "144/256", "1000/1024"],
                      help="slots seen / cache slots")
  parser.add_argument("--settings", nargs="+",
                      default=["1", "auto", "5,128", "8,64", "10,64", "16,64"])
  parser.add_argument("--layers", type=int, default=24)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  print(f"# {jax.devices()[0].device_kind}, {platform.num_sms()} SMs; us per layer: attention "
        f"kernel + merge (the span of the {args.layers} layers' kernels / layers)")
  rows = []
  for context in args.context:
    seen, slots = (int(v) for v in context.split("/"))
    for pair in args.pairs:
      batch, kv_heads = (int(v) for v in pair.split("x"))
      kvs = caches(batch, kv_heads, slots, args.layers, rng)
      q = jnp.asarray(rng.standard_normal((batch, kv_heads * GROUP, HEAD_DIM)), jnp.bfloat16)
      start = jnp.full((batch,), seen - 1, jnp.int32)
      want = None
      for setting in args.settings:
        splits, block, stages, warps = parse_setting(setting)
        chosen, auto_block = (short_lib.choose_splits(batch, kv_heads, slots, platform.num_sms())
                              if splits is None else (splits, None))
        block_slots = block or auto_block or short_lib.choose_block_slots(slots, HEAD_DIM, 2)
        if slots % block_slots or chosen > slots // block_slots:
          continue
        fn = program(splits, block, stages, warps)
        out = np.asarray(fn(q, kvs, start)[0], np.float32)
        want = out if want is None else want
        error = float(np.abs(out - want).max())
        events = call_kernel_events(fn, q, kvs, start)
        times = collections.defaultdict(float)
        for begin, end, name in events:
          times["merge" if "merge" in name else "attention"] += (end - begin) / 1e3
        span = (events[-1][1] - events[0][0]) / 1e3 / args.layers
        row = (context, pair, setting, chosen, block_slots,
               times["attention"] / args.layers, times["merge"] / args.layers, span, error)
        rows.append(row)
        print(row, flush=True)
  print("\n| seen / slots | batch x KV heads | setting | splits | block | attention us "
        "| merge us | span us a layer | max diff to the first |")
  print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
  for context, pair, setting, chosen, block, attn, merge, span, error in rows:
    print(f"| {context} | {pair} | {setting} | {chosen} | {block} | {attn:.2f} | {merge:.2f} "
          f"| {span:.2f} | {error:.1e} |")


if __name__ == "__main__":
  main()
