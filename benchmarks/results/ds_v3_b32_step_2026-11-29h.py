"""DeepSeek-V3 (preset, 6 layers, 128 heads on one GPU) decode step at batch 32, contexts 8k
and 32k: the step as `jspec bench` times it, and the experts its routers picked."""
import dataclasses, json, subprocess, sys, time
import jax
import jspec
from jspec.bench.presets import PRESETS
from jspec.bench.roofline import distinct_experts
from jspec.bench.steps import StepTimer

contexts = [int(c) for c in sys.argv[1:]] or [8192, 32768]
cfg = PRESETS["deepseek-v3"]
max_context = max(contexts) + 16
cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings,
                                                            max_context))
t0 = time.perf_counter()
llm = jspec.LLM.from_random(cfg, max_model_len=max_context, max_num_seqs=1)
print("built", round(time.perf_counter() - t0, 1), "s", flush=True)
timer = StepTimer(llm)
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
for ctx in contexts:
  t0 = time.perf_counter()
  s = timer.measure(32, ctx, {1})
  decode_ms = 1e3 * s[("target", 1)]
  routed = [int(distinct_experts(i)) for i in timer.routed_experts(32, ctx)]
  print(json.dumps(dict(commit=commit, layers=cfg.num_layers, heads=cfg.num_heads, batch=32,
                        context=ctx, decode_ms=round(decode_ms, 3), experts_routed=routed,
                        device=jax.devices()[0].device_kind,
                        seconds=round(time.perf_counter() - t0, 1))), flush=True)
