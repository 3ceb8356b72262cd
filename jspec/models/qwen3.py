"""Qwen3 dense and Qwen3-MoE causal language models (transformers `Qwen3ForCausalLM`,
`Qwen3MoeForCausalLM`): the neutral decoder (jspec.models.decoder) as it stands, q/k norms on,
a layer MoE exactly where `cfg.layer_is_moe(i)` says so, experts in Qwen3-MoE's layout
(`mlp.gate`, `mlp.experts.{e}.*`: jspec.models.weights.expert_rules).
"""

from __future__ import annotations

from jspec.config import ModelConfig, MoEConfig
from jspec.models import weights as W
from jspec.models.decoder import CausalLM, common_fields

# The family's model is the neutral decoder stack; the name stays for its callers.
Qwen3CausalLM = CausalLM
moe_rules = W.expert_rules


def read_config(hf_config, arch: str) -> ModelConfig:
  rope = getattr(hf_config, "rope_parameters", None) or {}
  moe = None
  if arch == "Qwen3MoeForCausalLM":
    moe = MoEConfig(num_experts=hf_config.num_experts,
                    num_experts_per_tok=hf_config.num_experts_per_tok,
                    intermediate_size=hf_config.moe_intermediate_size,
                    norm_topk_prob=bool(hf_config.norm_topk_prob),
                    mlp_only_layers=tuple(hf_config.mlp_only_layers or ()),
                    decoder_sparse_step=int(hf_config.decoder_sparse_step or 1))
  return ModelConfig(architecture=arch, **common_fields(hf_config, rope), moe=moe)
