"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (transformers `Glm4MoeForCausalLM`), with its NextN MTP layer.

transformers' `Glm4MoeDecoderLayer` is the pre-norm block of Qwen3 (jspec.models.qwen3) with
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

from typing import Callable

from flax import nnx

from jspec.config import ModelConfig
from jspec.models import weights as W
from jspec.models.layers import RMSNorm
from jspec.models.moe import read_sigmoid_moe_fields
from jspec.models.qwen3 import CausalLM, DecoderLayer, common_fields

ACTIVATIONS = ("silu",)
ROPE_TYPES = ("default",)  # the family's attention applies plain RoPE only


class Glm4MoeCausalLM(CausalLM):
  """Dense layers below `first_k_dense_replace`, MoE from there (`cfg.layer_is_moe`)."""

  make_norm = RMSNorm

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    self._init_embeddings(cfg, dtype, rngs)
    self.layers = nnx.List([DecoderLayer(cfg, cfg.layer_is_moe(i), dtype, rngs)
                            for i in range(cfg.num_layers)])

  @staticmethod
  def make_mtp_decoder(cfg: ModelConfig, is_moe: bool, dtype, rngs: nnx.Rngs):
    return DecoderLayer(cfg, is_moe, dtype, rngs)


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
      architecture=arch, **common_fields(hf_config, rope), **read_sigmoid_moe_fields(hf_config),
      partial_rotary_factor=float(partial),
      attention_bias=bool(getattr(hf_config, "attention_bias", False)),
      use_qk_norm=bool(getattr(hf_config, "use_qk_norm", False)))


def decoder_rules(cfg: ModelConfig, names: set[str]) -> Callable[[str, bool], dict]:
  """(prefix, is_moe) -> the rules of one decoder layer whose tensors start with prefix."""
  def rules(p: str, is_moe: bool) -> dict:
    d = cfg.hidden_size
    out = {("input_norm", "scale"): W.norm_rule(p + "input_layernorm.weight", d),
           ("post_attn_norm", "scale"): W.norm_rule(p + "post_attention_layernorm.weight", d)}
    out.update(W.prefixed(("attn",), W.attention_rules(cfg, p)))
    mlp = (W.sigmoid_moe_rules(cfg, p, names) if is_moe
           else W.dense_mlp_rules(p + "mlp.", d, cfg.intermediate_size))
    out.update(W.prefixed(("mlp",), mlp))
    return out
  return rules


def target_rules(cfg: ModelConfig, names: set[str]) -> dict:
  rules = W.embedding_rules(cfg, "norm.weight")
  layer = decoder_rules(cfg, names)
  for i in range(cfg.num_layers):
    rules.update(W.prefixed(("layers", i),
                            layer(f"{cfg.weight_prefix}layers.{i}.", cfg.layer_is_moe(i))))
  return rules
