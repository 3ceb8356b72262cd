"""What holds the few-row FP8 product (jspec.pallas_kernels.fp8_gemm) at its speed: the kernel
against XLA reading the same bytes, and against itself with its products taken out.

    PYTHONPATH=. python3 benchmarks/fp8_stream.py

Each row is one product of one row of x (a decode step at batch 1) against Qwen3-8B's weights,
timed as --layers different weights in one program (as benchmarks/fp8_matmul.py does), µs per
weight and the weight's bytes over that time:
  bf16 dot            XLA's product with the weight in bfloat16 (the baseline)
  read bf16 / e4m3    XLA reading the weight's bytes as uint32 and summing a bit of each: a
                      read-bandwidth probe at this weight's size
  fp8_matmul          the kernel with the XLA work around it (x's conversion, the partials' sum)
  kernel a,s          the kernel alone (its float32 partials), a blocks per pipeline step and s
                      stages, on bfloat16 x (the weight tile widened e4m3 -> float16 ->
                      float32 -> bfloat16 in registers)
  kernel f16 a,s      the same on float16 x (one conversion, e4m3 -> float16)
  no products a,s     the same pipeline with the block products replaced by zeros: the TMA
                      stream and the pipeline's waits alone
  xN programs         N programs per SM (more warps to hide latency; fewer stages fit)
Read with the probes: where "no products" is no faster than the kernel, the products are not
what holds it, and what a weight costs beyond its bytes at the probe's rate is per call.
--tiny runs small shapes in interpret mode on a CPU (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import fp8_block_kernel, fp8_gemm, fp8_layout, platform
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, Fp8Tiling

from fp8_matmul import over_layers, timed  # this folder's: benchmarks run as scripts

E4M3 = jnp.float8_e4m3fn


def _zero_products(w_smem, x_smem, per_step, rows, fp8_x):
  return [plgpu.layout_cast(jnp.zeros((BLOCK, rows), jnp.float32), plgpu.Layout.WGMMA)
          for _ in range(per_step)]


def kernel_alone(splits: int, tiling: Fp8Tiling, products: bool = True, per_sm: int = 1,
                 x_dtype=jnp.bfloat16):
  """The kernel's partials for x (bfloat16, as the model's, unless x_dtype says), traced with
  the block products (or zeros) and the persistent grid (`per_sm` programs per SM) patched in
  for this trace."""
  sms = platform.num_sms()

  def fn(x, w8, scale):
    saved = platform.num_sms, fp8_block_kernel.block_products
    platform.num_sms = lambda: sms * per_sm
    if not products:
      fp8_block_kernel.block_products = _zero_products
    try:
      parts = fp8_block_kernel.partials(x.astype(x_dtype), (w8,),
                                        [fp8_gemm.scale_lanes(scale)], None, splits, tiling)
    finally:
      platform.num_sms, fp8_block_kernel.block_products = saved
    return jnp.sum(parts[:, :8, :1])  # a corner: no pass over the partials
  return fn


def _fp8_weights(key, count, n, k):
  w8s, scales, bf16s = [], [], []
  for i, key_i in enumerate(jax.random.split(key, count)):
    w = jax.random.normal(key_i, (n, k), jnp.float32) * k ** -0.5
    blocks = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=(1, 3)) / 448.0
    w8s.append((blocks / scale[:, None, :, None]).astype(E4M3).reshape(n, k))
    scales.append(scale)
    bf16s.append(w.T.astype(jnp.bfloat16))
  return w8s, scales, bf16s


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="+", default=["4096x24576", "12288x4096", "4096x4096"],
                      help="KxN: Qwen3-8B's fused gate/up, down, q/o")
  parser.add_argument("--layers", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--tiny", action="store_true", help="small shapes, interpret mode")
  args = parser.parse_args()
  if args.tiny:
    args.shapes, args.layers, args.repeats = ["512x256"], 2, 1
  print(f"device: {jax.devices()[0].device_kind}, {platform.num_sms()} SMs", flush=True)
  rows = []
  for shape in args.shapes:
    k, n = map(int, shape.split("x"))
    w8s, scales, bf16s = _fp8_weights(jax.random.key(0), args.layers, n, k)
    x = jax.random.normal(jax.random.key(1), (1, k), jnp.float32).astype(jnp.bfloat16)
    splits = fp8_layout.choose_splits(k, n, platform.num_sms())
    as_u32 = lambda w: lax.bitcast_convert_type(
        w.reshape(w.shape[0], -1, 4 // w.dtype.itemsize), jnp.uint32)
    variants = [
        ("bf16 dot", lambda x, w, s: jnp.sum(jnp.dot(x, w, preferred_element_type=jnp.float32)),
         bf16s),
        ("read bf16", lambda x, w, s: jnp.sum(as_u32(w) & 1), bf16s),
        ("read e4m3", lambda x, w, s: jnp.sum(as_u32(w) & 1), w8s),
        ("fp8_matmul", lambda x, w, s: jnp.sum(fp8_gemm.fp8_matmul(x, w, s).astype(jnp.float32)),
         w8s),
    ]
    for per_step, stages in ((2, 4), (1, 4), (4, 3)):
      variants.append((f"kernel {per_step},{stages}",
                       kernel_alone(splits, Fp8Tiling(per_step, stages)), w8s))
    variants.append(("kernel f16 2,4",
                     kernel_alone(splits, Fp8Tiling(2, 4), x_dtype=jnp.float16), w8s))
    variants.append(("no products 2,4", kernel_alone(splits, Fp8Tiling(2, 4), False), w8s))
    for per_sm, stages in ((2, 4), (3, 3)):
      more = fp8_layout.choose_splits(k, n, platform.num_sms() * per_sm)
      variants.append((f"x{per_sm} programs 1,{stages}",
                       kernel_alone(more, Fp8Tiling(1, stages), per_sm=per_sm), w8s))
      variants.append((f"x{per_sm} no products 1,{stages}",
                       kernel_alone(more, Fp8Tiling(1, stages), False, per_sm), w8s))
    for name, fn, weights in variants:
      seconds = timed(over_layers(fn), x, weights, scales, repeats=args.repeats) / args.layers
      nbytes = weights[0].size * weights[0].dtype.itemsize
      rows.append(f"{shape:>11s} {name:>26s} {1e6 * seconds:9.1f} {nbytes / seconds / 1e9:7.0f}")
      print(rows[-1], flush=True)
  print(f"\n{'K x N':>11s} {'variant':>26s} {'µs':>9s} {'GB/s':>7s}")
  print("\n".join(rows))


if __name__ == "__main__":
  sys.exit(main())
