"""Checks made once, before anything is allocated: does the model divide over the mesh, and its
config as each shard holds it. (Whether weights and caches fit each device's memory is
jspec.memory_plan's, which builds the models' caches.)"""

from __future__ import annotations

import math

from jspec.config import ModelConfig
from jspec.sharding.rules import MeshConfig, ShardingRules, axis_size


def validate_mesh(cfg: ModelConfig, mesh: MeshConfig):
  """Every sharded dimension must divide evenly; the error names the constraint. KV heads
  may also be fewer than tp, if tp is a multiple of them (each is then stored tp/K times).
  The vocabulary need not divide: it is padded (`sharded_configs`)."""
  cfg.for_kv_shards(mesh.tp)
  checks = [("tp", mesh.tp, "num_attention_heads", cfg.num_heads),
            ("tp", mesh.tp, "intermediate_size", cfg.intermediate_size)]
  if cfg.is_moe:
    checks += [("ep", mesh.ep, "num_experts", cfg.moe.num_experts),
               ("tp", mesh.tp, "moe_intermediate_size", cfg.moe.intermediate_size)]
    if cfg.moe.shared_expert_intermediate_size:
      checks.append(("tp", mesh.tp, "shared_expert_intermediate_size",
                     cfg.moe.shared_expert_intermediate_size))
  if cfg.fp8_block is not None:
    # FP8 scales are split over tp like the weights' columns: a shard holds whole blocks.
    block = max(cfg.fp8_block)
    checks.append(("tp", mesh.tp, f"intermediate_size / FP8 block {block}",
                   cfg.intermediate_size // block))
    if cfg.is_moe:
      checks.append(("tp", mesh.tp, f"moe_intermediate_size / FP8 block {block}",
                     cfg.moe.intermediate_size // block))
    if cfg.is_mla:  # MLA's per-head weights are kept flattened, as published
      qk = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
      checks.append(("tp", mesh.tp, f"num_heads x qk_head_dim / FP8 block {block}",
                     cfg.num_heads * qk // block))
      checks.append(("tp", mesh.tp, f"num_heads x v_head_dim / FP8 block {block}",
                     cfg.num_heads * cfg.mla.v_head_dim // block))
  if "linear_attention" in cfg.layer_types:
    # Linear-attention heads are split by key head; each key head's value heads go with it.
    checks.append(("tp", mesh.tp, "linear_num_key_heads", cfg.linear.num_key_heads))
  for axis, size, name, value in checks:
    if value % size:
      raise ValueError(f"{axis}={size} must divide {name}={value}")


def sharded_configs(cfg: ModelConfig, mesh, target_rules: ShardingRules,
                    draft_rules: ShardingRules) -> tuple[ModelConfig, ModelConfig]:
  """The configs the target and the draft placed on `mesh` are built with: KV heads copied as
  often as splitting them over each one's "kv_heads" mesh axes needs (a tp-replicated draft:
  none); the vocabulary padded to a multiple of the target's and the draft's "vocab" shards
  (the draft's logits meet the target's in verification, and an MTP head may read the target's
  embedding: both have one padded size); expert weights padded to `cfg.expert_tile` per
  "moe_mlp" shard."""
  both = (target_rules, draft_rules)
  vocab_shards = math.lcm(*(axis_size(mesh, rules.vocab) for rules in both))
  return tuple(cfg.for_kv_shards(axis_size(mesh, rules.kv_heads))
               .padded_for(vocab_shards, axis_size(mesh, rules.moe_mlp))
               for rules in both)
