"""Rows of batch-first pytrees, per data-parallel shard: the gathers and scatters the
continuous loop moves slots with (jspec.speculative.batching). Each is batched over the shard
axis, so a shard reads and writes only its own rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def by_shard(x, shards: int):
  return x.reshape(shards, x.shape[0] // shards, *x.shape[1:])


def gather_rows(tree, rows_DR, shards: int):
  """Rows `rows_DR` (local to each shard) of every [B, ...] leaf, as [D * R, ...]. Written as
  a gather batched over the shard axis, so each shard reads only its own rows."""
  def take(x):
    picked = jax.vmap(lambda x_b, i_R: jnp.take(x_b, i_R, axis=0, mode="clip"))(
        by_shard(x, shards), rows_DR)
    return picked.reshape((rows_DR.size,) + x.shape[1:])  # explicit: leaves may be empty
  return jax.tree.map(take, tree)


def scatter_rows(tree, rows_DR, values, shards: int):
  """`tree` with rows `rows_DR` (local) of every leaf replaced by `values` ([D * R, ...]);
  a row index past the shard's rows writes nothing."""
  def put(x, v):
    v_DR = v.reshape(rows_DR.shape + x.shape[1:])
    out = jax.vmap(lambda x_b, i_R, v_R: x_b.at[i_R].set(v_R, mode="drop"))(
        by_shard(x, shards), rows_DR, v_DR)
    return out.reshape(x.shape)
  return jax.tree.map(put, tree, values)


def select_rows(flag_N, new, old):
  """new where flag_N, else old, leaf by leaf ([N, ...] leaves)."""
  def pick(a, b):
    return jnp.where(flag_N.reshape(-1, *([1] * (a.ndim - 1))), a, b)
  return jax.tree.map(pick, new, old)
