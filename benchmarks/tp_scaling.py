"""Decode speed on one GPU against tensor / data parallelism, default settings unless a variant
says otherwise: random weights in a preset's shapes, --batch prompts of --prompt-len random
tokens, --max-tokens new tokens each (greedy, ignore_eos), the median of --repeats calls after a
warm-up call.

    python benchmarks/tp_scaling.py --model qwen3-8b --mesh 1,1,1 1,2,1 --batch 1 8
    python benchmarks/tp_scaling.py --mesh 1,2,1 --variant xla       # products, XLA's all-reduce
    python benchmarks/tp_scaling.py --mesh 1,2,1 --variant kernel    # ..., the one-shot kernel
    python benchmarks/tp_scaling.py --mesh 1,2,1 --variant partitioner  # XLA places them all
    python benchmarks/tp_scaling.py --mesh 1,2,1 --variant unfused  # kernel, norms apart
    python benchmarks/tp_scaling.py --mesh 1,2,1 --variant norm-late  # workspace_norm.PREFETCH off
    python benchmarks/tp_scaling.py --mesh 1,2,1 --variant unsliced  # o / down: XLA's K sums
    python benchmarks/tp_scaling.py --mesh 1,2,1 --one-row kernel  # one-row products: kernel
    python benchmarks/tp_scaling.py --mesh 1,1,1 1,2,1 --qkv-k-slices 0  # q / k / v: one product

Variants (LLM(all_reduce_backend), jspec.sharding.tensor_parallel): `default` ("auto":
`kernel` on Hopper GPUs of one process), `partitioner` (XLA's partitioner places the tp layers'
products and all-reduces), `xla` (jspec's shard-by-shard products, XLA's all-reduce), `kernel`
(the same products, the workspace one-shot kernel, each all-reduce before a norm fused with it:
jspec.pallas_kernels.workspace_norm; also the MoE layers' tp sum and ep all-gather /
reduce-scatter: jspec.sharding.moe), `unfused` (`kernel` with the all-reduce and the norm
apart: TensorParallelProducts.defer_sums off), `unsliced` (o and down as one product each,
their K-slice sums XLA's kernels: TensorParallelProducts.k_slices 0). `--one-row` sets how
one-row products run (jspec.pallas_kernels.skinny_gemm.ONE_ROW; the library's default unless
given).

One JSON line per (mesh, batch): tokens/s (prefill included), TPOT, TTFT, and a digest of the
generated tokens (equal digests: equal tokens), then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json

import jax
import numpy as np
from flax import nnx

import jspec
from jspec.bench.presets import PRESETS
from jspec.models import fp8_tensor_parallel, layers, mlp, moe, row_kernels
from jspec.pallas_kernels import short_attention, swiglu_gemm, workspace_norm
from jspec.sharding.tensor_parallel import TensorParallelProducts

VARIANTS = {"default": {}, "partitioner": dict(all_reduce_backend="partitioner"),
            "xla": dict(all_reduce_backend="xla"), "kernel": dict(all_reduce_backend="kernel"),
            "unfused": dict(all_reduce_backend="kernel"),
            # the fused all-reduce + norm reading the residual and scale after the exchange
            "norm-late": {},
            # o / down as one product each, whose K-slice sum XLA adds (not the norm kernel)
            "unsliced": {}}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
  parser.add_argument("--mesh", nargs="+", default=["1,1,1", "1,2,1"], help="dp,tp,ep triples")
  parser.add_argument("--variant", default="default", choices=sorted(VARIANTS))
  parser.add_argument("--method", default="none", choices=["none", "mtp"])
  parser.add_argument("--one-row", choices=["kernel", "two_rows", "two_rows_all"],
                      help="skinny_gemm.ONE_ROW (default: the library's)")
  parser.add_argument("--k-slices", type=int,
                      help="TensorParallelProducts.k_slices: a deferred row product's K slices "
                           "(default: the library's; 0 as --variant unsliced)")
  parser.add_argument("--qkv-k-slices", type=int,
                      help="row_kernels.QKV_K_SLICES: the fused q / k / v product of decode "
                           "and verify steps as this many K slices' partials (default: the "
                           "library's, 4; 0: one product, XLA's split-K sum)")
  parser.add_argument("--no-router-plan", action="store_true",
                      help="moe.ROUTER_PLAN off: batch-1 MoE layers build their decode plan "
                           "in XLA instead of the router's top-k kernel")
  parser.add_argument("--no-norm-router", action="store_true",
                      help="moe.NORM_ROUTER off: a MoE layer's norm and router product as two "
                           "kernels instead of one")
  parser.add_argument("--no-doubled-row", action="store_true",
                      help="layers.DOUBLED_ROW off: a batch-1 tp step's row concatenated with "
                           "itself for o_proj's K-slice partials, instead of written twice by "
                           "the attention kernel")
  parser.add_argument("--no-fused-kv-write", action="store_true",
                      help="layers.FUSED_KV_WRITE off: a step's keys and values written by the "
                           "KV write kernel instead of the q / k / v kernel")
  parser.add_argument("--no-swiglu-kernel", action="store_true",
                      help="mlp.SWIGLU_KERNEL off: a step's gate / up product and SiLU x up as "
                           "XLA's GEMM and activation instead of one kernel (swiglu_gemm)")
  parser.add_argument("--swiglu-tiling", help="swiglu_gemm's 'block_k,block_n,stages,warps'")
  parser.add_argument("--no-attention-splits", action="store_true",
                      help="short_attention.SPLITS off: one attention program per (sequence, "
                           "KV head), its slots not split over programs and merged")
  parser.add_argument("--fp8", action="store_true",
                      help="the preset as an FP8 checkpoint (e4m3, 128 x 128 block scales)")
  parser.add_argument("--no-fp8-shards", action="store_true",
                      help="FP8 weights split over tp keep XLA's path (scaled, then XLA's dot) "
                           "instead of the FP8 kernels shard by shard")
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--tree", help="with --method mtp: a speculative_token_tree (vLLM's paths; "
                                     "k becomes its node count)")
  parser.add_argument("--draft-vocab-size", type=int, default=0,
                      help="with --method mtp: the head drafts from the first N token ids only "
                           "(speculative_config's draft_vocab)")
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--prompt-len", type=int, default=512)
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--max-model-len", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  config = PRESETS[args.model]
  workspace_norm.PREFETCH = args.variant != "norm-late" and workspace_norm.PREFETCH
  if args.variant == "unsliced":
    TensorParallelProducts.k_slices = 0
  if args.k_slices is not None:
    TensorParallelProducts.k_slices = args.k_slices
  if args.qkv_k_slices is not None:
    row_kernels.QKV_K_SLICES = args.qkv_k_slices
  if args.no_router_plan:
    moe.ROUTER_PLAN = False
  if args.no_norm_router:
    moe.NORM_ROUTER = False
  if args.no_doubled_row:
    layers.DOUBLED_ROW = False
  if args.no_attention_splits:
    short_attention.SPLITS = False
  if args.no_fused_kv_write:
    layers.FUSED_KV_WRITE = False
  if args.no_swiglu_kernel:
    mlp.SWIGLU_KERNEL = False
  if args.swiglu_tiling:
    (swiglu_gemm.BLOCK_K, swiglu_gemm.BLOCK_N, swiglu_gemm.NUM_STAGES,
     swiglu_gemm.NUM_WARPS) = (int(v) for v in args.swiglu_tiling.split(","))
  if args.no_fp8_shards:
    fp8_tensor_parallel.ON_HOPPER = False
  if args.layers:
    config = dataclasses.replace(config, num_layers=args.layers)
  if args.fp8:
    config = dataclasses.replace(config, fp8_block=(128, 128))
  # The MTP layer of the model's own family: DeepSeek-V3's layout for MLA models.
  layout = "deepseek_v3" if config.mla else "qwen3_next"
  spec = jspec.MTPSpec(layout, 1, is_moe=config.is_moe) if args.method == "mtp" else None
  speculative = ({"method": "mtp", "num_speculative_tokens": args.k}
                 if args.method == "mtp" else None)
  if args.tree:
    speculative.update(num_speculative_tokens=args.tree.count("("),
                       speculative_token_tree=args.tree)
  if args.draft_vocab_size:
    speculative["draft_vocab"] = list(range(args.draft_vocab_size))
  params = jspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
  device = jax.devices()[0].device_kind
  if args.one_row:
    from jspec.pallas_kernels import skinny_gemm
    skinny_gemm.ONE_ROW = args.one_row
  rows = []
  for mesh_text in args.mesh:
    dp, tp, ep = (int(x) for x in mesh_text.split(","))
    llm = jspec.LLM.from_random(config, spec, mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep),
                                max_model_len=args.max_model_len, max_num_seqs=max(args.batch),
                                speculative_config=speculative, **VARIANTS[args.variant])
    if args.variant == "unfused":
      for _, node in nnx.iter_graph([m for m in (llm.target, llm.mtp) if m is not None]):
        if getattr(node, "tp_products", None) is not None:
          node.tp_products.defer_sums = False
    for batch in args.batch:
      rng = np.random.default_rng(batch)
      prompts = [rng.integers(0, config.vocab_size, args.prompt_len).tolist()
                 for _ in range(batch)]
      first = llm.generate(prompts, params, use_tqdm=False)
      runs = sorted((llm.generate(prompts, params, use_tqdm=False).metrics
                     for _ in range(args.repeats)), key=lambda m: m.wall_time_s)
      mid = runs[len(runs) // 2]
      tokens = [o.outputs[0].token_ids for o in first]
      digest = hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:10]
      row = dict(model=args.model, layers=config.num_layers, device=device, mesh=mesh_text,
                 variant=args.variant, k_slices=TensorParallelProducts.k_slices,
                 qkv_k_slices=row_kernels.QKV_K_SLICES, router_plan=moe.ROUTER_PLAN,
                 norm_router=moe.NORM_ROUTER, doubled_row=layers.DOUBLED_ROW,
                 attention_splits=short_attention.SPLITS, fused_kv_write=layers.FUSED_KV_WRITE,
                 swiglu_kernel=mlp.SWIGLU_KERNEL, swiglu_tiling=args.swiglu_tiling or "auto",
                 fp8=args.fp8, fp8_shards=args.fp8 and fp8_tensor_parallel.ON_HOPPER,
                 method=args.method + ("-tree" if args.tree else ""), batch=batch,
                 tokens_per_second=round(mid.tokens_per_second, 1),
                 tpot_ms=round(1e3 * mid.tpot_s, 3), ttft_ms=round(1e3 * mid.ttft_s, 2),
                 mean_acceptance_length=mid.mean_acceptance_length, tokens_digest=digest)
      rows.append(row)
      print(json.dumps(row), flush=True)
  print("\n| device | model | mesh | variant | method | batch | tok/s | TPOT ms | TTFT ms "
        "| tokens |")
  print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
  for r in rows:
    print(f"| {r['device']} | {r['model']} | {r['mesh']} | {r['variant']} | {r['method']} | "
          f"{r['batch']} | {r['tokens_per_second']} | {r['tpot_ms']} | {r['ttft_ms']} | "
          f"{r['tokens_digest']} |")


if __name__ == "__main__":
  main()
