"""The equations a traced program hands to XLA, by primitive, outside its kernels.

Why: XLA's compile of a program grows with the operations it fuses, and the FP8 programs carry
more of them than bf16's around the same kernels (the activations' quantisation, pads, the
scales' layout, K-slice sums). A Pallas kernel's body is compiled apart from XLA's passes (a
Mosaic GPU or Triton module in the custom call), so its equations are not counted; the call
itself is, once.
"""

from __future__ import annotations

import collections

from jax.extend import core as jax_core

# Primitives whose sub-jaxprs are kernel bodies, not operations XLA fuses.
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map", "core_map")


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax_core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax_core.Jaxpr):
        yield item


def equation_counts(jaxpr) -> collections.Counter:
  """{primitive name: equations} of `jaxpr` (a Jaxpr or ClosedJaxpr) and of every jaxpr nested
  in it (jit, shard_map, custom_vjp/vmap calls, loops and branches; each nested body counted
  once per equation that holds it), kernel bodies (KERNEL_PRIMITIVES) left out."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  found = collections.Counter()
  for eqn in jaxpr.eqns:
    found[eqn.primitive.name] += 1
    if eqn.primitive.name not in KERNEL_PRIMITIVES:
      for sub in _sub_jaxprs(eqn):
        found += equation_counts(sub)
  return found
