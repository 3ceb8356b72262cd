"""`jspec bench`: the step-cost table against the roofline, as JSON, PNG plots and a table.

For each model preset, batch and context:
  decode      one-token step time and (least bytes / read bandwidth) / time = % of roofline
              (MoE: the experts the step routed, counted; the uniform-routing figure beside it)
  verify      k+1 = 2, 4, 6 token steps relative to the one-token step
  draft       MTP cost per drafted token (k-1 single steps + the k+1 extend, over k) relative
              to a target step
  derived     the speculative speedup these costs imply at a given mean acceptance length A:
              A x t_decode / (t_verify(k+1) + t_draft_steps)   -- labelled derived
plus prefill tokens/s and compile time per program, and for MLA models the attention over the
latent cache alone against the latent bytes it must read (the fraction of the read bandwidth).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax

import jspec
from jspec.bench.presets import MTP_LAYOUTS, PRESETS
from jspec.bench.roofline import (cache_values_per_token, distinct_experts, hbm_bandwidth,
                                  mla_attention_bytes, step_bytes)
from jspec.bench.steps import StepTimer
from jspec.progress import stage
from jspec.memory_plan import device_capacity

VERIFY_WIDTHS = (2, 4, 6)


def _fits(cfg, batch, context, weight_bytes, capacity):
  kv = 2 * batch * (context + 8) * cfg.num_layers * cache_values_per_token(cfg)
  return capacity is None or weight_bytes + 2.5 * kv < 0.85 * capacity


def bench_model(name: str, args, save_partial=lambda done: None) -> dict:
  """One preset's rows; `save_partial({rows, warm-up})` runs after each row, so a run stopped
  midway keeps what it measured."""
  cfg = PRESETS[name]
  if getattr(args, "fp8", False):
    cfg = dataclasses.replace(cfg, fp8_block=(128, 128))
  if args.layers:
    cfg = dataclasses.replace(cfg, num_layers=args.layers,
                              layer_types=cfg.layer_types[:args.layers])
  k = args.k
  max_context = max(args.context) + max(VERIFY_WIDTHS) + k + 2
  cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings,
                                                              max_context))
  # The LLM itself serves only the batch-1 warm-up generate; the step timer allocates each
  # batch's caches (checked against the device by `_fits`), so its memory plan is for 1 row.
  start = time.perf_counter()
  llm = jspec.LLM.from_random(
      cfg, jspec.MTPSpec(MTP_LAYOUTS.get(name, "qwen3_next"), 1, is_moe=cfg.is_moe),
      dtype=args.dtype,
      max_model_len=max_context, max_num_seqs=1, moe_backend=args.moe_backend,
      attention_backend=args.attention_backend,
      norm_backend=getattr(args, "norm_backend", "auto"),
      recurrent_commit=getattr(args, "recurrent_commit", "store"),
      speculative_config={"method": "mtp", "num_speculative_tokens": k,
                          # Timing only: on random weights which ids are kept does not matter.
                          "draft_vocab": (tuple(range(args.draft_vocab_size))
                                          if args.draft_vocab_size else None)})
  weights_s = time.perf_counter() - start
  # Warm-up first: the figure a user waits for, kept even if a long run is stopped later.
  start = time.perf_counter()
  llm.generate([[1] * min(128, max_context // 2)],
               jspec.SamplingParams(temperature=0.0, max_tokens=4))
  warmup_s = time.perf_counter() - start
  print(f"{name:16s} warm-up (compile + first generate): {warmup_s:.1f} s, after "
        f"{weights_s:.1f} s building the weights", flush=True)
  with stage("measuring HBM bandwidth"):
    bandwidth = hbm_bandwidth(args.bandwidth_bytes)
  timer = StepTimer(llm)
  capacity = device_capacity()
  weight_bytes = llm.memory_plan.weight_bytes
  rows = []
  for batch in args.batch:
    for context in args.context:
      if not _fits(cfg, batch, context, weight_bytes, capacity):
        rows.append(dict(batch=batch, context=context, skipped="KV cache does not fit"))
        continue
      with stage(f"{name}: batch {batch}, context {context}"):
        seconds = timer.measure(batch, context, {1, k + 1, *VERIFY_WIDTHS}, {1, k + 1})
        width_s = {w: s for (kind, w), s in seconds.items() if kind == "target"}
        draft_s, extend_s = seconds[("mtp", 1)], seconds[("mtp", k + 1)]
      decode_s = width_s[1]
      verify = {w: width_s[w] / decode_s for w in VERIFY_WIDTHS}
      # MoE bytes from the experts the step routed (random routers are far from uniform);
      # the uniform-routing floor is kept beside it.
      routed = ([distinct_experts(ids) for ids in timer.routed_experts(batch, context)]
                if cfg.is_moe else None)
      floor_s = step_bytes(cfg, batch, 1, context, experts_used=routed) / bandwidth["read"]
      uniform_floor_s = step_bytes(cfg, batch, 1, context) / bandwidth["read"]
      spec_step_s = width_s[k + 1] + (k - 1) * draft_s + extend_s
      rows.append(dict(
          batch=batch, context=context, decode_ms=1e3 * decode_s,
          roofline_fraction=floor_s / decode_s,
          roofline_fraction_uniform=uniform_floor_s / decode_s, experts_routed=routed,
          decode_tokens_per_second=batch / decode_s,
          verify_relative={str(w): r for w, r in verify.items()},
          draft_per_token_relative=(extend_s + (k - 1) * draft_s) / k / decode_s,
          spec_step_relative=spec_step_s / decode_s,
          derived_speedup={str(a): a * decode_s / spec_step_s for a in args.acceptance}))
      print(row_line(name, rows[-1]), flush=True)
      save_partial(dict(rows=rows, warmup_seconds_generate=warmup_s))
  attention = mla_attention_rows(name, cfg, timer, args, bandwidth["read"], weight_bytes,
                                 capacity) if cfg.is_mla else []
  prefill = []
  for batch, prompt in ((1, 512), (1, 8192), (8, 512)):
    # The whole-prompt forward materialises float32 scores [B, heads, P, P]; they must fit
    # beside the weights (DeepSeek-V3's 128 heads at 8k: 32 GiB), or the row is skipped.
    scores_bytes = batch * prompt * prompt * cfg.num_heads * 4
    if prompt > max_context or (capacity and scores_bytes > 0.3 * (capacity - weight_bytes)):
      continue
    seconds = timer.prefill(batch, prompt)
    prefill.append(dict(batch=batch, prompt=prompt, tokens_per_second=batch * prompt / seconds))
  draft_ids = llm.mtp.layers[0].draft_ids  # what the timed head really drafts from
  return dict(model=name, fp8=cfg.fp8_block is not None, layers=cfg.num_layers, k=k,
              recurrent_commit=llm.recurrent_commit if cfg.layer_types else None,
              draft_vocab_size=cfg.vocab_size if draft_ids is None else draft_ids.shape[0],
              device=jax.devices()[0].device_kind,
              bandwidth=bandwidth, rows=rows, prefill=prefill, mla_attention=attention,
              warmup_seconds_generate=warmup_s, weights_seconds=weights_s,
              compile_seconds=timer.compile_seconds)


def mla_attention_rows(name, cfg, timer, args, read_bandwidth, weight_bytes, capacity):
  """MLA decode attention (one token, then a k+1 verify window) over the latent at each batch
  and context: time, the latent bytes it must read, and what fraction of the measured read
  bandwidth that is."""
  rows = []
  itemsize = jax.numpy.dtype(args.dtype).itemsize
  for batch in args.batch:
    for context in args.context:
      if not _fits(cfg, batch, context, weight_bytes, capacity):
        continue
      for width in (1, args.k + 1):
        with stage(f"{name}: MLA attention, batch {batch}, context {context}, width {width}"):
          seconds = timer.mla_attention(batch, context, width)
        latent = mla_attention_bytes(cfg, batch, context + width - 1, itemsize)
        rows.append(dict(batch=batch, context=context, width=width, ms=1e3 * seconds,
                         latent_bytes=latent, bandwidth_fraction=latent / seconds / read_bandwidth))
        print(mla_line(name, rows[-1]), flush=True)
  return rows


def mla_line(model: str, r: dict) -> str:
  return (f"{model:16s} MLA attention B={r['batch']} ctx={r['context']} T={r['width']}: "
          f"{r['ms']:.3f} ms, latent {r['latent_bytes'] / 2**20:.1f} MiB read at "
          f"{100 * r['bandwidth_fraction']:.1f}% of the read bandwidth")


def proof_model_speedups(ks=(1, 2, 3, 4), max_tokens: int = 512, pieces_k: int = 3) -> dict:
  """Real acceptance: the trained demo model at batch 1, with and without MTP; plus its step
  pieces timed in isolation (decode, verify of k+1, a draft step, the extend), which say how
  much of a speculative step is the target, how much the head, and how much the loop."""
  from jspec.train.evaluation import batch1_speed
  prompt = "Psa23:1 The LORD is my shepherd; I shall not want.\n"
  speed = batch1_speed(jspec.demo_model_path(), prompt, (0,) + tuple(ks), max_tokens=max_tokens,
                       repeats=5, log=lambda *_: None)
  base = speed[0]["tokens_per_second"]
  result = {str(k): dict(tokens_per_second=v["tokens_per_second"],
                         speedup=v["tokens_per_second"] / base,
                         mean_acceptance_length=v["mean_acceptance_length"])
            for k, v in speed.items()}
  llm = jspec.LLM(model=jspec.demo_model_path(), dtype="bfloat16", max_model_len=1024,
                  speculative_config={"method": "mtp", "num_speculative_tokens": pieces_k})
  seconds = StepTimer(llm).measure(1, 64, {1, pieces_k + 1}, {1, pieces_k + 1})
  pieces = {f"{kind}_{w}_us": 1e6 * s for (kind, w), s in seconds.items()}
  pieces["loop_step_us"] = 1e6 / base  # the whole k = 0 loop step, measured end to end
  return {"speed": result, "pieces": pieces, "pieces_k": pieces_k}


def row_line(model: str, r: dict) -> str:
  if "skipped" in r:
    return f"{model:16s} {r['batch']:4d} {r['context']:6d}  {r['skipped']}"
  derived = " ".join(f"A={a}:{s:.2f}x" for a, s in r["derived_speedup"].items())
  return (f"{model:16s} {r['batch']:4d} {r['context']:6d} "
          f"{r['decode_ms']:9.3f} {100 * r['roofline_fraction']:5.1f}% "
          + " ".join(f"{r['verify_relative'][str(w)]:5.2f}" for w in VERIFY_WIDTHS)
          + f" {r['draft_per_token_relative']:9.2f} {r['spec_step_relative']:9.2f}  " + derived)


def table(results: list[dict], proof: dict | None) -> str:
  lines = [f"{'model':16s} {'B':>4s} {'ctx':>6s} {'decode ms':>9s} {'%roof':>6s} "
           + " ".join(f"{'v' + str(w):>5s}" for w in VERIFY_WIDTHS)
           + f" {'draft/tok':>9s} {'spec step':>9s}  derived speedup"]
  for result in results:
    lines.extend(row_line(result["model"], r) for r in result["rows"])
    lines.extend(mla_line(result["model"], r) for r in result.get("mla_attention", ()))
    for p in result["prefill"]:
      lines.append(f"{result['model']:16s} prefill B={p['batch']} P={p['prompt']}: "
                   f"{p['tokens_per_second']:.0f} tokens/s")
    lines.append(f"{result['model']:16s} warm-up (compile + first generate): "
                 f"{result['warmup_seconds_generate']:.1f} s; read bandwidth "
                 f"{result['bandwidth']['read'] / 1e12:.2f} TB/s, copy "
                 f"{result['bandwidth']['copy'] / 1e12:.2f} TB/s")
  if proof:
    lines.append("demo model, batch 1 (real acceptance): " + ", ".join(
        f"k={k}: {v['tokens_per_second']:.0f} tok/s ({v['speedup']:.2f}x, "
        f"A={v['mean_acceptance_length']:.2f}, {v['speedup'] / v['mean_acceptance_length']:.2f} A)"
        for k, v in proof["speed"].items()))
    lines.append(f"demo model pieces (k={proof['pieces_k']}, us): " + ", ".join(
        f"{name[:-3]} {us:.0f}" for name, us in proof["pieces"].items()))
  return "\n".join(lines)


def plot(results: list[dict], out_dir: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for result in results:
    for context in sorted({r["context"] for r in result["rows"] if "skipped" not in r}):
      rows = [r for r in result["rows"] if "skipped" not in r and r["context"] == context]
      batches = [r["batch"] for r in rows]
      label = f"{result['model']} ctx {context}"
      axes[0].plot(batches, [r["decode_tokens_per_second"] for r in rows], "o-", label=label)
      axes[1].plot(batches, [100 * r["roofline_fraction"] for r in rows], "o-", label=label)
  for ax, title in zip(axes, ("decode tokens/s", "% of HBM roofline")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_title(title)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "bench.png"), dpi=120)


def run_bench(args):
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "bench.json")

  def save(results, proof=None, partial=None):
    with open(path, "w") as f:
      json.dump({"results": results, "proof_model": proof, "partial": partial}, f, indent=1)

  results = []
  for name in args.models:
    results.append(bench_model(name, args, lambda done, name=name: save(
        results, partial={"model": name, **done})))
    save(results)
  proof = proof_model_speedups() if args.proof else None
  save(results, proof)
  plot(results, args.out)
  print(table(results, proof))
