"""The model's state on device, split for jit: what every compiled program takes.

`DeviceModel` holds the target's and the drafter's NNX graphdefs (static) and states (the
weights, jit arguments), the loop's context (expert backends, cache layouts) and the layout
rules of the arrays the schedulers put on the mesh. It compiles nothing itself: the schedulers
(jspec.schedulers) and the scorer (jspec.scoring) build their programs over it.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jspec.models import caches as cache_lib
from jspec.sharding.rules import global_array
from jspec.models.params import split_module
from jspec.loop.step import LoopContext


class DeviceModel:
  """Weights, cache layouts and array placement of one built LLM (jspec.build.LLMParts)."""

  def __init__(self, parts):
    self.rules, self.mesh = parts.rules, parts.mesh
    self.target_graphdef, self.target_state = nnx.split(parts.target)
    # The drafter's module (an MTP or EAGLE head, a draft model), or None (n-gram, no
    # speculation: an unused MTP head stays out of the compiled programs).
    self.draft_graphdef, self.draft_state = split_module(parts.draft_module)
    self.ctx = LoopContext(
        experts_fn=parts.experts_fn, draft_experts_fn=parts.draft_experts_fn,
        dtype=parts.dtype,
        cache_shardings=module_cache_shardings(parts.target, parts.rules, parts.mesh,
                                               parts.dtype),
        draft_cache_shardings=(module_cache_shardings(parts.draft_module, parts.draft_rules,
                                                      parts.mesh, parts.dtype)
                               if parts.draft_module is not None else None),
        replicated=parts.rules.sharding(parts.mesh, ()) if parts.mesh.size > 1 else None,
        **{name: fn for name, fn in zip(("vocab_argmax", "draft_vocab_argmax"),
                                        parts.vocab_argmax) if fn is not None})

  @property
  def weights(self) -> tuple:
    """(target state, draft state): the first two arguments of every generation program."""
    return self.target_state, self.draft_state

  def put(self, host: np.ndarray, logical_axes) -> jax.Array:
    """A host array made global on the mesh (each process supplies its devices' slices)."""
    return global_array(host, self.sharding(logical_axes))

  def sharding(self, logical_axes):
    return self.rules.sharding(self.mesh, logical_axes)

  def batch_shardings(self, state_shape, batch: int):
    """A state's layout: leaves of `batch` rows split over the batch axes, the rest
    replicated. Fixed, so that one program's output is exactly the next one's input."""
    def leaf(x):
      axes = (("batch",) + (None,) * (x.ndim - 1) if x.ndim and x.shape[0] == batch
              else (None,) * x.ndim)
      return self.sharding(axes)
    return jax.tree.map(leaf, state_shape)

  def with_cache_shardings(self, decode_shardings):
    """A DecodeState's shardings with its caches laid out by their rules."""
    return decode_shardings.replace(
        target_caches=self.ctx.cache_shardings,
        draft=decode_shardings.draft.replace(caches=self.ctx.draft_cache_shardings or ()))


def module_cache_shardings(module, rules, mesh, dtype) -> tuple:
  """The sharding of each of a module's per-layer caches (independent of their sizes)."""
  shapes = jax.eval_shape(lambda: module.init_caches(1, 1, dtype))
  return cache_lib.shardings(shapes, rules, mesh)
