"""Per-layer caches: what each kind of token mixer keeps between forward passes, how it is
sharded, and how a verify window is committed once the loop knows how many tokens it emits.

The speculative loop never looks inside a cache. It asks a model for `init_caches`, runs
forwards, and calls `commit(caches, num_emit_B)` after acceptance; each cache kind decides
what committing means:

  KVCache         keys and values by absolute position. A verify window writes its k+1
                  positions; rejected ones lie past the new length and are never read, so
                  the cache rolls back by length alone and commit returns it unchanged.
  MLACache        multi-head latent attention's per-token latent and rope key (jspec.models.mla),
                  shared by every head; by position, so it rolls back by length as KVCache does.
  RecurrentCache  a linear-attention layer's state after the last committed token (the
                  causal-conv window of pre-conv inputs, and the delta-rule state). It cannot
                  roll back by length, so a verify window returns a `RecurrentWindow` instead,
                  and commit turns it into the state after exactly `num_emit` positions.

`RecurrentWindow` keeps either the state after every window position (STORE: commit picks
one) or the per-position inputs of the recurrence (REPLAY: commit reruns the first num_emit
steps from the state before the window). Both are exact. STORE is the default: on an H200
(Qwen3.5-9B shapes, BENCHMARKS.md "Qwen3.5") a 4-token verify at batch 8 cost 1.28x a decode
step with it and 1.44x with REPLAY, whose sequential re-run of the recurrence costs more
kernels than STORE's extra state writes cost bytes.

Shape letters: B batch, S cache slots, K kv heads, H head dim, W conv window (kernel - 1),
G linear-attention key heads, R value heads per key head, C conv channels per key head
(2 key dims + R value dims), Dk key dim, Dv value dim, T window positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jspec.models.delta_rule import advance_state  # the recurrence, one definition

RECURRENT_COMMIT_MODES = ("store", "replay")


def write_slots(cache_B_S_, rows_BT_, positions_BT, slot_axis: int):
  """Each sequence's new rows written into its cache slots at `positions_BT`.

  cache: [B, ...] with the slots on `slot_axis`; rows: [B, T, the cache's other axes in
  order]. The batch is a batching axis of the scatter (as `vmap` makes it), not an index: XLA's
  partitioner then writes each dp shard's sequences on their own device, where indices that
  name the batch (an iota beside the positions) made it all-gather every layer's new keys,
  values and indices over dp. Positions past the cache drop their rows (as `.at[].set`)."""
  rest = rows_BT_.ndim - 2
  numbers = lax.ScatterDimensionNumbers(
      update_window_dims=tuple(range(2, 2 + rest)), inserted_window_dims=(slot_axis,),
      scatter_dims_to_operand_dims=(slot_axis,), operand_batching_dims=(0,),
      scatter_indices_batching_dims=(0,))
  return lax.scatter(cache_B_S_, positions_BT[..., None].astype(jnp.int32),
                     rows_BT_.astype(cache_B_S_.dtype), numbers,
                     mode=lax.GatherScatterMode.FILL_OR_DROP)


@struct.dataclass
class KVCache:
  keys: jax.Array    # [B, K, S, H]
  values: jax.Array  # [B, K, S, H]

  AXES = ("batch", "kv_heads", "cache_seq", "head_dim")

  @classmethod
  def zeros(cls, batch: int, kv_heads: int, slots: int, head_dim: int, dtype) -> "KVCache":
    shape = (batch, kv_heads, slots, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  def shardings(self, rules, mesh) -> "KVCache":
    sharding = rules.sharding(mesh, self.AXES)
    return KVCache(sharding, sharding)

  def commit(self, num_emit_B) -> "KVCache":
    del num_emit_B  # Rolls back by length: slots past the new length are never read.
    return self

  def compact(self, path_BD, start_B, write=None) -> "KVCache":
    """compact_slots on keys and values; with `write` (an Attention's `kv_write`: the cache
    write kernel) the gathered rows go in through it, in place of XLA's scatters."""
    if write is None:
      return KVCache(compact_slots(self.keys, path_BD, start_B, 2),
                     compact_slots(self.values, path_BD, start_B, 2))
    sources_BD, targets_BD = path_slots(path_BD, start_B, self.keys.shape[2])
    rows = lambda cache_BKSH: jnp.moveaxis(gather_slots(cache_BKSH, sources_BD, 2), 2, 1)
    return KVCache(*write(self.keys, self.values, rows(self.keys), rows(self.values),
                          targets_BD))


