"""A one-row product's row doubled two ways for XLA's GEMM, in a chain of 48 products of one
jitted program: `jnp.concatenate` (the form before 2026-12-02) against `jnp.broadcast_to`
(skinny_gemm.twice). Per form: the time a product, the optimized HLO's fusions by kind (is the
doubling a kernel of its own?), and whether the outputs are equal.

  q / k / v   4 K slices' float32 partials of the doubled row, [2048] x [2048, 5120]
              (tensor_parallel.k_slice_partials' form)
  o_proj      a two-row GEMM, [2048] x [2048, 2048], the first row kept (skinny_gemm's)

    python benchmarks/doubled_row_chain.py
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np

SLICES, K, N, LAYERS = 4, 2048, 5120, 48


def doubled(x_1X, form: str):
  if form == "concatenate":
    return jnp.concatenate([x_1X, x_1X])
  return jnp.broadcast_to(x_1X, (2,) + x_1X.shape[1:])


def qkv_chain(form: str):
  def run(x, ws):
    for w in ws:
      parts = jnp.einsum("msk,skn->snm", doubled(x.reshape(1, SLICES, K // SLICES), form),
                         w.reshape(SLICES, K // SLICES, N), preferred_element_type=jnp.float32)
      x = jnp.tanh(parts.sum(0)[:K, 0]).astype(jnp.bfloat16)[None] + x
    return x
  return run


def o_chain(form: str):
  def run(x, ws):
    for w in ws:
      y = jnp.dot(doubled(x, form), w[:, :K])[0]
      x = jnp.tanh(y).astype(jnp.bfloat16)[None] + x
    return x
  return run


def main():
  x = jnp.ones((1, K), jnp.bfloat16) * 0.01
  ws = [jnp.asarray(np.random.default_rng(i).standard_normal((K, N)) * 0.02, jnp.bfloat16)
        for i in range(LAYERS)]
  print(f"device: {jax.devices()[0].device_kind}")
  for name, make in (("q / k / v K slices", qkv_chain), ("o_proj two rows", o_chain)):
    outs = {}
    for form in ("concatenate", "broadcast"):
      compiled = jax.jit(make(form)).lower(x, ws).compile()
      fusions = re.findall(r"^\s*%?([a-z_]+?)(?:[._]\d+)* = \S+ fusion\(", compiled.as_text(),
                           re.M)
      kinds = {kind: fusions.count(kind) for kind in sorted(set(fusions))}
      outs[form] = np.asarray(compiled(x, ws)).astype(np.float32)
      for _ in range(3):
        compiled(x, ws).block_until_ready()
      best = float("inf")
      for _ in range(5):
        start = time.perf_counter()
        compiled(x, ws).block_until_ready()
        best = min(best, time.perf_counter() - start)
      print(f"{name:20s} {form:12s} {best * 1e6 / LAYERS:7.2f} us a product  fusions {kinds}")
    print(f"   outputs equal: {np.array_equal(outs['concatenate'], outs['broadcast'])}")


if __name__ == "__main__":
  main()
