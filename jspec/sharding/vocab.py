"""The two steps of a decode step that read a vocabulary split over the mesh, each with one
all-reduce: the embedding lookup (each shard looks the tokens up in its own rows, zeros where a
token lies in another shard's rows, and the all-reduce sums them) and the greedy argmax over
the logits (`sharded_vocab_argmax`: each shard's best (key, index) in a slot of its own, the
all-reduce gathers them, and every shard picks the best of the shards').

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
from jax.sharding import Mesh, PartitionSpec

from jspec.sharding.rules import ShardingRules, axis_size, mesh_axes


def _vocab_sum(mesh: Mesh, rules: ShardingRules, logical: str, custom_all_reduce: bool):
  """(vocab axes, reduce(x, row), table, table spec) for a sum over the mesh axes that split
  the logical axis `logical`: the workspace kernel's where `custom_all_reduce` and one axis
  splits it (jspec.sharding.tensor_parallel.all_reduce_fn), psum otherwise. None where
  nothing splits it, or a batch axis does (a shard's rows cannot serve another shard's
  sequences)."""
  from jspec.sharding.tensor_parallel import all_reduce_fn, table_operand
  vocab_axes = tuple(a for a in mesh_axes(getattr(rules, logical)) if axis_size(mesh, a) > 1)
  if not vocab_axes or set(vocab_axes) & set(mesh_axes(rules.batch)):
    return None
  if len(vocab_axes) == 1:
    reduce, workspace = all_reduce_fn(mesh, vocab_axes[0], custom_all_reduce)
  else:  # the kernel reduces over one axis
    reduce, workspace = (lambda x, row: lax.psum(x, vocab_axes)), None
  return (vocab_axes, reduce, *table_operand(workspace))


def sharded_embedding_lookup(mesh: Mesh, rules: ShardingRules, custom_all_reduce: bool = False,
                             rows_axis: str = "vocab"):
  """(embed [V, D], tokens [B, T]) -> [B, T, D] as `jnp.take(embed, tokens, axis=0,
  mode="clip")`, for embeddings laid out by `rules` on `mesh` with their rows on the logical
  axis `rows_axis` ("vocab" for a table that is also the lm_head, else "embed_vocab"). None
  (XLA's take) where the mesh does not split the rows, and where it splits them over an axis
  that also splits the batch: each shard then holds other sequences' tokens, which its rows
  cannot serve. `custom_all_reduce`: the shards' sum through the workspace kernel where it
  takes it."""
  split = _vocab_sum(mesh, rules, rows_axis, custom_all_reduce)
  if split is None:
    return None
  vocab_axes, reduce, table, table_spec = split

  def lookup(embed_VD, tokens_BT, row):
    rows = embed_VD.shape[0]
    total = rows * axis_size(mesh, vocab_axes)
    local_BT = jnp.clip(tokens_BT, 0, total - 1) - lax.axis_index(vocab_axes) * rows
    mine_BT = (local_BT >= 0) & (local_BT < rows)
    x_BTD = jnp.take(embed_VD, jnp.clip(local_BT, 0, rows - 1), axis=0)
    return reduce(jnp.where(mine_BT[..., None], x_BTD, 0), row)

  tokens = rules.spec(("batch", "seq"))
  lookup_fn = jax.shard_map(lookup, mesh=mesh,
                            in_specs=(rules.spec((rows_axis, "embed")), tokens, table_spec),
                            out_specs=rules.spec(("batch", "seq", "embed")), check_vma=False)
  return lambda embed_VD, tokens_BT: lookup_fn(embed_VD, tokens_BT, table)


def order_keys(logits_NV):
  """int32 keys whose integer order is the values' float order
  (jspec.speculative.sampling.vocab_argmax says how)."""
  x_NV = logits_NV.astype(jnp.float32)
  bits_NV = lax.bitcast_convert_type(jnp.where(x_NV == 0, 0.0, x_NV), jnp.int32)
  key_NV = jnp.where(bits_NV < 0, bits_NV ^ jnp.int32(0x7FFFFFFF), bits_NV)
  return jnp.where(jnp.isnan(x_NV), jnp.iinfo(jnp.int32).max, key_NV)


def keyed_argmax(key_NV, axis: int = -1):
  """(the largest key, the lowest index holding it) along `axis`."""
  top_N1 = jnp.max(key_NV, axis=axis, keepdims=True)
  index_NV = lax.broadcasted_iota(jnp.int32, key_NV.shape, axis % key_NV.ndim)
  index_N = jnp.min(jnp.where(key_NV == top_N1, index_NV, jnp.iinfo(jnp.int32).max), axis=axis)
  return jnp.squeeze(top_N1, axis), index_N


# Floats of the exchanged slots: whole 2 KB tiles (the workspace kernel's unit).
_SLOT_TILE = 512


def sharded_vocab_argmax(mesh: Mesh, rules: ShardingRules, custom_all_reduce: bool = False):
  """logits [B, ..., V] -> int32 [B, ...], jspec.speculative.sampling.vocab_argmax's tokens
  (its keys, ties to the lowest index, a NaN row's first NaN) in one all-reduce, for logits
  laid out by `rules` (rows over the batch axes, the vocabulary split). None where the mesh
  does not split the vocabulary, or splits it over a batch axis (as for the lookup).

  Why: vocab_argmax over a split vocabulary partitions into two dependent all-reduces (the
  best key, then the lowest index holding it), two of a tp step's three collectives outside
  its layers. Here each shard finds its own best and its global index, and writes
  (key high 16 bits, key low 16 bits, index) as float32 (integers below 2^24: exact) into
  its own slot of a zeroed array; one sum over the shards (the workspace kernel where
  `custom_all_reduce` and it takes the message) hands every shard every slot."""
  split = _vocab_sum(mesh, rules, "vocab", custom_all_reduce)
  if split is None:
    return None
  vocab_axes, reduce, table, table_spec = split
  shards = axis_size(mesh, vocab_axes)

  def per_shard(logits_BV, row):
    key_B, index_B = keyed_argmax(order_keys(logits_BV))
    me = lax.axis_index(vocab_axes)
    index_B = index_B + me * logits_BV.shape[-1]
    mine_B3 = jnp.stack([key_B >> 16, key_B & 0xFFFF, index_B], -1).astype(jnp.float32)
    n = mine_B3.size
    slots = jnp.zeros((-(-shards * n // _SLOT_TILE) * _SLOT_TILE,), jnp.float32)
    slots = lax.dynamic_update_slice(slots, mine_B3.reshape(-1), (me * n,))
    every_SB3 = reduce(slots, row)[:shards * n].reshape(shards, *mine_B3.shape).astype(jnp.int32)
    keys_SB = (every_SB3[..., 0] << 16) | every_SB3[..., 1]
    best_B = jnp.max(keys_SB, axis=0)
    return jnp.min(jnp.where(keys_SB == best_B, every_SB3[..., 2], jnp.iinfo(jnp.int32).max),
                   axis=0)

  def argmax(logits):
    lead = rules.spec(("batch",) + (None,) * (logits.ndim - 2))
    fn = jax.shard_map(per_shard, mesh=mesh,
                       in_specs=(PartitionSpec(*lead, vocab_axes), table_spec),
                       out_specs=lead, check_vma=False)
    return fn(logits, table)
  return argmax
