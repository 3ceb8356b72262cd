"""DeepSeek-V3 6-layer decode step at batch 32: the experts its timed steps route, and floors.

    python3 ds_v3_b32_routed_2026-11-30.py 8192 32768    # PYTHONPATH at the checkout
"""
import dataclasses, json, sys, time
import jax
import jspec
from jspec.bench.presets import PRESETS
from jspec.bench.roofline import (distinct_experts, hbm_bandwidth, routed_expert_bytes,
                                  step_bytes, expected_experts_used)
from jspec.bench.steps import StepTimer

contexts = [int(c) for c in sys.argv[1:]] or [8192, 32768]
cfg = PRESETS["deepseek-v3"]
max_context = max(contexts) + 16
cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_context))
llm = jspec.LLM.from_random(cfg, max_model_len=max_context, max_num_seqs=1)
timer = StepTimer(llm)
bw = hbm_bandwidth()
print("bandwidth", {k: round(v / 1e12, 3) for k, v in bw.items()}, flush=True)
for ctx in contexts:
  s = timer.measure(32, ctx, {1})
  step = s[("target", 1)]
  ids = timer.routed_experts(32, ctx)
  per_step = [[int(len(set(st.ravel().tolist()))) for st in layer] for layer in ids]
  first = [p[0] for p in per_step]
  mean = [distinct_experts(layer) for layer in ids]
  moe_floor = routed_expert_bytes(cfg, mean) / bw["read"]
  floor = step_bytes(cfg, 32, 1, ctx, experts_used=mean) / bw["read"]
  floor_first = step_bytes(cfg, 32, 1, ctx, experts_used=first) / bw["read"]
  mla = timer.mla_attention(32, ctx)
  print(json.dumps(dict(context=ctx, decode_ms=round(1e3 * step, 3),
                        experts_first_step=first, experts_mean=mean, experts_per_step=per_step,
                        uniform=round(expected_experts_used(256, 8, 32), 1),
                        moe_floor_ms=round(1e3 * moe_floor, 3),
                        step_floor_ms=round(1e3 * floor, 3),
                        step_floor_first_step_ms=round(1e3 * floor_first, 3),
                        mla_call_us=round(1e6 * mla, 1),
                        read_tbs=round(bw["read"] / 1e12, 3))), flush=True)
