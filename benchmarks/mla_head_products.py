"""MLA's per-head latent products of one row (a batch-1 decode step), as the model runs them
against a Pallas (Triton) kernel of one program per head and column block:

  uk   q_lat [N, C] = q_nope [N, P] through W_UK [N, P, C] (the absorbed query)
  uv   out [N, V] = context [N, C] through W_UV [N, V, C] (the values of the latent context)

bf16 weights, and FP8 ones as checkpoints store them (e4m3 [N, P, C] / [N, V, C] with 128 x
128 block scales [N, P / 128, C / 128]). Why: at batch 1 XLA runs each as a reduction over
the weight (a one-row product is rewritten into a multiply and a sum), in FP8 widening and
scaling the e4m3 weight inside that fusion: DeepSeek-V3's two took 6.3 + 5.3 µs a layer in FP8
and 9.7 + 5.7 in bf16 on an H200 for 8.4 / 16.8 MB each (BENCHMARKS.md, "One row doubled by a
broadcast ..."), 1.4-2.9 TB/s. The kernel reads each weight tile once, widens it in
registers, multiplies by its row and sums (no tensor cores: one row).

A chain of `--layers` layers (uk then uv, each layer its own weights, so that they come from
HBM) in one jitted program; printed: µs a layer for each form and the bytes' rate. `--check`:
the kernel against the model's XLA form on small shapes in interpret mode (CPU).

    python benchmarks/mla_head_products.py
    python benchmarks/mla_head_products.py --check
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels.shared import dequantize

BLOCK = 128  # the FP8 checkpoints' block, both axes


def _kernel(x_ref, w_ref, *refs, block: int, fp8: bool, uk: bool):
  """Program (n, j): output block j of head n, its weight read in 128 x 128 tiles (times
  each tile's scale in FP8). uk: q_lat[n, columns j] = sum_p q[n, p] W[n, p, columns j]
  (the weight's rows contracted); uv: out[n, rows j] = sum_c W[n, rows j, c] context[n, c]
  (its columns)."""
  s_ref, o_ref = refs if fp8 else (None, refs[0])
  n, j = pl.program_id(0), pl.program_id(1)
  mine = pl.ds(j * block, block)
  acc = jnp.zeros((block,), jnp.float32)
  for b in range(w_ref.shape[1 if uk else 2] // BLOCK):
    theirs = pl.ds(b * BLOCK, BLOCK)
    x = x_ref[n, theirs].astype(jnp.float32)
    if uk:
      part = jnp.sum(x[:, None] * w_ref[n, theirs, mine].astype(jnp.float32), axis=0)
      scale = s_ref[n, b, j * block // BLOCK] if fp8 else None
    else:
      part = jnp.sum(w_ref[n, mine, theirs].astype(jnp.float32) * x[None, :], axis=1)
      scale = s_ref[n, j * block // BLOCK, b] if fp8 else None
    acc += part if scale is None else part * scale
  o_ref[n, mine] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("kind", "block", "interpret"))
def kernel_product(x_NK, w, scale, *, kind: str, block: int, interpret: bool = False):
  """uk: x [N, P], w [N, P, C] -> [N, C]; uv: x [N, C], w [N, V, C] -> [N, V]; in x's dtype.
  `scale` None for bf16 weights."""
  n, rows, cols = w.shape
  fp8 = scale is not None
  width = cols if kind == "uk" else rows
  return pl.pallas_call(
      functools.partial(_kernel, block=block, fp8=fp8, uk=kind == "uk"),
      out_shape=jax.ShapeDtypeStruct((n, width), x_NK.dtype), grid=(n, width // block),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name=f"mla_head_{kind}",
  )(x_NK, w, *((scale,) if fp8 else ()))


def xla_product(x_NK, w, scale, *, kind: str):
  """The model's form (jspec.models.mla: the weight dequantized to x's dtype, an einsum with
  [B, T] = [1, 1] in front)."""
  if scale is not None:
    w = dequantize(w, scale, 1, (BLOCK, BLOCK), x_NK.dtype, jnp)
  spec = "btnp,npc->btnc" if kind == "uk" else "btnc,nvc->btnv"
  return jnp.einsum(spec, x_NK[None, None], w)[0, 0]


def make_weights(rng, layers: int, n: int, p: int, v: int, c: int, fp8: bool):
  def one(shape):
    w = rng.standard_normal(shape).astype(np.float32) * c ** -0.5
    if not fp8:
      return jnp.asarray(w, jnp.bfloat16), None
    scale = rng.uniform(0.5, 2.0, (shape[0], shape[1] // BLOCK, shape[2] // BLOCK))
    return (jnp.asarray(w, jnp.float8_e4m3fn), jnp.asarray(scale, jnp.float32))
  return [(one((n, p, c)), one((n, v, c))) for _ in range(layers)]


def chain(product, weights):
  def run(q_NP):
    x = q_NP
    for (w_uk, s_uk), (w_uv, s_uv) in weights:
      lat = product(x, w_uk, s_uk, kind="uk")
      out = product(lat, w_uv, s_uv, kind="uv")
      x = x + out.astype(x.dtype) * 1e-3  # the next layer's query depends on this one
    return x
  return jax.jit(run)


def check():
  """Interpret mode, small shapes: the kernel within bf16 rounding of the model's form."""
  rng = np.random.default_rng(0)
  for fp8 in (False, True):
    n, p, v, c = 4, 128, 256, 384
    ((w_uk, s_uk), (w_uv, s_uv)), = make_weights(rng, 1, n, p, v, c, fp8)
    q = jnp.asarray(rng.standard_normal((n, p)), jnp.bfloat16)
    ctx = jnp.asarray(rng.standard_normal((n, c)), jnp.bfloat16)
    for kind, x, w, s, block in (("uk", q, w_uk, s_uk, 128), ("uv", ctx, w_uv, s_uv, 32)):
      got = np.asarray(kernel_product(x, w, s, kind=kind, block=block, interpret=True),
                       np.float32)
      want = np.asarray(xla_product(x, w, s, kind=kind), np.float32)
      np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
      print(f"check {'fp8' if fp8 else 'bf16'} {kind}: max |diff| "
            f"{np.abs(got - want).max():.4f} of max |value| {np.abs(want).max():.3f}")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=16)
  parser.add_argument("--heads", type=int, default=128)
  parser.add_argument("--uk-block", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--uv-block", type=int, nargs="+", default=[16, 32])
  parser.add_argument("--check", action="store_true")
  args = parser.parse_args()
  if args.check:
    check()
    return
  n, p, v, c = args.heads, 128, 128, 512  # DeepSeek-V3's heads
  print(f"device: {jax.devices()[0].device_kind}; {n} heads, P = V = {p}, C = {c}, "
        f"{args.layers} layers in a chain")
  print(f"{'weights':7s} {'form':22s} {'us a layer':>10s} {'TB/s':>6s}")
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((n, p)), jnp.bfloat16)
  for fp8 in (False, True):
    weights = make_weights(rng, args.layers, n, p, v, c, fp8)
    layer_bytes = 2 * n * p * c * (1 if fp8 else 2)
    forms = {"xla (the model's)": xla_product}
    for bk in args.uk_block:
      for bv in args.uv_block:
        def product(x, w, s, *, kind, bk=bk, bv=bv):
          return kernel_product(x, w, s, kind=kind, block=bk if kind == "uk" else bv)
        forms[f"kernel uk {bk} / uv {bv}"] = product
    outs = {}
    for name, product in forms.items():
      run = chain(product, weights)
      outs[name] = np.asarray(run(q), np.float32)
      for _ in range(3):
        run(q).block_until_ready()
      best = float("inf")
      for _ in range(10):
        start = time.perf_counter()
        run(q).block_until_ready()
        best = min(best, time.perf_counter() - start)
      per_layer = best / args.layers
      print(f"{'fp8' if fp8 else 'bf16':7s} {name:22s} {per_layer * 1e6:10.2f} "
            f"{layer_bytes / per_layer / 1e12:6.2f}", flush=True)
    ref = outs["xla (the model's)"]
    for name, out in outs.items():
      print(f"   {name}: max |diff| against xla {np.abs(out - ref).max():.4f}")


if __name__ == "__main__":
  main()
