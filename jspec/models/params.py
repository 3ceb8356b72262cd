"""Parameters as the models declare them: an `nnx.Param` whose metadata `logical_axes` names
each dimension, which the sharding rules (jspec.sharding.rules) map to mesh axes, so no model
module mentions a mesh axis; with `init_scale` for random initialisation
(jspec.models.loading.init_random) and, where an axis is padded for the mesh or the kernels,
its `unpadded_shape`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape, dtype, logical_axes, scale: float | None = None,
          pad_to=None) -> nnx.Param:
  """A normal(0, scale) parameter; scale defaults to 1/sqrt(fan_in) (the first axis).

  `pad_to`: a shape at least as large (a vocabulary split over tp, expert weights at the
  Pallas tile): the parameter has that shape, zeros past `shape` at the end of each axis, and
  remembers `shape` as its `unpadded_shape` metadata, which loading, random initialisation and
  saving read (they pad the true tensor, draw only it, and strip the zeros).
  """
  scale = shape[0] ** -0.5 if scale is None else scale
  value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
  if pad_to is None:
    return nnx.Param(value.astype(dtype), logical_axes=logical_axes, init_scale=scale)
  value = jnp.pad(value, [(0, p - n) for n, p in zip(shape, pad_to)])
  return nnx.Param(value.astype(dtype), logical_axes=logical_axes, init_scale=scale,
                   unpadded_shape=tuple(shape))


def unpadded_shape(variable) -> tuple:
  """The true shape of a parameter made with `param(pad_to=...)`; else its shape."""
  shape = variable.get_metadata().get("unpadded_shape")
  return tuple(variable.get_value().shape) if shape is None else tuple(shape)


def mask_padded_vocab(logits_BTV, vocab_size: int):
  """-inf for the ids past the true vocabulary (rows that pad the embedding and lm_head to a
  multiple of the vocabulary shards): they are never sampled, drafted or accepted."""
  if logits_BTV.shape[-1] == vocab_size:
    return logits_BTV
  ids_BTV = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, logits_BTV.ndim - 1)
  return jnp.where(ids_BTV < vocab_size, logits_BTV, -jnp.inf)


def ones_param(shape, dtype, logical_axes) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, dtype), logical_axes=logical_axes, init_scale=None)


def zeros_param(shape, dtype, logical_axes) -> nnx.Param:
  # init_scale 0: random initialisation (loading.init_random) draws 0 * normal = 0.
  return nnx.Param(jnp.zeros(shape, dtype), logical_axes=logical_axes, init_scale=0.0)


def split_module(module):
  """(graphdef, state) for a module or None; graphdefs are static, states are jit arguments."""
  return (None, None) if module is None else nnx.split(module)


def merge_module(graphdef, state):
  """The module of `split_module`'s (graphdef, state); None for None."""
  return None if graphdef is None else nnx.merge(graphdef, state)
