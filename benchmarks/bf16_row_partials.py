"""Tried on 2026-12-02 and not kept: a few-row product of bf16 weights [K, N] as K slices'
float32 partials [S, sum N, R], x read in place (fp8_block_kernel's persistent pipeline, with
no widening and no scales), for batch-1 steps on one GPU: Qwen3-30B-A3B's fused q / k / v (read
as partials by the q / k norm + RoPE kernel, as XLA's batched product's are) and its o_proj
(summed apart), without XLA's copy of the row and slice of the output.

    python benchmarks/bf16_row_partials.py --bench              # chained products, CUPTI
    python benchmarks/bf16_row_partials.py --patch qkv o -- benchmarks/call_and_step.py ...

BENCHMARKS.md, "Mosaic GPU kernels cost more a launch ...", has what it measured.
"""
import collections
import functools
import runpy
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.bench.profile import call_kernel_events
from jspec.pallas_kernels import decode_gemm, decode_routing, platform, skinny_gemm
from jspec.pallas_kernels.shared import smem_transforms
from jspec.sharding import tensor_parallel
COLS = 128


@functools.partial(jax.jit, static_argnames=("splits", "step_k", "stages", "rows_last"))
def bf16_partials(x_RK, ws_KN, splits, step_k=128, stages=4, rows_last=True):
  ws_KN = tuple(ws_KN)
  rows, k = decode_routing.padded_tokens(x_RK.shape[0]), x_RK.shape[1]
  ns = [w.shape[1] for w in ws_KN]
  dtype = x_RK.dtype
  k_steps = k // splits // step_k
  num_sms = platform.num_sms()
  col_blocks = [n // COLS for n in ns]
  item_starts = np.cumsum([0] + [splits * c for c in col_blocks]).tolist()
  col_offsets = np.cumsum([0] + col_blocks).tolist()

  def locate(sm, step):
    item = sm + lax.div(step, jnp.int32(k_steps)) * num_sms
    weight, start, blocks, offset = (jnp.int32(0), jnp.int32(0), jnp.int32(col_blocks[0]),
                                     jnp.int32(0))
    for j in range(1, len(ns)):
      later = item >= item_starts[j]
      weight = jnp.where(later, j, weight)
      start = jnp.where(later, item_starts[j], start)
      blocks = jnp.where(later, col_blocks[j], blocks)
      offset = jnp.where(later, col_offsets[j], offset)
    local = item - start
    return (weight, lax.div(local, blocks), offset + lax.rem(local, blocks),
            lax.rem(step, jnp.int32(k_steps)))

  def body(x_ref, *refs):
    *w_refs, out_ref = refs

    def scoped(x_smem, w_smem, o_smem, loaded):
      sm = lax.axis_index("sm")
      steps = lax.div(item_starts[-1] - sm + (num_sms - 1), jnp.int32(num_sms)) * k_steps

      def fetch(step, slot):
        weight, split, col, k_step = locate(sm, step)
        k_block = split * k_steps + k_step
        barrier = loaded.at[slot]
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, rows), pl.ds(k_block * step_k, step_k)],
                                x_smem.at[slot], barrier)
        for j, w_ref in enumerate(w_refs):
          @pl.when(weight == j)
          def _(w_ref=w_ref, j=j):
            plgpu.copy_gmem_to_smem(
                w_ref.at[pl.ds(k_block * step_k, step_k), pl.ds((col - col_offsets[j]) * COLS,
                                                                COLS)],
                w_smem.at[slot], barrier)

      for step in range(stages):
        pl.when(step < steps)(functools.partial(fetch, jnp.int32(step), step))

      def run_step(step, total):
        slot = lax.rem(step, jnp.int32(stages))
        plgpu.barrier_wait(loaded.at[slot])
        _, split, col, k_step = locate(sm, step)

        def mma(acc):
          plgpu.wgmma(acc, w_smem.at[slot].T, x_smem.at[slot].T)
          return acc[...]

        total = total + pl.run_scoped(mma, plgpu.ACC((COLS, rows)))
        last = k_step == k_steps - 1

        @pl.when(last)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          if rows_last:
            o_smem[...] = total
          else:
            o_smem.T[...] = total
          plgpu.commit_smem()
          out = (out_ref.at[split, pl.ds(col * COLS, COLS)] if rows_last
                 else out_ref.at[split, :, pl.ds(col * COLS, COLS)])
          plgpu.copy_smem_to_gmem(o_smem, out)

        pl.when(step + stages < steps)(functools.partial(fetch, step + stages, slot))
        restart = lax.broadcast_in_dim(last, total.shape, ())
        return lax.select(restart, jnp.zeros_like(total), total)

      lax.fori_loop(jnp.int32(0), steps, run_step, decode_gemm._zeros(1, (COLS, rows))[0])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, rows, step_k), dtype, transforms=smem_transforms(step_k, dtype)),
        plgpu.SMEM((stages, step_k, COLS), dtype, transforms=smem_transforms(COLS, dtype)),
        (plgpu.SMEM((COLS, rows), jnp.float32, transforms=smem_transforms(rows, jnp.float32))
         if rows_last else plgpu.SMEM((rows, COLS), jnp.float32,
                                      transforms=smem_transforms(COLS, jnp.float32))),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    )

  shape = (splits, sum(ns), rows) if rows_last else (splits, rows, sum(ns))
  return decode_gemm._kernel_call(body, shape, jnp.float32,
                                  f"bf16_row_partials_{k}x{sum(ns)}")(x_RK, *ws_KN)


