"""Checks made once, before anything is allocated: does the model divide over the mesh, and do
weights plus both KV caches fit in each device's memory?"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jspec.config import ModelConfig
from jspec.sharding.rules import MeshConfig, ShardingRules, axis_size
from jspec.speculative.buckets import batch_bucket, max_cache_slots


def validate_mesh(cfg: ModelConfig, mesh: MeshConfig):
  """Every sharded dimension must divide evenly; the error names the constraint. KV heads
  may also be fewer than tp, if tp is a multiple of them (each is then stored tp/K times)."""
  cfg.for_kv_shards(mesh.tp)
  checks = [("tp", mesh.tp, "num_attention_heads", cfg.num_heads),
            ("tp", mesh.tp, "intermediate_size", cfg.intermediate_size),
            ("tp", mesh.tp, "vocab_size", cfg.vocab_size)]
  if cfg.is_moe:
    checks += [("ep", mesh.ep, "num_experts", cfg.num_experts),
               ("tp", mesh.tp, "moe_intermediate_size", cfg.moe_intermediate_size)]
  for axis, size, name, value in checks:
    if value % size:
      raise ValueError(f"{axis}={size} must divide {name}={value}")


def sharded_configs(cfg: ModelConfig, mesh, target_rules: ShardingRules,
                    draft_rules: ShardingRules) -> tuple[ModelConfig, ModelConfig]:
  """The configs the target and the draft placed on `mesh` are built with: KV heads copied as
  often as splitting them over each one's "kv_heads" mesh axes needs (a tp-replicated draft:
  none)."""
  return tuple(cfg.for_kv_shards(axis_size(mesh, rules.kv_heads))
               for rules in (target_rules, draft_rules))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  weight_bytes: int         # per device
  target_cache_bytes: int   # per device, at max_num_seqs x max_cache_slots(max_model_len, k)
  draft_cache_bytes: int
  capacity_bytes: int | None

  @property
  def total_bytes(self) -> int:
    return self.weight_bytes + self.target_cache_bytes + self.draft_cache_bytes

  def describe(self) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    cap = "unknown" if self.capacity_bytes is None else gib(self.capacity_bytes)
    return (f"weights {gib(self.weight_bytes)} + target KV {gib(self.target_cache_bytes)} + "
            f"draft KV {gib(self.draft_cache_bytes)} = {gib(self.total_bytes)} per device "
            f"(capacity {cap})")


def _bytes_per_device(tree) -> int:
  total = 0
  for leaf in jax.tree.leaves(tree):
    shard_shape = leaf.sharding.shard_shape(leaf.shape)
    total += int(np.prod(shard_shape)) * leaf.dtype.itemsize
  return total


def device_capacity() -> int | None:
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def plan_memory(cfg: ModelConfig, mesh: MeshConfig, target_state, mtp_state, dtype,
                max_num_seqs: int, max_model_len: int, k: int, draft_tp_sharded: bool,
                num_draft_layers: int, capacity_bytes: int | None,
                usable_fraction: float = 0.9) -> MemoryPlan:
  """Raises ValueError, before any cache exists, when the worst-case batch cannot fit."""
  # The engine pads a batch to its bucket: count the rows it will really allocate.
  batch_per_device = batch_bucket(max_num_seqs, mesh.batch_width) // mesh.batch_width
  slots = max_cache_slots(max_model_len, k)
  kv_heads_target = cfg.for_kv_shards(mesh.tp).cache_kv_heads // mesh.tp
  kv_heads_draft = kv_heads_target if draft_tp_sharded else cfg.num_kv_heads
  per_layer = lambda heads: 2 * batch_per_device * slots * heads * cfg.head_dim * np.dtype(
      dtype).itemsize
  plan = MemoryPlan(
      weight_bytes=_bytes_per_device(target_state) + (
          _bytes_per_device(mtp_state) if mtp_state is not None else 0),
      target_cache_bytes=cfg.num_layers * per_layer(kv_heads_target),
      draft_cache_bytes=num_draft_layers * per_layer(kv_heads_draft),
      capacity_bytes=capacity_bytes)
  if capacity_bytes is not None and plan.total_bytes > usable_fraction * capacity_bytes:
    raise ValueError(
        f"max_num_seqs={max_num_seqs} x max_model_len={max_model_len} does not fit: "
        f"{plan.describe()}; lower max_num_seqs or max_model_len, or add dp/tp")
  return plan
