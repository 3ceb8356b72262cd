"""A memory plan from a config alone, before anything is downloaded or read: whether a model
fits a mesh of devices of a given memory (e.g. DeepSeek-V3 with its NextN layer on 8 H200 in
FP8, and not in bf16).

The same planner `LLM` runs at load time (jspec.memory_plan.plan_memory), over modules built
abstractly (nnx.eval_shape: shapes and logical axes, no arrays) and an abstract mesh (no
devices): the weights counted as the sharding rules would place them, the caches as the modules
would allocate them.
"""

from __future__ import annotations

from flax import nnx
from jax.sharding import AbstractMesh

from jspec.config import ModelConfig
from jspec.models.mtp import MTPHead, MTPSpec
from jspec.models.registry import family_of
from jspec.memory_plan import MemoryPlan, plan_memory
from jspec.sharding.plan import sharded_configs, validate_mesh
from jspec.sharding.rules import MESH_AXES, MeshConfig, ShardingRules


def plan_for_config(cfg: ModelConfig, mesh: MeshConfig, *, capacity_bytes: int,
                    max_model_len: int, max_num_seqs: int | str, dtype,
                    num_speculative_tokens: int = 0, mtp: MTPSpec | None = None,
                    rules: ShardingRules | None = None) -> MemoryPlan:
  """The plan `LLM(model, mesh=mesh, max_model_len=..., max_num_seqs=...)` would make on devices
  of `capacity_bytes` each; raises the same ValueError when it does not fit. `mtp`: the
  checkpoint's MTP / NextN layers (jspec.models.mtp.MTPSpec), drafting with
  `num_speculative_tokens`; `dtype`: the unquantized weights' and the caches' (as a jnp
  dtype, the one LLM's dtype="bfloat16" resolves to)."""
  validate_mesh(cfg, mesh)
  rules = rules or ShardingRules()
  jax_mesh = AbstractMesh((mesh.dp, mesh.ep, mesh.tp), MESH_AXES)
  target_cfg, draft_cfg = sharded_configs(cfg, jax_mesh, rules, rules)
  family = family_of(cfg)
  target = nnx.eval_shape(lambda: family.model(target_cfg, dtype, nnx.Rngs(0)))
  head = None
  if mtp is not None:
    head = nnx.eval_shape(lambda: MTPHead(draft_cfg, mtp, dtype, nnx.Rngs(0), family.model))
  return plan_memory(mesh, jax_mesh, target, head, rules, rules, dtype, max_num_seqs,
                     max_model_len, num_speculative_tokens, capacity_bytes)
