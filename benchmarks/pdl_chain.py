"""norm -> FP8 product chains under PDL variants (the trial at this commit): us per product and outputs
against the base. python benchmarks/pdl_chain.py [--small]"""
import sys, time, os
import jax, jax.numpy as jnp, numpy as np
from jspec.pallas_kernels import fp8_gemm, row_norms, fp8_block_kernel, early_launch
L, REPS = 16, 8
shapes = [(4096, 4096), (4096, 24576)]
if "--small" in sys.argv:
  L, REPS, shapes = 2, 2, [(256, 256)]
rng = np.random.default_rng(0)

def make(k, n):
  ws = [jnp.asarray(rng.standard_normal((n, k), np.float32) * 0.05, jnp.float8_e4m3fn) for _ in range(L)]
  ss = [jnp.asarray(rng.uniform(0.5, 1.5, (n // 128, k // 128)), jnp.float32) for _ in range(L)]
  lanes = [fp8_gemm.scale_lanes(s) for s in ss]
  return ws, ss, lanes

def chain(x, ws, ss, lanes, ones):
  k = x.shape[1]
  def body(_, carry):
    x, y = carry
    for w, s, ln in zip(ws, ss, lanes):
      n = y.shape[1]
      delta = y[:, :k] if n >= k else jnp.pad(y, ((0, 0), (0, k - n)))
      x, h = row_norms.rms_norm(x, ones, delta, eps=1e-6)
      y = fp8_gemm.fp8_matmul(h, w, s, lanes_NbX=ln)
    return x, y
  return jax.lax.fori_loop(0, REPS, body, (x, jnp.zeros((1, ws[0].shape[0]), x.dtype)))

VARIANTS = {"base": (False, False, {}), "xla_pdl": (False, False, {"xla_gpu_enable_pdl": True}),
            "early": (True, True, {}), "early+xla_pdl": (True, True, {"xla_gpu_enable_pdl": True}),
            "early_no_trigger+xla_pdl": (True, False, {"xla_gpu_enable_pdl": True})}
order = ["base", "early+xla_pdl", "early", "xla_pdl", "early_no_trigger+xla_pdl", "early+xla_pdl"]
print(f"{'K x N':>12s} {'variant':26s} {'us/product':>10s}  equal to base")
for k, n in shapes:
  ws, ss, lanes = make(k, n)
  x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
  ones = jnp.ones((k,), jnp.bfloat16)
  base_out = None
  for name in order:
    early, trigger, opts = VARIANTS[name]
    fp8_block_kernel.EARLY_LAUNCH, early_launch.TRIGGER = early, trigger
    jax.clear_caches()
    try:
      comp = jax.jit(chain).lower(x, ws, ss, lanes, ones).compile(compiler_options=opts)
    except Exception as e:
      print(f"{k}x{n:<6d} {name:26s} FAILED {type(e).__name__}: {str(e)[:300]}"); continue
    out = comp(x, ws, ss, lanes, ones); jax.block_until_ready(out)
    times = []
    for _ in range(7):
      t0 = time.perf_counter(); out = comp(x, ws, ss, lanes, ones); jax.block_until_ready(out)
      times.append(time.perf_counter() - t0)
    us = sorted(times)[len(times) // 2] / (L * REPS) * 1e6
    o = np.asarray(out[1].astype(jnp.float32))
    if base_out is None and name == "base":
      base_out = o
    eq = None if base_out is None else bool(np.array_equal(o, base_out))
    print(f"{k:>5d}x{n:<6d} {name:26s} {us:10.2f}  {eq}", flush=True)
