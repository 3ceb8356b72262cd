"""Do weights plus both KV caches fit in each device's memory, and how many sequences do? Made
once at load time, before anything is allocated, from the modules' abstract shapes (the
caches' through the models: this sits above jspec.models and jspec.sharding)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.models import caches as cache_lib
from jspec.sharding.rules import MeshConfig, ShardingRules
from jspec.shapes.buckets import batch_bucket, max_cache_slots


# max_num_seqs="auto": at most this many slots (vLLM's default max_num_seqs), and this many
# where the device does not report its memory (the CPU).
AUTO_MAX_NUM_SEQS = 256
AUTO_UNKNOWN_CAPACITY_NUM_SEQS = 64


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  weight_bytes: int         # per device
  target_cache_bytes: int   # per device, at max_num_seqs x max_cache_slots(max_model_len, k):
                            # KV caches, and recurrent layers' conv windows and states
  draft_cache_bytes: int
  capacity_bytes: int | None
  # Recurrent layers' verify windows kept until commit: the state after each of the k+1
  # positions ("store") or the recurrence's per-position inputs ("replay"), per device.
  verify_window_bytes: int = 0
  max_num_seqs: int = 0     # the slots planned for (chosen by the plan under "auto")
  batch_rows: int = 0       # rows really allocated: max_num_seqs padded to its batch bucket

  @property
  def total_bytes(self) -> int:
    return (self.weight_bytes + self.target_cache_bytes + self.draft_cache_bytes
            + self.verify_window_bytes)

  def describe(self) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"
    cap = "unknown" if self.capacity_bytes is None else gib(self.capacity_bytes)
    window = (f" + recurrent verify window {gib(self.verify_window_bytes)}"
              if self.verify_window_bytes else "")
    rows = f"{self.batch_rows} rows: " if self.batch_rows else ""
    return (f"{rows}weights {gib(self.weight_bytes)} + target caches "
            f"{gib(self.target_cache_bytes)} + "
            f"draft KV {gib(self.draft_cache_bytes)}{window} = {gib(self.total_bytes)} per "
            f"device (capacity {cap})")


def _abstract_bytes_per_device(shapes, shardings) -> int:
  """Bytes per device of arrays (or abstract ones: jax.eval_shape) placed with `shardings`."""
  leaves = jax.tree.leaves(shapes)
  placements = jax.tree.leaves(shardings)
  return sum(int(np.prod(sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
             for leaf, sharding in zip(leaves, placements))


def _weight_bytes_per_device(module, rules: ShardingRules, jax_mesh) -> int:
  """A module's parameters per device: as placed, or, for a module built abstractly
  (nnx.eval_shape: a plan on paper), as its logical axes would place them."""
  shapes, shardings = [], []
  for _, variable in nnx.to_flat_state(nnx.state(module)):
    value = variable.get_value()
    sharding = getattr(value, "sharding", None)
    if sharding is None:
      axes = variable.get_metadata().get("logical_axes") or (None,) * value.ndim
      sharding = rules.sharding(jax_mesh, axes)
    shapes.append(value)
    shardings.append(sharding)
  return _abstract_bytes_per_device(shapes, shardings)


def device_capacity() -> int | None:
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def _cache_bytes(module, rules, mesh, batch: int, slots: int, dtype, window: int = 0):
  """(cache bytes, verify-window bytes) per device of a module's caches at this size. The
  window is what its recurrent layers hold between a `window`-token verify and its commit."""
  shapes = jax.eval_shape(lambda: module.init_caches(batch, slots, dtype))
  cache = _abstract_bytes_per_device(shapes, cache_lib.shardings(shapes, rules, mesh))
  if not window or not any(isinstance(c, cache_lib.RecurrentCache) for c in shapes):
    return cache, 0
  tokens = jax.ShapeDtypeStruct((batch, window), jnp.int32)
  positions = jax.ShapeDtypeStruct((batch, window), jnp.int32)
  windows = jax.eval_shape(lambda t, p: module(t, p, module.init_caches(batch, slots, dtype),
                                               slots, _no_experts)[1], tokens, positions)
  extra = 0
  for w in windows:
    if isinstance(w, cache_lib.RecurrentWindow):
      # Every window array is [B, T, G, ...]: batch and key heads split as the state is.
      for leaf in jax.tree.leaves(w.replace(start=None)):
        axes = ("batch", None, "linear_heads") + (None,) * (leaf.ndim - 3)
        extra += _abstract_bytes_per_device([leaf], [rules.sharding(mesh, axes)])
  return cache, extra


def _no_experts(x_TD, *args):  # shapes only: the MoE output has x's shape
  return x_TD


def _plan_at(mesh: MeshConfig, jax_mesh, target, mtp, target_rules, draft_rules, dtype,
             max_num_seqs: int, max_model_len: int, k: int, capacity_bytes) -> MemoryPlan:
  # The engine pads a batch to its bucket: count the rows it will really allocate.
  batch = batch_bucket(max_num_seqs, mesh.batch_width)
  slots = max_cache_slots(max_model_len, k)
  target_cache, window = _cache_bytes(target, target_rules, jax_mesh, batch, slots, dtype,
                                      k + 1)
  draft_cache = 0 if mtp is None else _cache_bytes(mtp, draft_rules, jax_mesh, batch, slots,
                                                   dtype)[0]
  return MemoryPlan(
      weight_bytes=_weight_bytes_per_device(target, target_rules, jax_mesh) + (
          _weight_bytes_per_device(mtp, draft_rules, jax_mesh) if mtp is not None else 0),
      target_cache_bytes=target_cache, draft_cache_bytes=draft_cache,
      capacity_bytes=capacity_bytes, verify_window_bytes=window, max_num_seqs=max_num_seqs,
      batch_rows=batch)


def _most_slots(mesh: MeshConfig, base: MemoryPlan, usable_bytes: float) -> int | None:
  """The largest batch bucket (dp x ep width times a power of two, at most AUTO_MAX_NUM_SEQS)
  whose caches fit beside the weights, from a plan at one row per shard (`base`): every
  cache array is split over the batch rows, so its bytes per device grow with them exactly.
  None when not even one row per shard fits."""
  per_row = base.total_bytes - base.weight_bytes
  width, best = mesh.batch_width, None
  rows = width
  while rows <= max(AUTO_MAX_NUM_SEQS, width):
    if base.weight_bytes + per_row * (rows // width) > usable_bytes:
      break
    best, rows = rows, rows * 2
  return best


def plan_memory(mesh: MeshConfig, jax_mesh, target, mtp, target_rules: ShardingRules,
                draft_rules: ShardingRules, dtype, max_num_seqs: int | str, max_model_len: int,
                k: int, capacity_bytes: int | None,
                usable_fraction: float = 0.9) -> MemoryPlan:
  """Raises ValueError, before any cache exists, when the worst-case batch cannot fit. Counts
  the caches the modules really allocate (jax.eval_shape of their init_caches) as placed by
  the rules: KV caches, recurrent state, and what a verify window keeps until commit.

  max_num_seqs="auto" takes the most slots that fit (`_most_slots`; AUTO_MAX_NUM_SEQS at most,
  AUTO_UNKNOWN_CAPACITY_NUM_SEQS where the capacity is unknown), and is refused only when not
  even one sequence per data-parallel shard fits."""
  args = (mesh, jax_mesh, target, mtp, target_rules, draft_rules, dtype)
  usable = None if capacity_bytes is None else usable_fraction * capacity_bytes
  if max_num_seqs == "auto":
    if usable is None:
      max_num_seqs = AUTO_UNKNOWN_CAPACITY_NUM_SEQS
    else:
      base = _plan_at(*args, mesh.batch_width, max_model_len, k, capacity_bytes)
      max_num_seqs = _most_slots(mesh, base, usable)
      if max_num_seqs is None:
        raise ValueError(
            f"max_num_seqs='auto': not even {mesh.batch_width} sequence(s) (one per dp x ep "
            f"shard) of max_model_len={max_model_len} fit: {base.describe()}; lower "
            f"max_model_len, or add tp")
  plan = _plan_at(*args, max_num_seqs, max_model_len, k, capacity_bytes)
  if usable is not None and plan.total_bytes > usable:
    raise ValueError(
        f"max_num_seqs={max_num_seqs} x max_model_len={max_model_len} does not fit: "
        f"{plan.describe()}; lower max_num_seqs or max_model_len, add dp/tp, or pass "
        f"max_num_seqs='auto' to take the most that fit")
  return plan