@struct.dataclass
class MLACache:
  """Per token, [normalised latent (kv_lora_rank) | roped key (qk_rope_head_dim)] in one row,
  read whole by the absorbed attention's scores and (its latent part) for the output.

  One row per token serves every query head, so the cache is replicated over tp (as vLLM and
  SGLang keep it) and split over the batch axes only."""
  latent: jax.Array  # [B, S, kv_lora_rank + qk_rope_head_dim]

  AXES = ("batch", "cache_seq", "latent")

  @classmethod
  def zeros(cls, batch: int, slots: int, width: int, dtype) -> "MLACache":
    return cls(jnp.zeros((batch, slots, width), dtype))

  def shardings(self, rules, mesh) -> "MLACache":
    return MLACache(rules.sharding(mesh, self.AXES))

  def commit(self, num_emit_B) -> "MLACache":
    del num_emit_B  # Rolls back by length, as KVCache.
    return self

  def compact(self, path_BD, start_B) -> "MLACache":
    return MLACache(compact_slots(self.latent, path_BD, start_B, 1))


@struct.dataclass
class RecurrentCache:
  conv: jax.Array   # [B, W, G, C] the last W pre-conv inputs, oldest first
  state: jax.Array  # [B, G, R, Dk, Dv] float32 delta-rule state

  CONV_AXES = ("batch", None, "linear_heads", None)
  STATE_AXES = ("batch", "linear_heads", None, None, None)

  @classmethod
  def zeros(cls, batch: int, window: int, heads: int, channels: int, per_key: int, key_dim: int,
            value_dim: int, dtype) -> "RecurrentCache":
    return cls(jnp.zeros((batch, window, heads, channels), dtype),
               jnp.zeros((batch, heads, per_key, key_dim, value_dim), jnp.float32))

  def shardings(self, rules, mesh) -> "RecurrentCache":
    return RecurrentCache(rules.sharding(mesh, self.CONV_AXES),
                          rules.sharding(mesh, self.STATE_AXES))

  def commit(self, num_emit_B) -> "RecurrentCache":
    del num_emit_B  # Already committed (a prefill pass masks its padding itself).
    return self


def conv_window_after(conv_BWGC, inputs_BTGC, num_B):
  """The last W pre-conv inputs once the first num_B of `inputs_BTGC` have been consumed:
  rows num_B .. num_B + W - 1 of concat[window, inputs] (num_B = 0 keeps the window)."""
  window = conv_BWGC.shape[1]
  full_BXGC = jnp.concatenate([conv_BWGC, inputs_BTGC.astype(conv_BWGC.dtype)], axis=1)
  rows_BW = num_B[:, None] + jnp.arange(window)
  return jnp.take_along_axis(full_BXGC, rows_BW[:, :, None, None], axis=1)


