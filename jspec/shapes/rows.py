"""Rows of batch-first pytrees, per data-parallel shard: the gathers and scatters the
continuous loop moves slots with (jspec.loop.rounds), and the per-row reads and
writes of a step (`row_items`, `set_row_items`). Each is batched over the shard or row axis,
so a shard reads and writes only its own rows.

Why batched (vmap) and not indexed by an iota over the rows (`x[jnp.arange(B), i_B]`): XLA's
partitioner keeps a gather or scatter whose batch is a batching axis on each dp shard; with
the rows named by an iota among the indices it all-gathered the indices and values over dp,
or read them masked and all-reduced them, in every decode step."""

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


def row_items(x_B_, index_B):
  """x[b, index_B[b]] for every row b (the axes after the second kept; jnp's indexing rules
  per row, a negative index counting from the end)."""
  return jax.vmap(lambda x, i: x[i])(x_B_, index_B)


def set_row_items(x_B_, index_BT, values_BT, mode: str | None = None):
  """x with x[b, index_BT[b, t]] = values_BT[b, t] for every row b (values broadcast to the
  indices' shape and x's trailing axes; `mode` as `.at[].set`'s)."""
  values_BT = jnp.broadcast_to(values_BT, index_BT.shape + x_B_.shape[2:])
  return jax.vmap(lambda x, i, v: x.at[i].set(v, mode=mode))(x_B_, index_BT, values_BT)


def select_rows(flag_N, new, old):
  """new where flag_N, else old, leaf by leaf ([N, ...] leaves)."""
  def pick(a, b):
    return jnp.where(flag_N.reshape(-1, *([1] * (a.ndim - 1))), a, b)
  return jax.tree.map(pick, new, old)
