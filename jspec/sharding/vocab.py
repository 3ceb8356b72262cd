"""The embedding lookup of a vocabulary split over the mesh: each shard looks the tokens up in
its own rows, zeros where a token lies in another shard's rows, and one all-reduce sums them.

Why written out: left to XLA's partitioner, `jnp.take` on the split table compiled on the GPU
(jax 0.11.2) into an all-gather of the whole table inside the decode loop, once a step:
Qwen3-8B's 1.2 GB embedding at tp = 2 cost 2.2 ms of a 7.7 ms batch-1 step on 2 H100s (the CPU
compiler chose the masked lookup; BENCHMARKS.md, "Tensor parallelism at batch 1: ...").

The sum is the tp layers' all-reduce where it is jspec's workspace kernel and the vocabulary
splits over one axis (jspec.sharding.tensor_parallel.all_reduce_fn), `lax.psum` elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from jspec.sharding.rules import ShardingRules, axis_size, mesh_axes


def sharded_embedding_lookup(mesh: Mesh, rules: ShardingRules, custom_all_reduce: bool = False):
  """(embed [V, D], tokens [B, T]) -> [B, T, D] as `jnp.take(embed, tokens, axis=0,
  mode="clip")`, for embeddings laid out by `rules` on `mesh`. None (XLA's take) where the
  mesh does not split the vocabulary, and where it splits it over an axis that also splits
  the batch: each shard then holds other sequences' tokens, which its rows cannot serve.
  `custom_all_reduce`: the shards' sum through the workspace kernel where it takes it."""
  from jspec.sharding.tensor_parallel import all_reduce_fn, table_operand

  vocab_axes = tuple(a for a in mesh_axes(rules.vocab) if axis_size(mesh, a) > 1)
  if not vocab_axes or set(vocab_axes) & set(mesh_axes(rules.batch)):
    return None
  if len(vocab_axes) == 1:
    reduce, workspace = all_reduce_fn(mesh, vocab_axes[0], custom_all_reduce)
  else:  # the kernel reduces over one axis
    reduce, workspace = (lambda x, row: lax.psum(x, vocab_axes)), None

  def lookup(embed_VD, tokens_BT, row):
    rows = embed_VD.shape[0]
    total = rows * axis_size(mesh, vocab_axes)
    local_BT = jnp.clip(tokens_BT, 0, total - 1) - lax.axis_index(vocab_axes) * rows
    mine_BT = (local_BT >= 0) & (local_BT < rows)
    x_BTD = jnp.take(embed_VD, jnp.clip(local_BT, 0, rows - 1), axis=0)
    return reduce(jnp.where(mine_BT[..., None], x_BTD, 0), row)

  tokens = rules.spec(("batch", "seq"))
  table, table_spec = table_operand(workspace)
  lookup_fn = jax.shard_map(lookup, mesh=mesh,
                            in_specs=(rules.spec(("vocab", "embed")), tokens, table_spec),
                            out_specs=rules.spec(("batch", "seq", "embed")), check_vma=False)
  return lambda embed_VD, tokens_BT: lookup_fn(embed_VD, tokens_BT, table)
