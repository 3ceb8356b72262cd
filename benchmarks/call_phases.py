"""The host's timeline of a `generate` call on the trained demo model, default (continuous)
scheduler against the waves: when each of the schedulers' pieces starts and ends (ms from
the call's entry, median of 8 calls per row; a piece that is not there is skipped). Then the
cost of small transfers: 13 host-to-device puts against one buffer of the same bytes, and 14
arrays fetched against one.

    PYTHONPATH=. python3 benchmarks/call_phases.py
"""
import functools, sys, time, os, collections
import numpy as np, transformers, jax, jax.numpy as jnp
import jspec
from jspec.schedulers import continuous, waves, dispatch_chain
from jspec import api
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from continuous_batching import demo_prompts

EVENTS = []
T0 = [0.0]
def wrap(owner, name, label=None):
  fn = getattr(owner, name)
  label = label or name
  @functools.wraps(fn)
  def inner(*a, **k):
    s = time.perf_counter()
    try:
      return fn(*a, **k)
    finally:
      EVENTS.append((label, s - T0[0], time.perf_counter() - T0[0]))
  setattr(owner, name, inner)

for owner, name in [(continuous.ContinuousScheduler, "_plans"), (continuous.ContinuousScheduler, "_packed"), (continuous, "device_queue"),
                    (continuous.ContinuousScheduler, "_wave"), (continuous.ContinuousScheduler, "_wave_inputs"),
                    (continuous.ContinuousScheduler, "_compile"), (continuous, "OutputCollector"),
                    (continuous, "RequestProgress"), (continuous, "DispatchChain"),
                    (dispatch_chain.DispatchChain, "next"), (dispatch_chain.DispatchChain, "close"),
                    (continuous, "to_host"), (continuous.OutputCollector, "outputs"),
                    (continuous.ContinuousScheduler, "generate"), (waves.WavesScheduler, "_request_inputs"),
                    (waves.WavesScheduler, "_compile"), (waves, "to_host"), (waves.WavesScheduler, "generate"),
                    (api.LLM, "_encode"), (api.LLM, "_check_lengths")]:
  try:
    wrap(owner, name, f"{getattr(owner, '__name__', owner)}.{name}")
  except AttributeError:  # a piece this version does not have
    pass

tok = transformers.AutoTokenizer.from_pretrained(jspec.demo_model_path())
rng = np.random.default_rng(0)
for method in ("none", "mtp"):
  spec = None if method == "none" else {"method": "mtp", "num_speculative_tokens": 3}
  llms = {b: jspec.LLM(model=jspec.demo_model_path(), max_model_len=512, max_num_seqs=8,
                       speculative_config=spec, batching=b) for b in ("continuous", "waves")}
  for batch in (1, 8):
    prompts = demo_prompts(rng, tok, [128] * batch)
    for mt in (256, 8):
      params = jspec.SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True)
      for llm in llms.values():
        for _ in range(2): llm.generate(prompts, params, use_tqdm=False)
      per = {b: collections.defaultdict(list) for b in llms}
      walls = {b: [] for b in llms}
      for _ in range(8):
        for b, llm in llms.items():
          EVENTS.clear(); T0[0] = time.perf_counter()
          llm.generate(prompts, params, use_tqdm=False)
          walls[b].append((time.perf_counter() - T0[0]) * 1e3)
          seen = collections.Counter()
          for label, s, e in EVENTS:
            seen[label] += 1
            per[b][f"{label}#{seen[label]}"].append((s * 1e3, e * 1e3))
      print(f"=== {method} B={batch} max_tokens={mt}")
      for b in llms:
        print(f"  {b}: wall median {np.median(walls[b]):.2f} ms min {min(walls[b]):.2f}")
        rows = sorted(per[b].items(), key=lambda kv: np.median([x[0] for x in kv[1]]))
        for label, v in rows:
          s = np.median([x[0] for x in v]); e = np.median([x[1] for x in v])
          print(f"    {label:45s} {s:8.3f} -> {e:8.3f}  ({e - s:7.3f})")

# Transfers
dev = jax.devices()[0]
arrs = [np.zeros((n,), np.int32) for n in (4096, 64, 64, 64, 64, 64, 64, 64, 256, 64, 8, 8, 8)]
for _ in range(3): jax.block_until_ready([jax.device_put(a, dev) for a in arrs])
ts = []
for _ in range(20):
  t = time.perf_counter(); x = [jax.device_put(a, dev) for a in arrs]; jax.block_until_ready(x); ts.append(time.perf_counter() - t)
packed = np.concatenate(arrs)
ts1 = []
for _ in range(20):
  t = time.perf_counter(); x = jax.device_put(packed, dev); jax.block_until_ready(x); ts1.append(time.perf_counter() - t)
print(f"H2D: 13 puts {np.median(ts) * 1e6:.1f} us, one packed {np.median(ts1) * 1e6:.1f} us")
ys = [jnp.zeros((16, 300), jnp.int32) for _ in range(14)]
yp = jnp.zeros((14 * 16 * 300,), jnp.int32)
for _ in range(3): jax.device_get(ys); jax.device_get(yp)
ts, ts1 = [], []
for _ in range(20):
  ys = [y + 1 for y in ys]; jax.block_until_ready(ys)
  t = time.perf_counter(); jax.device_get(ys); ts.append(time.perf_counter() - t)
  yp = yp + 1; jax.block_until_ready(yp)
  t = time.perf_counter(); jax.device_get(yp); ts1.append(time.perf_counter() - t)
print(f"D2H: 14 arrays {np.median(ts) * 1e6:.1f} us, one packed {np.median(ts1) * 1e6:.1f} us")
