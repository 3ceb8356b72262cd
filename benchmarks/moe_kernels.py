"""MoE expert layer: jspec's Pallas Mosaic GPU kernels against XLA and tokamax baselines.

    PYTHONPATH=. python3 benchmarks/moe_kernels.py --json moe_kernels.json
    PYTHONPATH=. python3 benchmarks/moe_kernels.py --decode --json moe_decode.json
    PYTHONPATH=. python benchmarks/moe_kernels.py --tiny   # interpret mode on CPU: smoke test
    PYTHONPATH=. python benchmarks/moe_kernels.py --tiny --decode

--decode times whole MoE layers (router, routed experts, shared experts: `jspec.models.moe.MoE`
with a preset's shapes) at decode sizes, T = 1..32 tokens, for each expert backend: "pallas"
(experts_pallas, which takes the decode path at these sizes), "grouped" (the Pallas path it
replaced) and "ragged_dot" (XLA); and the routed experts alone. Each is timed as 8 dependent
calls inside one program (`seconds_per_chained_call`), as a model runs its layers, rotating
over several weight copies so that no call finds the previous call's experts in L2. Kernels
per layer are counted in the optimized HLO (command buffers opened up), and checked against a
profile at the first T.

For each model's expert shapes and each token count T: skewed (Zipf-like, seeded) top-k
routing, bf16, median time per layer call after warm-up. "bytes" is the least the layer
must move through HBM (the weights of the experts that got tokens, x read once, y written
once); it is compared with the bandwidth of a large device copy measured in the same run.
TFLOP/s counts the useful FLOPs, 6 * T * K * D * F.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import types

import jax
import jax.numpy as jnp

from jspec.bench.roofline import hbm_bandwidth, seconds_per_call
from jspec.models.moe_backends import experts_dense, experts_ragged_dot, experts_reference
from jspec.pallas_kernels import (choose_tilings, down_weighted, experts_pallas,
                                  gate_up_swiglu, permute_rows, plan_routing)

MODELS = {
    # name: (experts E, top-k K, hidden D, expert intermediate F)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
# --decode: presets of jspec.bench.presets (whole MoE layers, shared experts included).
DECODE_MODELS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b", "deepseek-v3")
DECODE_TOKENS = (1, 2, 4, 8, 16, 32)
# Baselines that expand to all experts are skipped past this many FLOPs (seconds per call).
MAX_BASELINE_FLOPS = 1.5e14
MAX_DENSE_BYTES = 12e9


def _tokamax_ragged_dot():
  """tokamax.ragged_dot, or None. Its profiling-only imports (xprof) are stubbed out."""
  for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
    sys.modules.setdefault(name, types.ModuleType(name))
  if not hasattr(sys.modules["xprof.cli.tools"], "get_kernel_stats_tool"):
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
  try:
    import tokamax
    return tokamax.ragged_dot
  except Exception as e:  # Not installed: the column stays empty.
    print(f"tokamax unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    return None


def skewed_routing(key, num_tokens, num_experts, top_k, zipf_s=1.0):
  """Top-k distinct experts per token, expert popularity ~ 1 / rank^s (Gumbel top-k)."""
  k_perm, k_gumbel, k_w = jax.random.split(key, 3)
  rank = jax.random.permutation(k_perm, num_experts) + 1
  log_p = -zipf_s * jnp.log(rank.astype(jnp.float32))
  scores = log_p + jax.random.gumbel(k_gumbel, (num_tokens, num_experts))
  _, ids = jax.lax.top_k(scores, top_k)
  weights = jax.nn.softmax(jax.random.normal(k_w, (num_tokens, top_k)), axis=-1)
  return ids.astype(jnp.int32), weights


def hbm_bandwidths(num_bytes=2 << 30):
  """(copy, read) bytes per second, as `jspec bench` measures them."""
  bandwidth = hbm_bandwidth(num_bytes)
  return bandwidth["copy"], bandwidth["read"]


def _kernels_only(tilings):
  gate_up_tiling, down_tiling = tilings

  def run(x_PD, tile_expert_N, row_weight_P, w_gate, w_up, w_down):
    act = gate_up_swiglu(x_PD, w_gate, w_up, tile_expert_N, gate_up_tiling)
    return down_weighted(act, w_down, row_weight_P, tile_expert_N, down_tiling)

  return jax.jit(run)


def bench_model(name, num_experts, top_k, dim, ffn, tokens, hbm_bw, tokamax_rd, check):
  keys = jax.random.split(jax.random.key(hash(name) % 2**31), 4)
  init = jax.jit(lambda k: (jax.random.normal(k, (num_experts, dim, ffn), jnp.bfloat16)
                            * (dim ** -0.5)).astype(jnp.bfloat16))
  w_gate, w_up = init(keys[0]), init(keys[1])
  w_down = jax.jit(lambda k: (jax.random.normal(k, (num_experts, ffn, dim), jnp.bfloat16)
                              * (ffn ** -0.5)).astype(jnp.bfloat16))(keys[2])
  backends = {"pallas": jax.jit(experts_pallas), "ragged_dot": jax.jit(experts_ragged_dot),
              "dense": jax.jit(experts_dense)}
  if tokamax_rd is not None:
    backends["tokamax"] = jax.jit(functools.partial(experts_ragged_dot, ragged_dot=tokamax_rd))
  rows = []
  for num_tokens in tokens:
    arg_sets = []
    for s in range(2):
      kx, kr = jax.random.split(jax.random.fold_in(keys[3], num_tokens * 10 + s))
      x = jax.random.normal(kx, (num_tokens, dim), jnp.bfloat16)
      ids, weights = skewed_routing(kr, num_tokens, num_experts, top_k)
      arg_sets.append((x, ids, weights, w_gate, w_up, w_down))
    experts_used = int(jnp.unique(arg_sets[0][1]).size)
    weight_bytes = experts_used * 3 * dim * ffn * 2
    min_bytes = weight_bytes + 2 * num_tokens * dim * 2
    flops = 6 * num_tokens * top_k * dim * ffn
    all_expert_flops = 6 * num_tokens * top_k * num_experts * dim * ffn
    row = {"model": name, "T": num_tokens, "experts_used": experts_used, "min_bytes": min_bytes,
           "flops": flops}
    tilings = choose_tilings(num_tokens * top_k, num_experts, dim, ffn)
    row["tiling"] = ("swapped" if tilings[0].swapped else "standard") + f"/{tilings[0].block_rows}"
    for backend, fn in backends.items():
      if backend == "ragged_dot" and all_expert_flops > MAX_BASELINE_FLOPS:
        row[backend] = None
        continue
      if backend == "dense" and (all_expert_flops / top_k > MAX_BASELINE_FLOPS
                                 or num_tokens * num_experts * dim * 2 > MAX_DENSE_BYTES):
        row[backend] = None
        continue
      try:
        row[backend] = seconds_per_call(fn, arg_sets)
      except Exception as e:  # Record and go on: one failure must not hide the rest.
        print(f"{name} T={num_tokens} {backend}: {type(e).__name__}: {str(e)[:300]}",
              file=sys.stderr)
        row[backend] = None
    try:
      if check and row["pallas"]:
        got = backends["pallas"](*arg_sets[0]).astype(jnp.float32)
        base = "tokamax" if row.get("tokamax") else "dense" if row.get("dense") else "ragged_dot"
        want = backends[base](*arg_sets[0]).astype(jnp.float32)
        row["rel_err_vs_" + base] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
      # The two grouped-GEMM kernels alone, routing/permute/combine excluded.
      plan_sets = []
      for x, ids, weights, *_ in arg_sets:
        plan = plan_routing(ids, weights, num_experts, tilings[0].block_rows)
        plan_sets.append((permute_rows(x, plan), plan.tile_expert_N, plan.row_weight_P,
                          w_gate, w_up, w_down))
      row["pallas_kernels"] = seconds_per_call(_kernels_only(tilings), plan_sets)
    except Exception as e:
      print(f"{name} T={num_tokens} check/kernels: {type(e).__name__}: {str(e)[:300]}",
            file=sys.stderr)
    t = row["pallas"]
    if t:
      row["pallas_bw_frac"] = min_bytes / t / hbm_bw
      row["pallas_tflops"] = flops / t / 1e12
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def _fmt_us(seconds):
  return "-" if not seconds else f"{seconds * 1e6:.0f}"


def table(rows, hbm_bw):
  lines = [f"% HBM BW is against {hbm_bw / 1e12:.2f} TB/s, measured in this run", "",
           "| model | T | tiling | experts used | pallas us | kernels us | % HBM BW | TFLOP/s "
           "| ragged_dot us | dense us | tokamax us | x ragged_dot | x tokamax |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
           "| ---: |"]
  for r in rows:
    t = r.get("pallas")
    ratio = lambda other: f"{r[other] / t:.2f}" if (t and r.get(other)) else "-"
    lines.append(
        f"| {r['model']} | {r['T']} | {r['tiling']} | {r['experts_used']} | {_fmt_us(t)} "
        f"| {_fmt_us(r.get('pallas_kernels'))} "
        f"| {100 * r.get('pallas_bw_frac', 0):.0f} | {r.get('pallas_tflops', 0):.1f} "
        f"| {_fmt_us(r.get('ragged_dot'))} | {_fmt_us(r.get('dense'))} "
        f"| {_fmt_us(r.get('tokamax'))} | {ratio('ragged_dot')} | {ratio('tokamax')} |")
  return "\n".join(lines)


# --- decode sizes: whole MoE layers --------------------------------------------------------

CHAINED_CALLS = 8


def seconds_per_chained_call(fn, arg_sets, calls=CHAINED_CALLS):
  """Device seconds per call of fn(*args), from one program of `calls` calls in a row.

  A model runs its layers inside one program, where the host dispatches nothing per layer, and
  each layer's input depends on the previous one's output. So does this: call i reads arg set
  i % len(arg_sets) with its x (argument 0) plus a runtime zero times the previous call's first
  output element. The calls then run in order, and XLA cannot merge small kernels across calls;
  the add stands in for the residual add a layer's input comes from, and its time is counted.
  """
  def program(sets, zero):
    outs, prev = [], None
    for i in range(calls):
      x, *rest = sets[i % len(sets)]
      if prev is not None:
        x = x + (zero * prev.reshape(-1)[0].astype(jnp.float32)).astype(x.dtype)
      prev = fn(x, *rest)
      outs.append(prev)
    return outs

  return seconds_per_call(jax.jit(program), [(arg_sets, jnp.float32(0))]) / calls


def _called_computations(line):
  return re.findall(r"(?:to_apply|calls|body|condition|branch_computations)=\{?%?([\w.\-]+)", line)


# Opcodes that launch no kernel of their own.
_FREE_OPS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
             "opt-barrier", "partition-id", "replica-id", "call", "while", "conditional",
             "async-start", "async-done", "async-update", "copy-start", "copy-done"}


def hlo_kernel_count(hlo_text: str) -> int:
  """Kernel launches of one call of a compiled program: the instructions of its entry
  computation and of the computations it calls (command buffers, calls, loop bodies once),
  less those that launch nothing. A fusion counts once, whatever it fuses."""
  comps, name, body = {}, None, []
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if header and not line.startswith(" "):
      name, body = header.group(2), []
      comps[name] = body
      if header.group(1):
        comps["__entry__"] = body
    elif name is not None and line.strip() and line.strip() != "}":
      body.append(line)

  def count(comp, seen):
    total = 0
    for line in comps.get(comp, []):
      m = re.search(r"=\s*(?:\([^=]*?\)|[\w\[\]{},:\s]*?)\s*([a-z][\w\-]*)\(", line)
      op = m.group(1) if m else None
      if op in ("call", "while", "conditional", "async-start"):
        for callee in _called_computations(line):
          if callee not in seen:
            total += count(callee, seen | {callee})
      elif op and op not in _FREE_OPS:
        total += 1
    return total

  return count("__entry__", frozenset())


def profiled_kernels(fn, args):
  """(kernel launches, their summed µs, [(name, µs)]) of one call, from a profile."""
  from jspec.bench.profile import call_kernel_events
  events = [(name, (end - start) / 1e3) for start, end, name in call_kernel_events(fn, *args)]
  return len(events), sum(us for _, us in events), events


def _layer_bytes(cfg, experts_used, num_tokens, itemsize=2):
  """Least bytes of one MoE layer call: the router, the experts that got tokens, the shared
  experts, x read and y written."""
  d, f = cfg.hidden_size, cfg.moe.intermediate_size
  shared = 3 * d * (cfg.moe.shared_expert_intermediate_size + f * cfg.moe.num_shared_experts)
  shared += d * bool(cfg.moe.shared_expert_intermediate_size)
  return itemsize * (d * cfg.moe.num_experts + experts_used * 3 * d * f + shared
                     + 2 * num_tokens * d)


def bench_decode_model(name, cfg, tokens, hbm_bw, check, weight_budget=4e9):
  from flax import nnx
  from jspec.models.moe import MoE
  from jspec.pallas_kernels import experts_grouped, gate_up_decode, down_decode, plan_decode
  from jspec.pallas_kernels.decode_routing import padded_tokens
  from jspec.pallas_kernels.experts import decode_tilings

  cfg = dataclasses.replace(cfg, expert_tile=64).padded_for(1, 1)
  d, e, f = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.intermediate_size
  expert_bytes = 3 * d * f * 2
  copies = int(max(1, min(4, weight_budget // (e * expert_bytes))))
  layers = [MoE(cfg, jnp.bfloat16, nnx.Rngs(params=c)) for c in range(copies)]
  graphdef, _ = nnx.split(layers[0])
  states = [nnx.split(layer)[1] for layer in layers]
  backends = {"pallas": experts_pallas, "grouped": jax.jit(experts_grouped),
              "ragged_dot": jax.jit(experts_ragged_dot)}

  def layer_fn(experts_fn):
    return jax.jit(lambda x_TD, state: nnx.merge(graphdef, state)(x_TD[None], experts_fn)[0])

  @jax.jit
  def route(x_TD, state):
    layer = nnx.merge(graphdef, state)
    x_in = jnp.pad(x_TD, ((0, 0), (0, layer.hidden_padding)))
    return (x_in,) + tuple(layer._route(x_TD))

  def routing(x_TD, state):
    # The expert weights are taken outside the jit: returned from it, each call's result
    # would be a copy of the layer's experts (23 GB per call at DeepSeek-V3 shapes).
    layer = nnx.merge(graphdef, state)
    return route(x_TD, state) + (layer.w_gate[...], layer.w_up[...], layer.w_down[...])

  layers_jit = {b: layer_fn(fn) for b, fn in backends.items()}
  gate_up_tiling, down_tiling = decode_tilings(cfg.moe_padded_hidden_size,
                                               cfg.moe_padded_intermediate_size)
  rows = []
  for num_tokens in tokens:
    keys = jax.random.split(jax.random.key(num_tokens), 4)
    xs = [jax.random.normal(keys[i], (num_tokens, d), jnp.bfloat16) for i in range(4)]
    arg_sets = [(xs[i], states[i % copies]) for i in range(4)]
    expert_args = [routing(*a) for a in arg_sets]
    used = [int(jnp.unique(jnp.where(a[1] >= 0, a[1], -1)).size) for a in expert_args]
    experts_used = sum(used) / len(used)
    min_bytes = _layer_bytes(cfg, experts_used, num_tokens)
    row = {"model": name, "T": num_tokens, "experts_used": experts_used, "min_bytes": min_bytes,
           "weight_copies": copies}
    for backend, fn in layers_jit.items():
      try:
        row[backend] = seconds_per_chained_call(fn, arg_sets)
        row[backend + "_kernels"] = hlo_kernel_count(fn.lower(*arg_sets[0]).compile().as_text())
        if backend != "ragged_dot":  # The routed experts alone, without router and shared.
          row[backend + "_experts"] = seconds_per_chained_call(backends[backend], expert_args)
      except Exception as err:  # Record and go on: one failure must not hide the rest.
        print(f"{name} T={num_tokens} {backend}: {type(err).__name__}: {str(err)[:400]}",
              file=sys.stderr, flush=True)
        row.setdefault(backend, None)
    try:
      # The decode path's two GEMM kernels alone (slot plan and combine excluded).
      n = padded_tokens(num_tokens)

      def kernels(x, ids, weights, w_gate, w_up, w_down):
        plan = plan_decode(ids, weights, e)
        act = gate_up_decode(x, w_gate, w_up, plan.slot_expert_S, plan.num_slots_1, n,
                             gate_up_tiling)
        return down_decode(act, w_down, plan.weight_SR, plan.slot_expert_S, plan.num_slots_1,
                           down_tiling)

      row["decode_gemms"] = seconds_per_chained_call(kernels, expert_args)
      row["decode_gemms_bytes"] = experts_used * expert_bytes
      if check:
        got = backends["pallas"](*expert_args[0]).astype(jnp.float32)
        want = experts_reference(*expert_args[0]).astype(jnp.float32)
        row["rel_err_vs_reference"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    except Exception as err:
      print(f"{name} T={num_tokens} decode kernels/check: {type(err).__name__}: "
            f"{str(err)[:400]}", file=sys.stderr, flush=True)
    if num_tokens == tokens[0]:
      for backend, fn in layers_jit.items():
        try:
          count, kernel_us, events = profiled_kernels(fn.lower(*arg_sets[0]).compile(),
                                                      arg_sets[0])
          row[backend + "_profiled_kernels"] = count
          row[backend + "_profiled_kernel_us"] = kernel_us
          row[backend + "_profile"] = events
        except Exception as err:
          print(f"{name} profile {backend}: {type(err).__name__}: {str(err)[:300]}",
                file=sys.stderr, flush=True)
    for backend in layers_jit:
      if row.get(backend):
        row[backend + "_bw_frac"] = min_bytes / row[backend] / hbm_bw
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_profile")}), flush=True)
  del layers, states
  return rows


def decode_table(rows, hbm_bw):
  lines = [f"% of bandwidth: least bytes / time against {hbm_bw / 1e12:.2f} TB/s, measured in "
           "this run; kernels: launches per layer call (optimized HLO)", "",
           "| model | T | experts used | MB | pallas µs | % BW | kernels | experts µs | GEMMs µs "
           "| GEMM % BW | grouped µs | % BW | kernels | ragged_dot µs | % BW | kernels |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
           "| ---: | ---: | ---: | ---: |"]
  for r in rows:
    pct = lambda b: f"{100 * r[b + '_bw_frac']:.0f}" if r.get(b + "_bw_frac") else "-"
    gemm_pct = (f"{100 * r['decode_gemms_bytes'] / r['decode_gemms'] / hbm_bw:.0f}"
                if r.get("decode_gemms") else "-")
    lines.append(
        f"| {r['model']} | {r['T']} | {r['experts_used']:.1f} | {r['min_bytes'] / 1e6:.0f} "
        f"| {_fmt_us1(r.get('pallas'))} | {pct('pallas')} | {r.get('pallas_kernels', '-')} "
        f"| {_fmt_us1(r.get('pallas_experts'))} | {_fmt_us1(r.get('decode_gemms'))} "
        f"| {gemm_pct} | {_fmt_us1(r.get('grouped'))} | {pct('grouped')} "
        f"| {r.get('grouped_kernels', '-')} | {_fmt_us1(r.get('ragged_dot'))} "
        f"| {pct('ragged_dot')} | {r.get('ragged_dot_kernels', '-')} |")
  return "\n".join(lines)


def _fmt_us1(seconds):
  return "-" if not seconds else f"{seconds * 1e6:.1f}"


def main_decode(args):
  from jspec.bench.presets import PRESETS
  if args.tiny:
    cfg = PRESETS["tiny-moe"]
    models = {"tiny-moe": cfg.replace(moe=dict(shared_expert_intermediate_size=64))}
    tokens = (1, 3)
  else:
    models = {m: PRESETS[m] for m in (args.models.split(",") if args.models != ",".join(MODELS)
                                      else DECODE_MODELS)}
    tokens = tuple(int(t) for t in (args.tokens or ",".join(map(str, TOKENS))).split(",")) if args.tokens else DECODE_TOKENS
  copy_bw, read_bw = hbm_bandwidths(8 << 20 if args.tiny else 2 << 30)
  hbm_bw = max(copy_bw, read_bw)
  rows = []
  for name, cfg in models.items():
    rows += bench_decode_model(name, cfg, tokens, hbm_bw, args.check)
  with open(args.json, "w") as f:
    json.dump({"device": str(jax.devices()[0].device_kind), "hbm_copy_bw": copy_bw,
               "hbm_read_bw": read_bw, "hbm_ceiling": hbm_bw, "rows": rows}, f, indent=1)
  for r in rows:
    if r.get("pallas_profile"):
      for backend in ("pallas", "grouped", "ragged_dot"):
        events = r.get(backend + "_profile") or []
        print(f"{r['model']} T={r['T']} {backend}: {len(events)} kernels, "
              f"{sum(us for _, us in events):.1f} µs: "
              + ", ".join(f"{n[:40]} {us:.1f}" for n, us in events))
  print(f"HBM copy (read + write) {copy_bw / 1e12:.2f} TB/s, read-only {read_bw / 1e12:.2f} TB/s")
  print(decode_table(rows, hbm_bw))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--json", default="moe_kernels.json")
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--tokens", default=None, help="default: TOKENS, or DECODE_TOKENS")
  parser.add_argument("--tiny", action="store_true", help="small shapes (interpret mode on CPU)")
  parser.add_argument("--check", action="store_true", help="compare pallas with a baseline")
  parser.add_argument("--decode", action="store_true",
                      help="whole MoE layers at T = 1..32 (DECODE_MODELS presets)")
  args = parser.parse_args()
  print(f"devices: {jax.devices()}", flush=True)
  if args.decode:
    return main_decode(args)
  if args.tiny:
    models, tokens = {"tiny": (8, 2, 128, 64)}, (1, 8)
  else:
    models = {m: MODELS[m] for m in args.models.split(",")}
    tokens = tuple(int(t) for t in (args.tokens or ",".join(map(str, TOKENS))).split(","))
  copy_bw, read_bw = hbm_bandwidths(8 << 20 if args.tiny else 2 << 30)
  # The kernels mostly stream weights in: the faster of the two passes is the ceiling.
  hbm_bw = max(copy_bw, read_bw)
  tokamax_rd = None if args.tiny else _tokamax_ragged_dot()
  rows = []
  for name, shape in models.items():
    rows += bench_model(name, *shape, tokens, hbm_bw, tokamax_rd, args.check)
  with open(args.json, "w") as f:
    json.dump({"device": str(jax.devices()[0].device_kind), "hbm_copy_bw": copy_bw,
               "hbm_read_bw": read_bw, "hbm_ceiling": hbm_bw,
               "rows": rows}, f, indent=1)
  print(f"HBM copy (read + write) {copy_bw / 1e12:.2f} TB/s, read-only {read_bw / 1e12:.2f} TB/s")
  print(table(rows, hbm_bw))


if __name__ == "__main__":
  main()
