"""A verify window through one Gated DeltaNet recurrence, the two ways jspec can commit it.

At Qwen3.5-9B shapes (16 key heads, 32 value heads, Dk = Dv = 128: a 2 MiB float32 state per
sequence and layer), for each batch and window length T:

  xla store   the one-step form in XLA keeping the state after every position (verify), then
              picking the one after the last emitted token (commit);
  xla replay  the one-step form for the outputs (verify), then re-running the emitted
              positions from the state before the window (commit);

A fused Triton kernel for the window (state held on chip, written once) was measured with this
script at commit 45d2e09 and lost to XLA's fusions at decode (BENCHMARKS.md "Qwen3.5"); it is
not part of jspec.

Each row: microseconds for verify + commit of one layer (commit keeps all T positions, the
most work), the state bytes the pass must move at the least (read once for verify, read and
written once for commit) divided by the time, against the copy bandwidth measured in the same
run, and the kernels per verify + commit from one profiled call.

    python benchmarks/delta_rule_window.py --batch 1 8 --window 1 2 4
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.presets import PRESETS
from jspec.bench.profile import profile
from jspec.bench.roofline import hbm_bandwidth, seconds_per_call
from jspec.models import gated_deltanet as gdn

LAYERS = 8  # distinct states chained per call, so no state is served from L2


def _inputs(key, batch, length, cfg):
  g, r = cfg.linear.num_key_heads, cfg.linear.num_value_heads // cfg.linear.num_key_heads
  dk, dv = cfg.linear.key_head_dim, cfg.linear.value_head_dim
  ks = jax.random.split(key, 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  states = 0.1 * jax.random.normal(ks[0], (LAYERS, batch, g, r, dk, dv), jnp.float32)
  q = unit(jax.random.normal(ks[1], (batch, length, g, dk))) * dk ** -0.5
  k = unit(jax.random.normal(ks[2], (batch, length, g, dk)))
  v = jax.random.normal(ks[3], (batch, length, g, r, dv))
  decay = -jax.random.uniform(ks[4], (batch, length, g, r))
  beta = jax.random.uniform(ks[5], (batch, length, g, r))
  return states, q, k, v, decay, beta


def _xla_store(state, q, k, v, decay, beta, num_B):
  _, out, states = gdn.delta_rule_steps(state, q, k, v, decay, beta, keep_states=True)
  picked = jnp.take_along_axis(states, (num_B - 1)[:, None, None, None, None, None], axis=1)[:, 0]
  return out, picked


def _xla_replay(state, q, k, v, decay, beta, num_B):
  _, out, _ = gdn.delta_rule_steps(state, q, k, v, decay, beta)
  live = jnp.arange(k.shape[1])[None, :] < num_B[:, None]
  return out, gdn.delta_rule_steps(state, None, k, v, decay, beta, live_BT=live)[0]


WAYS = {"xla store": _xla_store, "xla replay": _xla_replay}


def _chained(way):
  """All LAYERS states through verify + commit in one program, outputs summed so none is
  dropped."""

  def run(states, q, k, v, decay, beta, num_B):
    total = jnp.zeros((), jnp.float32)
    new_states = []
    for layer in range(LAYERS):
      out, new = way(states[layer], q, k, v, decay, beta, num_B)
      total = total + out[0, 0, 0, 0, 0]
      new_states.append(new)
    return total, jnp.stack(new_states)

  return jax.jit(run)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="qwen3.5-9b", choices=list(PRESETS))
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--window", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  cfg = PRESETS[args.model]
  bandwidth = hbm_bandwidth()
  copy = bandwidth["copy"]
  rows = []
  for batch in args.batch:
    for length in args.window:
      arg_sets = [_inputs(jax.random.key(seed), batch, length, cfg) + (
          jnp.full((batch,), length, jnp.int32),) for seed in range(2)]
      state_bytes = arg_sets[0][0][0].nbytes  # one layer's states
      reference = None
      for name, way in WAYS.items():
        fn = _chained(way)
        seconds = seconds_per_call(fn, arg_sets) / LAYERS
        got = jax.device_get(fn(*arg_sets[0]))
        if reference is None:
          reference = got
        error = float(np.max(np.abs(got[1] - reference[1])))
        _, times = profile(lambda: jax.block_until_ready(fn(*arg_sets[0])))
        kernels = sum(count for count, _ in times.values()) / LAYERS
        moved = 3 * state_bytes  # verify reads it, commit reads and writes it
        rows.append(dict(batch=batch, window=length, way=name, us=seconds * 1e6,
                         state_mb=state_bytes / 2 ** 20, gbps=moved / seconds / 1e9,
                         share=moved / seconds / copy, kernels=kernels, max_abs_diff=error))
        print(f"B={batch} T={length} {name:16s} {seconds * 1e6:8.1f} us  "
              f"{moved / seconds / 1e9:7.0f} GB/s  {kernels:5.1f} kernels  diff {error:.1e}",
              flush=True)
  print(f"\ncopy bandwidth {copy / 1e12:.2f} TB/s; state per layer = batch x "
        f"{rows[0]['state_mb'] / args.batch[0]:.1f} MiB\n")
  print("| B | T | way | us / layer | state MiB | GB/s (3 passes) | of copy bw | kernels |")
  print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
  for r in rows:
    print(f"| {r['batch']} | {r['window']} | {r['way']} | {r['us']:.1f} | {r['state_mb']:.0f} | "
          f"{r['gbps']:.0f} | {r['share']:.0%} | {r['kernels']:.1f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
