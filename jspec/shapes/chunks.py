"""Long inputs through a model a fixed number of tokens at a time (prefill, drafter prefill)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def in_chunks(forward, inputs, caches, chunk: int):
  """forward(*inputs, caches) -> (outputs, caches), run over the prompt `chunk` tokens at a time.

  Each chunk writes its keys/values before attending, and attends causally over the whole
  prompt bucket: the same computation as one pass (equal up to float rounding, since the
  matmul shapes differ); only the [chunk x bucket] score matrix exists at a time instead of
  [bucket x bucket]. Whole chunks run in a scan (one copy of the model in the program); a
  bucket that is not a multiple of the chunk (buckets capped at max_model_len) ends with one
  shorter pass.
  """
  length = inputs[0].shape[1]
  if length <= chunk:
    return forward(*inputs, caches)
  num, rest = divmod(length, chunk)
  split = lambda x: jnp.moveaxis(x[:, :num * chunk].reshape(x.shape[0], num, chunk,
                                                            *x.shape[2:]), 1, 0)
  merge = lambda y: jnp.moveaxis(y, 0, 1).reshape(y.shape[1], num * chunk, *y.shape[3:])

  def body(caches, chunk_inputs):
    outputs, caches = forward(*chunk_inputs, caches)
    return caches, outputs

  caches, outputs = jax.lax.scan(body, caches, tuple(split(x) for x in inputs))
  outputs = jax.tree.map(merge, outputs)
  if rest:
    tail, caches = forward(*(x[:, num * chunk:] for x in inputs), caches)
    outputs = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), outputs, tail)
  return outputs, caches
