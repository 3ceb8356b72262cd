"""Block-scaled FP8 weights (e4m3, one float32 scale per 128 x 128 block, the DeepSeek-V3 /
Qwen FP8 layout) against bf16 weights: x[M, K] @ w[K, N] as XLA compiles each formulation.

    python benchmarks/fp8_matmul.py --rows 1 8 64 512 4096

Formulations (each over --layers different weights in one program, so that the weights stream
from HBM as in a decode step and no launch sits between them):
  bf16      x @ w, w in bfloat16: the baseline
  dequant   x @ (bf16(w8) * scale broadcast over its block): XLA may fuse the conversion into
            the GEMM's operand load (then FP8 bytes are read) or write the bf16 weight first
  blocked   per 128-row block of K: partial[M, K/128, N] = x_k @ bf16(w8_k) in float32, then
            the sum over blocks weighted by the block's scale (the scale is applied after the
            product, where it is one number per block and column block)
  fp8       x cast to e4m3 and multiplied with w8 by the FP8 tensor cores (one scale for the
            whole tensor: not the block recipe, only the tensor cores' ceiling)
  kernel    jspec.pallas_kernels.fp8_gemm (rows <= 64), the weight in the checkpoint's [N, K]
            order: e4m3 tiles streamed by the TMA, widened in registers to bfloat16 (x's type,
            taken as it is)
  kernel_f16   the same kernel with x through float16 row scales (its route for float32 x)
  kernel_e4m3  the same kernel with x quantized per row and 128 columns to e4m3 (DeepSeek's
            act_quant): e4m3 x e4m3 wgmma on the tiles as the TMA leaves them
  prefill   jspec.pallas_kernels.fp8_prefill (any rows; the model's past 64): x quantized as
            kernel_e4m3's, e4m3 x e4m3 wgmma, in the form the kernel picks for the shape
  reduce    no dot: f32(w8[N, K]) * scale * x summed over K in one XLA reduction fusion (the
            weight in the checkpoint's order; each row of x reads the weight again)
Columns: µs per weight, the weight's bytes over that time (GB/s), the error against float32.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.pallas_kernels.fp8_gemm import Fp8Tiling, fp8_matmul
from jspec.pallas_kernels.fp8_prefill import PrefillTiling, fp8_prefill_matmul

BLOCK = 128
E4M3 = jnp.float8_e4m3fn


def block_scales(w_KN, block=BLOCK):
  """(w8 [K, N] e4m3, scale [K/block, N/block] float32): each block's amax maps to 448."""
  k, n = w_KN.shape
  blocks = w_KN.reshape(k // block, block, n // block, block)
  amax = jnp.max(jnp.abs(blocks), axis=(1, 3))
  scale = jnp.maximum(amax, 1e-12) / 448.0
  w8 = (blocks / scale[:, None, :, None]).astype(E4M3).reshape(k, n)
  return w8, scale


def expand(scale_KbNb, block=BLOCK):
  return jnp.repeat(jnp.repeat(scale_KbNb, block, axis=0), block, axis=1)


def bf16_dot(x, w, _):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def dequant_dot(x, w8, scale):
  w = (w8.astype(jnp.float32) * expand(scale)).astype(jnp.bfloat16)
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def blocked_dot(x, w8, scale):
  m, k = x.shape
  n = w8.shape[1]
  kb = k // BLOCK
  part_MKbN = jnp.einsum("mkb,kbn->mkn", x.reshape(m, kb, BLOCK),
                         w8.reshape(kb, BLOCK, n).astype(jnp.bfloat16),
                         preferred_element_type=jnp.float32)
  scale_KbN = jnp.repeat(scale, BLOCK, axis=1)
  return jnp.einsum("mkn,kn->mn", part_MKbN, scale_KbN).astype(jnp.bfloat16)


def fp8_dot(x, w8, _):
  return jnp.dot(x.astype(E4M3), w8, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def kernel_dot(x, w8, scale):
  return fp8_matmul(x, w8, scale)


def kernel_f16_dot(x, w8, scale):
  return fp8_matmul(x, w8, scale, activations="float16")


def kernel_e4m3_dot(x, w8, scale):
  return fp8_matmul(x, w8, scale, activations="e4m3")


def reduce_dot(x, w8_NK, scale_NbKb):
  full_NK = expand(scale_NbKb)
  prod_MNK = (w8_NK.astype(jnp.float32) * full_NK)[None] * x.astype(jnp.float32)[:, None, :]
  return jnp.sum(prod_MNK, axis=-1).astype(jnp.bfloat16)


FORMULATIONS = {"bf16": bf16_dot, "reduce": reduce_dot, "dequant": dequant_dot, "blocked": blocked_dot,
                "fp8": fp8_dot, "kernel": kernel_dot, "kernel_f16": kernel_f16_dot,
                "kernel_e4m3": kernel_e4m3_dot,
                "prefill": fp8_prefill_matmul}


def over_layers(fn):
  """All layers in one program, each weight its own argument: a scan over a stacked array
  would slice each weight out first, and a library GEMM reads a copy (three times the bytes:
  the first run of this benchmark measured that)."""
  @jax.jit
  def run(x, ws, scales):
    acc = 0.0
    for w, s in zip(ws, scales):
      acc = acc + fn(x, w, s).astype(jnp.float32)
    return acc
  return run


def timed(fn, *args, repeats=20):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 64, 512, 4096])
  parser.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x24576", "12288x4096"],
                      help="KxN: Qwen3-8B's q/o, fused gate/up, down")
  parser.add_argument("--layers", type=int, default=16)
  parser.add_argument("--formulations", nargs="+", default=list(FORMULATIONS))
  parser.add_argument("--kernel-splits", type=int, nargs="*", default=[],
                      help="also time the kernel at these K slice counts (default: its choice)")
  parser.add_argument("--kernel-tilings", nargs="*", default=[],
                      help="also time the kernel at these tilings: Fp8Tiling's fields in "
                           "order, e.g. 4 (its pipeline depth)")
  parser.add_argument("--prefill-tilings", nargs="*", default=[],
                      help="also time the prefill kernel's item form at these tilings: "
                           "PrefillTiling's fields in order, e.g. 3,2 (programs per SM, "
                           "pipeline depth), and its warp-specialized form")
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}", flush=True)
  print(f"{'K x N':>11s} {'rows':>5s} {'formulation':>11s} {'us/weight':>10s} {'GB/s':>7s} "
        f"{'vs bf16':>8s} {'rel err':>8s}", flush=True)
  for shape in args.shapes:
    k, n = map(int, shape.split("x"))
    keys = jax.random.split(jax.random.key(0), args.layers + 1)
    w8, scales, w_bf16 = [], [], []
    w8_NK, scales_NK = [], []  # the kernel's order: the checkpoint's [out, in]
    for i in range(args.layers):
      w8_i, scale_i = block_scales(jax.random.normal(keys[i], (k, n), jnp.float32) * k ** -0.5)
      w8.append(w8_i)
      scales.append(scale_i)
      w8_NK.append(jnp.array(w8_i.T))
      scales_NK.append(jnp.array(scale_i.T))
      w_bf16.append((w8_i.astype(jnp.float32) * expand(scale_i)).astype(jnp.bfloat16))
    for rows in args.rows:
      x = jax.random.normal(keys[-1], (rows, k), jnp.float32).astype(jnp.bfloat16)
      exact = sum(np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32)) for w in w_bf16)
      base = None
      variants = [(name, FORMULATIONS[name]) for name in args.formulations]
      variants += [(f"kernel/{s}", lambda x, w, sc, s=s: fp8_matmul(x, w, sc, splits=s))
                   for s in args.kernel_splits]
      for text in args.kernel_tilings:
        tiling = Fp8Tiling(*map(int, text.split(",")))  # the fields in order
        variants.append((f"k{text}", lambda x, w, sc, t=tiling: fp8_matmul(x, w, sc, tiling=t)))
        variants.append((f"k{text}/e4m3", lambda x, w, sc, t=tiling: fp8_matmul(
            x, w, sc, tiling=t, activations="e4m3")))
      for text in args.prefill_tilings:
        tiling = PrefillTiling(*map(int, text.split(",")))
        variants.append((f"prefill/{text}", lambda x, w, sc, t=tiling: fp8_prefill_matmul(
            x, w, sc, tiling=t, warp_specialized=False)))
      if args.prefill_tilings:
        variants.append(("prefill/ws", lambda x, w, sc: fp8_prefill_matmul(
            x, w, sc, warp_specialized=True)))
      for name, formulation in variants:
        if (name.startswith("k") and rows > 64) or (name == "reduce" and rows > 8):
          continue
        # the checkpoint's [N, K] order
        kernel = name.startswith(("k", "prefill")) or name == "reduce"
        weights = w_bf16 if name == "bf16" else (w8_NK if kernel else w8)
        weight_scales = scales_NK if kernel else scales
        fn = over_layers(formulation)
        try:
          seconds = timed(fn, x, weights, weight_scales) / args.layers
          out = np.asarray(fn(x, weights, weight_scales))
        except Exception as err:  # one formulation XLA refuses must not hide the others
          print(f"{shape:>11s} {rows:5d} {name:>11s} FAILED {err!r}"[:300], flush=True)
          continue
        base = seconds if name == "bf16" else base
        # fp8 scales by nothing (a ceiling, not the recipe): its error is not comparable.
        err = (float("nan") if name == "fp8"
               else float(np.abs(out - exact).max() / np.abs(exact).max()))
        nbytes = weights[0].size * weights[0].dtype.itemsize
        print(f"{shape:>11s} {rows:5d} {name:>11s} {1e6 * seconds:10.1f} "
              f"{nbytes / seconds / 1e9:7.0f} {seconds / base if base else float('nan'):7.2f}x "
              f"{err:8.1e}", flush=True)


if __name__ == "__main__":
  sys.exit(main())
