"""Same process: the bench's step timer (default batches) against longer batches, the slope of
calls, and one call's host dispatch; then STEPS_PER_CALL=32. Qwen3-30B-A3B bf16, B=1, ctx 512."""
import dataclasses, statistics, sys, time
import jax
import jspec
from jspec.bench import steps as steps_mod
from jspec.bench.presets import MTP_LAYOUTS, PRESETS
from jspec.bench.roofline import distinct_experts, hbm_bandwidth, seconds_per_call, step_bytes

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 0
cfg = PRESETS[name]
if layers:
  cfg = dataclasses.replace(cfg, num_layers=layers, layer_types=cfg.layer_types[:layers])
ctx = 512
cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, ctx + 16))
llm = jspec.LLM.from_random(cfg, jspec.MTPSpec(MTP_LAYOUTS.get(name, "qwen3_next"), 1, is_moe=cfg.is_moe),
                            dtype="bfloat16", max_model_len=ctx + 16, max_num_seqs=1,
                            speculative_config={"method": "mtp", "num_speculative_tokens": 3})
bw = hbm_bandwidth()
rows = []
def report(label, s):
  rows.append((label, s))
  print(f"{label:50s} {1e3*s:.4f} ms/step", flush=True)

for spc in (8, 32):
  steps_mod.STEPS_PER_CALL = spc
  timer = steps_mod.StepTimer(llm)
  s = timer.measure(1, ctx, {1})[("target", 1)]
  routed = [distinct_experts(ids) for ids in timer.routed_experts(1, ctx)] if cfg.is_moe else None
  floor = step_bytes(cfg, 1, 1, ctx, experts_used=routed) / bw["read"]
  print(f"floor {1e3*floor:.4f} ms; read probe {bw['read']/1e12:.3f} TB/s", flush=True)
  report(f"spc={spc} measure() (bench default)", s)
  run = timer.runs[("target", 1)]
  for rep in range(2):
    report(f"spc={spc} default timer rep{rep}", seconds_per_call(run, [()]) / spc)
    report(f"spc={spc} min_batch_s=0.25 rep{rep}", seconds_per_call(run, [()], min_batch_s=0.25) / spc)
  # host dispatch of one call (the device busy with the previous ones)
  ds = []
  for _ in range(15):
    t = time.perf_counter(); out = run(); ds.append(time.perf_counter() - t)
  jax.block_until_ready(out)
  print(f"spc={spc} dispatch median {1e6*statistics.median(ds):.1f} us, min {1e6*min(ds):.1f}", flush=True)
  # slope over batches of n calls, blocked once at the end of each
  def batch(n):
    jax.block_until_ready(run())
    t = time.perf_counter(); out = None
    for _ in range(n): out = run()
    jax.block_until_ready(out); return time.perf_counter() - t
  t3 = statistics.median(batch(3) for _ in range(7))
  t15 = statistics.median(batch(15) for _ in range(5))
  report(f"spc={spc} slope (15 - 3 calls)", (t15 - t3) / 12 / spc)
  report(f"spc={spc} batch of 3 / 3", t3 / 3 / spc)
  print(f"spc={spc} fixed per batch {1e3*(t3 - 3*(t15-t3)/12):.3f} ms", flush=True)
  for label, s in rows[-7:]:
    pass
print("\n| timer | ms/step | % roofline |")
for label, s in rows:
  print(f"| {label} | {1e3*s:.4f} | {100*floor/s:.1f}% |")
