"""MLA decode attention over the latent cache: the flash-decoding kernel against XLA's path.

    PYTHONPATH=. python3 benchmarks/mla_decode.py --out benchmarks/results/mla_decode.json
    PYTHONPATH=. python3 benchmarks/mla_decode.py --smoke          # tiny shapes, CPU (interpret)

DeepSeek-V3's absorbed attention (128 heads, latent rows of L = 576 = 512 + 64, bf16) for a
window of T tokens (1: decode; 4: a verify window of k = 3) ending at each context, per batch:
  xla     jspec.models.mla.latent_attention over the cache bucket (the path before the kernels)
  kernel  jspec.pallas_kernels.mla_decode.mla_decode's Triton form (split-KV, valid slots
          only, merge)
  wgmma   its Mosaic GPU form (jspec.pallas_kernels.mla_decode_wgmma), 64-row tiles
First each is checked against a float32 evaluation (ragged positions, an idle sequence).
Each timed program runs the attention over `--copies` different caches, so that the caches
together overflow L2 as a model's layers do, `--chain` times in turn, each call's query
waiting for the previous call's output as a step's layers wait; µs are per attention call,
medians of batches of programs after warm-up. (Until 2026-11-29 a program ran each cache
once, its 2-3 calls independent; at 128 heads, batch 16 / 4k both ways read 56-57 µs a call
where the profiler sees 50 µs of the call's two kernels: the rest is the gaps between
kernels, BENCHMARKS.md.) Columns: µs, latent GB/s (each sequence's valid rows, read once,
over the time), that as % of the copy probe (a large device copy, bytes read + written),
the time over its floor (the larger of that read and the FLOPs at a bf16 matmul probe's
rate), and verify(4) / decode of the same batch and context. `--sweep` also times the
kernel's tilings (MLATiling's fields in order) at the first context.

At 128 heads the attention is compute-bound on Hopper: per latent row (1152 bytes) a decode
step does 128 x 2 x (576 + 512) = 279 k FLOPs, 242 FLOP/byte, above an H200's ~165 (790
TFLOP/s over 4.8 TB/s), and a verify window of 4 four times that. `--heads 16` (a tp = 8
shard) is the memory-bound case.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.roofline import hbm_bandwidth, seconds_per_call
from jspec.models.mla import latent_attention
from jspec.pallas_kernels import mla_decode as mla_decode_lib
from jspec.pallas_kernels import platform
from jspec.pallas_kernels.mla_decode import (MLATiling, choose_splits, min_split_slots,
                                             mla_decode, rows_block)

SWEEP = ["64,32,8,2,1", "64,64,8,3,1", "32,64,4,2,1", "16,64,4,2,1", "16,64,4,3,2",
         "64,64,8,2,2", "16,128,8,2,1"]
L2_BYTES = 60 << 20  # an H200's (an H100's is 50 MB): copies together must exceed it


def _caches(key, batch, width, slots, copies, dtype):
  """`copies` random caches [B, S, L] of unit-scale rows (queries are drawn at L^-1/4, so
  that the softmax is neither flat nor one-hot)."""
  keys = jax.random.split(key, copies)
  draw = jax.jit(lambda k: jax.random.normal(k, (batch, slots, width), jnp.float32).astype(dtype))
  return [draw(k) for k in keys]


def _positions(batch, context, width):
  """The window's positions: it ends at `context` tokens for every sequence."""
  return jnp.broadcast_to(context - width + jnp.arange(width, dtype=jnp.int32), (batch, width))


PATHS = ("xla", "kernel", "wgmma")


def _chained(attend, repeats: int):
  """A program of `repeats` rounds over the caches, each call's query waiting for the previous
  call's output, as a step's layers wait for each other: the program's launch and the glue
  it hoists out of the loop (the positions, shared by a step's layers) weigh on its many calls
  as on a step's, not on a few calls each. The wait is one element of the query replaced in
  place by itself plus 0 x one element of the output: a one-thread kernel a call (about a
  microsecond, counted in the call's time). An optimization barrier alone did not hold: XLA
  dropped the calls whose outputs only it read."""
  @jax.jit
  def program(q_BTNL, caches, positions_BT):
    def body(_, carry):
      q_BTNL, out = carry
      for cache in caches:
        out = attend(q_BTNL, cache, positions_BT)
        q_BTNL = q_BTNL.at[0, 0, 0, 0].add(0 * out[0, 0, 0, 0].astype(q_BTNL.dtype))
      return q_BTNL, out
    first = attend(q_BTNL, caches[0], positions_BT)
    return jax.lax.fori_loop(0, repeats, body, (q_BTNL, first))[1]
  return program


