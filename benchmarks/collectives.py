"""The collectives of each step program, per mesh, at a preset's widths, counted in the
optimized HLO on the CPU's simulated devices (no GPU needed):

    python benchmarks/collectives.py --model qwen3-8b --mesh 1,2,1 1,1,2 2,1,1 --batch 1 8
    python benchmarks/collectives.py --model deepseek-v3 --mesh 1,8,1 2,1,4

Compiles the model at 1 and 2 of each layer kind its preset has (dense layers; MoE layers after
the preset's first dense ones), and reports per step program (decode, verify of k+1, MTP draft,
prefill chunk) the collectives a layer adds and those of the step itself, with their bytes per
device. The widths that size a collective (hidden size, batch; GQA's heads, whose KV copies
depend on tp) are the preset's; those that do not (vocabulary, MLP and expert intermediate
sizes, the number of routed experts: a token's routing and its sums are exchanged, never an
expert's weights; MLA's heads) are cut so that the weights fit a CPU's memory and compile in
minutes. Meshes are dp,tp,ep triples.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jspec  # noqa: E402  (after XLA_FLAGS)
from jspec.bench.collectives import collectives, step_programs  # noqa: E402
from jspec.bench.presets import PRESETS  # noqa: E402


def small_widths(config, layers: int, moe_layers: int):
  """`config` with `layers` dense and `moe_layers` MoE layers, its vocabulary and intermediate
  sizes cut (they size no collective)."""
  cut = dict(vocab_size=4096, num_layers=layers + moe_layers,
             intermediate_size=min(config.intermediate_size, 1024) or 0)
  if config.is_mla:
    # MLA's per-head weights (q_b, kv_b and o: DeepSeek-V3's 128 heads at 7168 wide) are most
    # of a layer, and at dp x ep each of the 8 simulated devices of this one process holds a
    # copy. The heads size no collective (tp all-reduces the [tokens, hidden] output), so 16
    # of them, which any tp up to 16 divides, give the same table.
    cut.update(num_heads=16, num_kv_heads=16)
  moe = config.moe
  if moe is not None:
    cut["moe"] = dict(intermediate_size=min(moe.intermediate_size, 256),
                      first_k_dense_replace=layers)
    if moe.num_experts > 16 and 16 % max(moe.n_group, 1) == 0:
      cut["moe"]["num_experts"] = 16  # every group keeps experts enough for the top-k
    if moe.shared_expert_intermediate_size:
      cut["moe"]["shared_expert_intermediate_size"] = min(moe.shared_expert_intermediate_size,
                                                          256)
    if not moe.first_k_dense_replace and layers:
      cut["num_layers"] = moe_layers  # a model without dense layers: MoE layers only
  return config.replace(**cut)


def describe(found) -> str:
  tally = collections.Counter((c.kind, c.shape) for c in found)
  return "; ".join(f"{n} x {kind} {shape}" for (kind, shape), n in sorted(tally.items()))


def difference(more, fewer):
  left = collections.Counter(more)
  left.subtract(collections.Counter(fewer))
  return [c for c, n in left.items() for _ in range(max(n, 0))]


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
  parser.add_argument("--mesh", nargs="+", default=["1,2,1", "1,1,2", "2,1,1"])
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--all-reduce-backend", default="auto", choices=["auto", "xla"])
  args = parser.parse_args()
  config = PRESETS[args.model]
  dense = 0 if config.is_moe and not config.moe.first_k_dense_replace else 1
  moe = 1 if config.is_moe else 0
  print(f"| model | mesh | batch | program | per dense layer | per MoE layer | per step |")
  print("| --- | --- | ---: | --- | --- | --- | --- |")
  for mesh_text in args.mesh:
    dp, tp, ep = (int(x) for x in mesh_text.split(","))
    mesh = jspec.MeshConfig(dp=dp, tp=tp, ep=ep)
    for asked in args.batch:
      # Sequences are split over dp x ep: a batch is a multiple of it.
      batch = -(-asked // mesh.batch_width) * mesh.batch_width
      # At 1 and 2 layers of each kind: one more layer of a kind adds that kind's collectives.
      shapes = {"base": (dense, moe), "dense": (2 * dense, moe), "moe": (dense, 2 * moe)}
      found = {}
      for label, (d, m) in shapes.items():
        if label != "base" and (d, m) == shapes["base"]:
          continue
        llm = jspec.LLM.from_random(small_widths(config, d, m),
                                    jspec.MTPSpec("qwen3_next", 1, is_moe=config.is_moe),
                                    mesh=mesh, max_model_len=256, max_num_seqs=max(8, batch),
                                    speculative_config={"method": "mtp",
                                                        "num_speculative_tokens": args.k},
                                    all_reduce_backend=args.all_reduce_backend)
        found[label] = {kind: collectives(text)
                        for kind, text in step_programs(llm, batch, args.k).items()}
        # Freed before the next one is built: at dp x ep, DeepSeek-V3's attention weights are
        # replicated on all 8 simulated devices of this one process (about 12 GB), and two
        # LLMs at once ran a 23 GB machine out of memory.
        del llm
        gc.collect()
      for kind, base in found["base"].items():
        per_dense = difference(found["dense"][kind], base) if "dense" in found else []
        per_moe = difference(found["moe"][kind], base) if "moe" in found else []
        if kind == "draft":  # the MTP head runs one layer whatever the target's depth
          per_dense, per_moe = [], []
        fixed = difference(base, per_dense * dense + per_moe * moe)
        print(f"| {args.model} | {mesh_text} | {batch} | {kind} | {describe(per_dense) or '-'} | "
              f"{describe(per_moe) or '-'} | {describe(fixed) or '-'} |", flush=True)


if __name__ == "__main__":
  main()