@struct.dataclass
class RecurrentWindow:
  """A recurrent layer's verify window, before the loop knows how much of it to keep."""
  start: RecurrentCache
  conv_inputs: jax.Array        # [B, T, G, C] the window's pre-conv inputs
  # STORE: states_after [B, T, G, R, Dk, Dv] (state after each position); REPLAY: the
  # recurrence's per-position inputs (keys [B,T,G,Dk], values [B,T,G,R,Dv], log decay and
  # beta [B,T,G,R]), all float32.
  states_after: jax.Array | None = None
  keys: jax.Array | None = None
  values: jax.Array | None = None
  log_decay: jax.Array | None = None
  beta: jax.Array | None = None

  def commit(self, num_emit_B) -> RecurrentCache:
    """The cache after the first num_emit_B window positions (0: the state before it)."""
    conv = conv_window_after(self.start.conv, self.conv_inputs, num_emit_B)
    if self.states_after is not None:
      index_B = jnp.maximum(num_emit_B - 1, 0)
      picked = jnp.take_along_axis(self.states_after,
                                   index_B[:, None, None, None, None, None], axis=1)[:, 0]
      state = jnp.where((num_emit_B > 0)[:, None, None, None, None], picked, self.start.state)
      return RecurrentCache(conv, state)
    state = advance_state(self.start.state, self.keys, self.values, self.log_decay, self.beta,
                          num_emit_B)
    return RecurrentCache(conv, state)


def path_slots(path_BD, start_B, slots: int):
  """(sources, targets) [B, D] of compact_slots: slot start + j takes the row at
  start + path[j]; a target of `slots` (past the cache) drops the row."""
  depth = path_BD.shape[1]
  sources_BD = start_B[:, None] + jnp.maximum(path_BD, 0)
  targets_BD = start_B[:, None] + jnp.arange(depth, dtype=jnp.int32)
  return sources_BD, jnp.where(path_BD >= 0, targets_BD, slots)


def gather_slots(cache_B_S_, sources_BD, slot_axis: int):
  """Each sequence's rows at slots `sources_BD`, on the slot axis (its place kept)."""
  return jax.vmap(lambda c, i: jnp.take(c, i, axis=slot_axis - 1, mode="clip"))(
      cache_B_S_, sources_BD)


def compact_slots(cache_B_S_, path_BD, start_B, slot_axis: int):
  """A token tree's accepted path moved to consecutive slots (jspec.models.tree_attention):
  slot start + j takes the row at start + path[j] (path[0] = 0, the root); -1 past the
  accepted depth leaves the slot as it is. The rows are gathered before any is written."""
  sources_BD, targets_BD = path_slots(path_BD, start_B, cache_B_S_.shape[slot_axis])
  rows = gather_slots(cache_B_S_, sources_BD, slot_axis)
  return write_slots(cache_B_S_, jnp.moveaxis(rows, slot_axis, 1), targets_BD, slot_axis)


def compact(caches: tuple, path_BD, start_B, writers: tuple | None = None) -> tuple:
  """Each layer's cache after a token tree's verify window: the accepted path's rows at the
  slots its positions name; `writers` (one per cache, or None) the layers' cache write
  kernels, which GQA caches then write through. Recurrent layers keep no per-path state:
  trees refuse them."""
  for cache in caches:
    if not hasattr(cache, "compact"):
      raise ValueError(f"token trees need caches by position; {type(cache).__name__} keeps "
                       "a recurrent state that one window cannot hold per path")
  if writers is None or len(writers) != len(caches):
    writers = (None,) * len(caches)
  return tuple(cache.compact(path_BD, start_B, write) if write is not None
               else cache.compact(path_BD, start_B) for cache, write in zip(caches, writers))


def kv_writers(model) -> tuple:
  """The cache write kernel of each of `model`'s layers (None where a layer has none), in the
  order of its caches."""
  return tuple(getattr(getattr(layer, "attn", None), "kv_write", None)
               for layer in getattr(model, "layers", ()))


def commit(caches: tuple, num_emit_B) -> tuple:
  """Each layer's cache once the verify window's first num_emit_B positions are kept."""
  return tuple(cache.commit(num_emit_B) for cache in caches)


def shardings(caches: tuple, rules, mesh) -> tuple:
  """The NamedSharding of every cache array (caches may be abstract: jax.eval_shape)."""
  return tuple(cache.shardings(rules, mesh) for cache in caches)


def constrain(caches: tuple, cache_shardings) -> tuple:
  if cache_shardings is None:
    return caches
  return jax.tree.map(jax.lax.with_sharding_constraint, caches, cache_shardings)
