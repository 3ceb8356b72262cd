"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (transformers `Glm4MoeForCausalLM`), with its NextN MTP layer.

transformers' `Glm4MoeDecoderLayer` is the neutral pre-norm block (jspec.models.decoder) with
other options, all read from the config:
  - attention: GQA with biases on q/k/v (`attention_bias`), q/k RMSNorm only where
    `use_qk_norm`, RoPE over the first `partial_rotary_factor` (0.5) of each head in the
    rotate-half layout (glm4_moe's `apply_rotary_pos_emb` splits the rotated part into halves;
    GLM-4's dense `Glm4ForCausalLM` interleaves, this family does not);
  - norms: plain RMSNorm (`Glm4MoeRMSNorm`);
  - MLP: dense SwiGLU in the first `first_k_dense_replace` layers, then `Glm4MoeMoE`: sigmoid
    group-limited routing with the correction bias and `routed_scaling_factor`, plus ungated
    shared experts (jspec.models.moe).
The MTP ("NextN") layer is in the DeepSeek-V3 layout at `model.layers.{num_hidden_layers}`:
`enorm`, `hnorm`, `eh_proj`, `shared_head.{norm, head}`, a full MoE decoder layer, and perhaps
a copy of the embedding (jspec.models.mtp).
"""

from __future__ import annotations

from jspec.config import ModelConfig
from jspec.models import weights as W
from jspec.models.decoder import CausalLM, common_fields
from jspec.models.moe import read_sigmoid_moe

ACTIVATIONS = ("silu",)
ROPE_TYPES = ("default",)  # the family's attention applies plain RoPE only


# The family's model is the neutral decoder stack, dense layers below
# `first_k_dense_replace` and MoE from there (`cfg.layer_is_moe`); the name stays for its callers.
Glm4MoeCausalLM = CausalLM
moe_rules = W.sigmoid_moe_rules


# ---- configuration and checkpoint layout ------------------------------------------------------

def read_config(hf_config, arch: str) -> ModelConfig:
  act = getattr(hf_config, "hidden_act", "silu")
  if act not in ACTIVATIONS:
    raise ValueError(f"hidden_act={act!r} is not supported; jspec supports {list(ACTIVATIONS)}")
  rope = dict(getattr(hf_config, "rope_parameters", None) or {})
  rope_type = rope.get("rope_type", "default")
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"rope_type={rope_type!r} is not supported for {arch}; jspec supports "
                     f"{list(ROPE_TYPES)}")
  # Glm4MoeConfig defaults the factor to 0.5 and files it under rope_parameters.
  partial = rope.get("partial_rotary_factor",
                     getattr(hf_config, "partial_rotary_factor", None) or 0.5)
  return ModelConfig(
      architecture=arch, **common_fields(hf_config, rope), moe=read_sigmoid_moe(hf_config),
      partial_rotary_factor=float(partial),
      attention_bias=bool(getattr(hf_config, "attention_bias", False)),
      use_qk_norm=bool(getattr(hf_config, "use_qk_norm", False)))