def _programs(latent_dim, scale, kv_window, tiling, repeats: int):
  """(xla, kernel, wgmma): each runs the attention over every cache `repeats` times in turn
  (`_chained`; 1 + repeats x caches calls a program)."""
  def xla(q_BTNL, cache, positions_BT):
    return latent_attention(q_BTNL, cache[:, :kv_window], positions_BT, scale)[..., :latent_dim]

  def kernel(q_BTNL, cache, positions_BT):
    return mla_decode(q_BTNL, cache, positions_BT, latent_dim=latent_dim, scale=scale,
                      tiling=tiling, form="triton")

  def wgmma(q_BTNL, cache, positions_BT):
    return mla_decode(q_BTNL, cache, positions_BT, latent_dim=latent_dim, scale=scale,
                      form="wgmma")
  return tuple(_chained(fn, repeats) for fn in (xla, kernel, wgmma))


def check(args, dtype) -> dict:
  """Kernel and XLA path against float32 at ragged positions, one sequence idle (position -1
  in the kernel; XLA's path gives NaN there, so it is compared on the others)."""
  heads, c, r = args.heads[0], args.latent_dim, args.rope_dim
  context = args.context[0]
  slots = context + args.slack
  b, t = 4, 4
  kq, kc = jax.random.split(jax.random.key(1))
  q = (jax.random.normal(kq, (b, t, heads, c + r), jnp.float32) * (c + r) ** -0.25).astype(dtype)
  cache = jax.random.normal(kc, (b, slots, c + r), jnp.float32).astype(dtype)
  last = np.array([context - 1, context // 3, 37, -1 + t])
  positions = jnp.asarray(last[:, None] - t + 1 + np.arange(t), jnp.int32)
  positions = positions.at[3].set(-1)  # idle
  scale = float((c + r) ** -0.5)
  with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
    exact = np.asarray(latent_attention(q.astype(jnp.float32), cache.astype(jnp.float32),
                                        positions, scale)[..., :c])
  xla = np.asarray(latent_attention(q, cache, positions, scale)[..., :c].astype(jnp.float32))
  result = dict(xla_max_error=float(np.abs(xla[:3] - exact[:3]).max()),
                scale_of_outputs=float(np.abs(exact[:3]).max()))
  tol = 4 * result["xla_max_error"] + 1e-5
  ok = True
  for form in ("triton", "wgmma"):
    errors = {}
    for splits in (None, 1, 3):  # the default, and with and without the merge
      out = np.asarray(mla_decode(q, cache, positions, latent_dim=c, scale=scale, splits=splits,
                                  form=form).astype(jnp.float32))
      errors[str(splits)] = float(np.abs(out[:3] - exact[:3]).max())
      ok = ok and bool(np.all(out[3] == 0)) and errors[str(splits)] <= tol
    result[f"{form}_max_error_by_splits"] = errors
  result["ok"] = ok
  return result


def triton_splits(batch, rows, slots, tiling, latent_dim, row_bytes) -> int:
  """The chunks per sequence the Triton form picks (the row reports them)."""
  tile = rows_block(rows, tiling, batch)
  return choose_splits(batch, -(-rows // tile), slots, platform.num_sms(),
                       tiling.programs_per_sm,
                       min_slots=min_split_slots(tile, latent_dim, row_bytes))


def matmul_flops(size: int) -> float:
  """bf16 tensor-core FLOP/s of a size^3 matrix product on random data: the compute probe."""
  a = jax.random.normal(jax.random.key(2), (size, size), jnp.float32).astype(jnp.bfloat16)
  b = (a + 1).astype(jnp.bfloat16)
  dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32
                                     ).astype(jnp.bfloat16))
  return 2 * size ** 3 / seconds_per_call(dot, [(a, b), (b, a)])


def attention_flops(batch, context, width, heads, latent_dim, rope_dim) -> int:
  """Multiply-adds x 2 of the absorbed attention: per query row and visible slot, the score
  over L = C + R and the weighted sum over C."""
  return 2 * batch * width * heads * context * (2 * latent_dim + rope_dim)


def _timing(seconds, latent_bytes, flops, probe):
  """µs, latent GB/s, that over the copy probe, and the time over its floor: the larger of
  the latent read at the probe's bandwidth and the products at the matmul probe's rate."""
  floor = max(latent_bytes / probe["copy"], flops / probe["matmul_flops"])
  return dict(us=1e6 * seconds, latent_gbps=latent_bytes / seconds / 1e9,
              probe_fraction=latent_bytes / seconds / probe["copy"],
              floor_fraction=floor / seconds)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--width", type=int, nargs="+", default=[1, 4],
                      help="window tokens T: 1 = decode, k + 1 = a verify window")
  parser.add_argument("--heads", type=int, nargs="+", default=[128],
                      help="query heads per device: 128 whole, 16 on a tp = 8 shard")
  parser.add_argument("--latent-dim", type=int, default=512)
  parser.add_argument("--rope-dim", type=int, default=64)
  parser.add_argument("--slack", type=int, default=128,
                      help="cache slots past the context (a capped bucket, as serving has)")
  parser.add_argument("--chain", type=int, default=4,
                      help="rounds over the caches a timed program runs (see above)")
  parser.add_argument("--copies", type=int, default=0,
                      help="caches per timed program (0: enough to overflow L2 three times)")
  parser.add_argument("--tiling", default=None,
                      help="MLATiling's fields in order, e.g. 64,32,8,2,1")
  parser.add_argument("--sweep", action="store_true",
                      help="also time the tilings in SWEEP (first context; the first and "
                           "last batch)")
  parser.add_argument("--budget-s", type=float, default=240.0,
                      help="skip the remaining sweep past this many seconds")
  parser.add_argument("--bandwidth-bytes", type=int, default=2 << 30)
  parser.add_argument("--matmul-size", type=int, default=8192)
  parser.add_argument("--wgmma-parts", choices=["cache", "float32"], default=None,
                      help="the wgmma form's chunks in the cache's dtype or float32 "
                           "(mla_decode.WGMMA_CACHE_DTYPE_PARTS; default: the library's)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes for a CPU check (the kernel interpreted)")
  parser.add_argument("--out", default=None, help="write the results as JSON here")
  args = parser.parse_args(argv)
  sweep = SWEEP if args.sweep else []
  if args.wgmma_parts:
    mla_decode_lib.WGMMA_CACHE_DTYPE_PARTS = args.wgmma_parts == "cache"
  if args.smoke:
    # The smallest rows the wgmma form takes (C/2 and R whole 64-column tiles, 64-slot blocks).
    args.context, args.batch, args.heads = [72], [2], [8]
    args.latent_dim, args.rope_dim, args.slack = 128, 64, 56
    args.copies, args.bandwidth_bytes, args.matmul_size = args.copies or 2, 16 << 20, 256
    sweep = ["16,16,4,1,1"] if args.sweep else []
  # The smoke run only shows that every program runs and is timed: one warm-up, one pair of batches.
  timer = (functools.partial(seconds_per_call, warmup=1, batches=1) if args.smoke
           else seconds_per_call)
  dtype = jnp.bfloat16
  tiling = MLATiling(*map(int, args.tiling.split(","))) if args.tiling else MLATiling()
  device = jax.devices()[0]
  started = time.perf_counter()
  print(f"device: {device.device_kind}; kernel "
        f"{'compiled' if platform.on_gpu() else 'interpreted'}; {tiling}; wgmma partials in "
        f"{'the cache dtype' if mla_decode_lib.WGMMA_CACHE_DTYPE_PARTS else 'float32'}",
        flush=True)
  result = dict(device=device.device_kind, heads=args.heads, latent_dim=args.latent_dim,
                rope_dim=args.rope_dim, dtype="bfloat16", tiling=str(tiling), rows=[], sweep=[],
                wgmma_parts="cache" if mla_decode_lib.WGMMA_CACHE_DTYPE_PARTS else "float32")

  def save():
    if args.out:
      os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
      with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
      os.replace(args.out + ".tmp", args.out)

  result["check"] = check(args, dtype)
  print(f"check: {result['check']}", flush=True)
  save()
  probe = dict(hbm_bandwidth(args.bandwidth_bytes), matmul_flops=matmul_flops(args.matmul_size))
  result["probe"] = probe
  print(f"probe: copy {probe['copy'] / 1e9:.0f} GB/s (read + written), read "
        f"{probe['read'] / 1e9:.0f} GB/s, bf16 matmul {probe['matmul_flops'] / 1e12:.0f} "
        "TFLOP/s", flush=True)
  save()
  width_l = args.latent_dim + args.rope_dim
  scale = float(width_l ** -0.5)
  itemsize = jnp.dtype(dtype).itemsize
  for heads in args.heads:
    for context in args.context:
      slots = context + args.slack
      for batch in args.batch:
        cache_bytes = batch * slots * width_l * itemsize
        copies = args.copies or int(min(16, max(2, -(-3 * L2_BYTES // cache_bytes))))
        caches = _caches(jax.random.key(batch), batch, width_l, slots, copies, dtype)
        for width in args.width:
          q = (jax.random.normal(jax.random.key(context + width), (batch, width, heads, width_l),
                                 jnp.float32) * width_l ** -0.25).astype(dtype)
          positions = _positions(batch, context, width)
          latent = batch * context * width_l * itemsize
          flops = attention_flops(batch, context, width, heads, args.latent_dim, args.rope_dim)
          rows = width * heads
          row = dict(heads=heads, batch=batch, context=context, width=width, copies=copies,
                     latent_bytes=latent, flops=flops,
                     splits=triton_splits(batch, rows, slots, tiling, args.latent_dim,
                                          width_l * itemsize))
          repeats = 1 if args.smoke else args.chain
          calls = 1 + repeats * copies
          for name, fn in zip(PATHS, _programs(args.latent_dim, scale, slots, tiling, repeats)):
            try:
              seconds = timer(fn, [(q, caches, positions)]) / calls
            except Exception as err:  # one program failing must not hide the others
              row[name] = dict(error=repr(err)[:500])
              print(f"{name} FAILED at H={heads} B={batch} ctx={context} T={width}: "
                    f"{err!r}"[:500], flush=True)
              continue
            row[name] = _timing(seconds, latent, flops, probe)
          result["rows"].append(row)
          print(row_line(row), flush=True)
          in_sweep = context == args.context[0] and batch in (args.batch[0], args.batch[-1])
          for text in sweep if in_sweep else []:
            if time.perf_counter() - started > args.budget_s:
              result["sweep_cut_at_budget"] = True
              break
            _, program, _ = _programs(args.latent_dim, scale, slots,
                                      MLATiling(*map(int, text.split(","))), repeats)
            entry = dict(heads=heads, batch=batch, context=context, width=width, tiling=text)
            try:
              seconds = timer(program, [(q, caches, positions)]) / calls
              entry.update(_timing(seconds, latent, flops, probe))
              print(f"  tiling {text}: {1e6 * seconds:9.1f} us", flush=True)
            except Exception as err:  # a tiling Triton refuses must not hide the others
              entry["error"] = repr(err)[:500]
              print(f"  tiling {text}: FAILED {err!r}"[:300], flush=True)
            result["sweep"].append(entry)
          save()
        del caches
  result["seconds"] = time.perf_counter() - started
  save()
  print_table(result, args.width)
  return 0 if result["check"]["ok"] else 1


def row_line(r) -> str:
  text = f"H={r['heads']:3d} B={r['batch']:3d} ctx={r['context']:6d} T={r['width']} K={r['splits']:3d}:"
  for name in PATHS:
    t = r[name]
    text += (f" {name} FAILED" if "error" in t else
             f" {name} {t['us']:9.1f} us ({100 * t['probe_fraction']:5.1f}% of the copy probe, "
             f"{100 * t['floor_fraction']:5.1f}% of the floor)")
  return text


def print_table(result, widths):
  verify = max(widths)
  by_key = {(r["heads"], r["batch"], r["context"], r["width"]): r for r in result["rows"]
            if all("error" not in r[name] for name in PATHS)}
  probe = result["probe"]
  print(f"\nMLA decode attention, {result['device']}, L = {result['latent_dim']} + "
        f"{result['rope_dim']}, bf16; probes: copy {probe['copy'] / 1e9:.0f} GB/s, matmul "
        f"{probe['matmul_flops'] / 1e12:.0f} TFLOP/s; check "
        f"{'ok' if result['check']['ok'] else 'FAILED'}; floor = max(latent / copy probe, "
        "FLOPs / matmul probe)")
  print(f"| heads | batch | context | T | XLA µs | Triton µs | wgmma µs | wgmma / XLA | wgmma / "
        f"Triton | wgmma GB/s | wgmma % of probe | wgmma % of floor | verify({verify})/decode "
        "XLA | Triton | wgmma |")
  print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |")
  for (h, b, ctx, t), r in by_key.items():
    decode = by_key.get((h, b, ctx, 1))
    ratio = lambda name: (f"{r[name]['us'] / decode[name]['us']:.2f}x"
                          if decode and t == verify and t != 1 else "")
    x, k, w = r["xla"], r["kernel"], r["wgmma"]
    print(f"| {h} | {b} | {ctx} | {t} | {x['us']:.1f} | {k['us']:.1f} | {w['us']:.1f} | "
          f"{x['us'] / w['us']:.2f}x | {k['us'] / w['us']:.2f}x | {w['latent_gbps']:.0f} | "
          f"{100 * w['probe_fraction']:.1f}% | {100 * w['floor_fraction']:.1f}% | "
          f"{ratio('xla')} | {ratio('kernel')} | {ratio('wgmma')} |")

if __name__ == "__main__":
  sys.exit(main())
