"""Softmax routing of a step's few tokens: XLA's kernels against jspec's router kernels
(jspec.pallas_kernels.router_topk), then a preset's TPOT with and without them.

Part 1: one program routes a token through 48 different routers (Qwen3-30B-A3B's 2048 x 128,
top 8), each routing feeding the next token; wall time and profiled kernel time per router.
Part 2: the preset, random weights, one process: TPOT (the 128 steps between a 160- and a
32-token call, medians of 3) through the kernels, then, on the same weights, through XLA.

    PYTHONPATH=. python3 benchmarks/moe_router.py --model qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jspec
from jspec.bench.presets import PRESETS
from jspec.bench.profile import profile
from jspec.models.moe import MoE, route
from jspec.pallas_kernels import router_topk

ROUTERS, HIDDEN, EXPERTS, TOP_K = 48, 2048, 128, 8


def chain(fn):
  @jax.jit
  def run(x, routers):
    out = 0
    for r in routers:
      ids, w = fn(x, r)
      x = x + (w[:, :1] * 1e-3).astype(x.dtype)  # each routing waits for the one before
      out = out + ids.sum()
    return x, out
  return run


def routers_alone(slices, repeats):
  key = jax.random.PRNGKey(0)
  routers = [jax.random.normal(jax.random.fold_in(key, i), (HIDDEN, EXPERTS), jnp.bfloat16)
             * 0.02 for i in range(ROUTERS)]
  flush = jnp.ones((50 * 1024 * 1024,), jnp.float32)  # 200 MB: the routers out of L2
  variants = {"xla": lambda x, r: route(jnp.einsum("td,de->te", x, r), TOP_K, True, x.dtype)}
  for s in slices:
    variants[f"kernels, {s} slices"] = (lambda s: lambda x, r: router_topk.route_softmax(
        x, r, top_k=TOP_K, norm=True, slices=s))(s)
  for tokens in (1, 8):
    x = jax.random.normal(key, (tokens, HIDDEN), jnp.bfloat16)
    for name, fn in variants.items():
      run = chain(fn)
      jax.block_until_ready(run(x, routers))
      times = []
      for _ in range(repeats):
        jax.block_until_ready(flush * 1.0001)
        start = time.perf_counter()
        jax.block_until_ready(run(x, routers))
        times.append(time.perf_counter() - start)
      _, ops = profile(lambda: run(x, routers))
      print(f"T={tokens} {name:20s} wall {np.median(times) * 1e6 / ROUTERS:7.2f} us a router, "
            f"kernels {ops[None][1] / 1e3 / ROUTERS:6.2f} us", flush=True)


def tpot(llm, batch):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, llm.config.vocab_size, 128).tolist() for _ in range(batch)]
  params = lambda n: jspec.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
  llm.generate(prompts, params(160), use_tqdm=False)
  llm.generate(prompts, params(32), use_tqdm=False)
  longs, shorts = [], []
  for _ in range(3):
    start = time.perf_counter()
    llm.generate(prompts, params(160), use_tqdm=False)
    longs.append(time.perf_counter() - start)
    start = time.perf_counter()
    llm.generate(prompts, params(32), use_tqdm=False)
    shorts.append(time.perf_counter() - start)
  return (np.median(longs) - np.median(shorts)) / 128 * 1e3


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
  parser.add_argument("--slices", type=int, nargs="+", default=[8, 16, 32])
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  args = parser.parse_args()
  routers_alone(args.slices, args.repeats)
  config = PRESETS[args.model]
  if args.layers:
    config = dataclasses.replace(config, num_layers=args.layers)
  llm = jspec.LLM.from_random(config, None, max_model_len=1024, max_num_seqs=max(args.batch))
  moes = [n for _, n in nnx.iter_graph(llm.target) if isinstance(n, MoE)]
  print(f"router kernels in {sum(n.router_kernel is not None for n in moes)} of {len(moes)} "
        "MoE layers", flush=True)
  kernels = {b: tpot(llm, b) for b in args.batch}
  # The same weights through XLA's routing: a second LLM on the same modules, built with the
  # kernels declined.
  for n in moes:
    n.router_kernel = None
  router_topk.fits_kernel = lambda *a: False
  plain = jspec.LLM(_modules=(None, llm.config, llm.target, llm.mtp, llm.mtp_spec),
                    max_model_len=1024, max_num_seqs=max(args.batch))
  for b in args.batch:
    xla = tpot(plain, b)
    print(f"B={b}: TPOT {kernels[b]:.3f} ms through the kernels, {xla:.3f} ms through XLA: "
          f"{kernels[b] / xla:.3f}x", flush=True)


if __name__ == "__main__":
  main()