LAYERS = 24
bar = jax.lax.optimization_barrier

def chain(route, k, n, s=None, sk=128, st=4):
  def f(x, ws):
    for w in ws:
      if route == "two_rows":           # skinny_gemm's default one-row route
        y = bar(jnp.dot(jnp.stack([x[0], x[0]]), w)[0])
      elif route == "xla_dot":          # XLA's own one-row dot
        y = bar(jnp.dot(x[0], w))
      elif route == "xla_slices":       # k_slice_partials, consumed as partials
        parts = bar(tensor_parallel.k_slice_partials(x, w, s, rows_last=True))
        y = jnp.sum(parts[:, :, 0], axis=0)
      elif route == "kernel_rows_last":  # consumed as partials (the q / k / v kernel's form)
        parts = bar(bf16_partials(x, (w,), s, step_k=sk, stages=st, rows_last=True))
        y = jnp.sum(parts[:, :, 0], axis=0)
      else:                              # kernel_rows_first: summed apart, as o_proj would be
        parts = bf16_partials(x, (w,), s, step_k=sk, stages=st, rows_last=True)
        y = bar(jnp.sum(parts[:, :, 0], axis=0).astype(x.dtype))
      x = (x * (1 + 1e-3 * jnp.mean(y.astype(jnp.float32)))).astype(x.dtype)
    return x
  return jax.jit(f)

def kind(name):
  if "bf16_row_partials" in name or "gemm" in name or "dot" in name or "cublas" in name.lower():
    return "product"
  return "other"

def main():
  key = jax.random.key(0)
  x = jax.random.normal(key, (1, 4096), jnp.bfloat16)
  first, last = "kernel_rows_first", "kernel_rows_last"
  cases = {
      "a3b o 4096x2048": (4096, 2048, ["two_rows", (first, 8), (first, 4)]),
      "a3b qkv 2048x5120": (2048, 5120, [("xla_slices", 4), (last, 4), (last, 2)]),
      "8b qkv 4096x6144": (4096, 6144, [("xla_slices", 4), (last, 4), (last, 8)]),
      "8b o 4096x4096": (4096, 4096, ["xla_dot", (first, 8), (first, 4)]),
      "8b down 12288x4096": (12288, 4096, ["xla_dot", (first, 8), (first, 4)]),
  }
  print(f"{'shape':20s} {'route':18s} {'S':>2s} {'sk':>4s} {'st':>3s} {'product':>8s} "
        f"{'other':>6s} {'span/layer':>10s}")
  for label, (k, n, routes) in cases.items():
    ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.02
          for i in range(LAYERS)]
    xk = jnp.tile(x, (1, 3))[:, :k]
    configs = []
    for r in routes:
      if isinstance(r, str):
        configs.append((r, None, 0, 0))
      elif r[0].startswith("kernel"):
        configs += [(r[0], r[1], sk, st) for sk, st in ((128, 4), (256, 3))]
      else:
        configs.append((r[0], r[1], 0, 0))
    for route, s, sk, st in configs:
      try:
        fn = chain(route, k, n, s, sk or 128, st or 4)
        for rep in range(2):
          ev = call_kernel_events(fn, xk, ws)
          tot = collections.defaultdict(float)
          for a, b, name in ev:
            tot[kind(name)] += (b - a) / 1e3 / LAYERS
          span = (ev[-1][1] - ev[0][0]) / 1e3 / LAYERS
          print(f"{label:20s} {route:18s} {s or 0:2d} {sk:4d} {st:3d} {tot['product']:8.2f} "
                f"{tot['other']:6.2f} {span:10.2f}", flush=True)
        print("   kernels:", [(nm[:34], c) for nm, c in collections.Counter(
            nm for _, _, nm in ev).most_common(5)])
      except Exception as err:
        print(label, route, s, sk, st, "FAILED", type(err).__name__, str(err)[:300])



def patch(which):
  """Routes one-row q / k / v slices ("qkv") and one-row two-row products ("o") to the kernel."""
  slices, two_rows = tensor_parallel.k_slice_partials, skinny_gemm._two_rows

  def k_slice_partials(x_MK, w_KN, count, rows_last=False):
    if "qkv" in which and x_MK.shape[0] == 1 and rows_last and platform.on_gpu():
      return bf16_partials(x_MK, (w_KN,), count)
    return slices(x_MK, w_KN, count, rows_last)

  def one_row(x_K, w_KN):
    if "o" in which and platform.on_gpu():
      return jnp.sum(bf16_partials(x_K[None], (w_KN,), 8)[:, :, 0], axis=0).astype(x_K.dtype)
    return two_rows(x_K, w_KN)

  tensor_parallel.k_slice_partials, skinny_gemm._two_rows = k_slice_partials, one_row


if __name__ == "__main__":
  if sys.argv[1] == "--bench":
    main()
  else:
    split = sys.argv.index("--")
    patch(set(sys.argv[2:split]))
    sys.argv = sys.argv[split + 1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
