"""DeepSeek-V3 / V3.1 / R1 (and Kimi-K2's layout) and GLM-4.7-Flash: multi-head latent
attention with MoE (transformers `DeepseekV3ForCausalLM`, `Glm4MoeLiteForCausalLM`).

  - Norms: plain RMSNorms (`DeepseekV3RMSNorm`).
  - Attention: jspec.models.mla (latent cache, absorbed decode), YaRN and interleaved RoPE
    over the rope part of each head (jspec.models.rope).
  - MLP: dense SwiGLU in the first `first_k_dense_replace` layers, then MoE with sigmoid
    group-limited routing and shared experts (jspec.models.moe).
  - MTP: the NextN layers at `model.layers.{num_hidden_layers + j}` (DeepSeek layout), each a
    full MLA decoder layer with its own latent cache (`make_mtp_cache`).

GLM-4.7-Flash is the same model under another name: `Glm4MoeLiteAttention` is
`DeepseekV3Attention`, and GLM's MoE (`Glm4MoeLiteMoE`, `Glm4MoeLiteTopkRouter`) is DeepSeek's
routing with shared experts, line for line. It differs only in how it says which layers are
dense: `mlp_layer_types` ("dense" / "sparse" per layer), which transformers follows and so
does jspec.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec.config import MLAConfig, ModelConfig
from jspec.models import quantization
from jspec.models import weights as W
from jspec.models.decoder import CausalLM, DecoderLayer, common_fields
from jspec.models.mla import MLAttention, kv_a_width, mla_cache
from jspec.models.moe import read_sigmoid_moe
from jspec.models.rope import rope_scaling_items

GLM4_MOE_LITE = "Glm4MoeLiteForCausalLM"
MLP_LAYER_TYPES = ("dense", "sparse")


class MLADecoderLayer(DecoderLayer):
  """x + mla(norm(x)), then h + mlp(norm(h)); the MLP is dense or MoE."""

  make_attention = MLAttention


class DeepseekV3CausalLM(CausalLM):
  """The neutral decoder stack over MLA layers and their latent caches; its NextN layers are
  full MLA decoder layers too (vLLM deepseek_mtp.py), each with a latent cache."""

  layer_class = MLADecoderLayer

  def layer_cache(self, layer_index: int, batch: int, slots: int, dtype):
    return mla_cache(self.cfg, batch, slots, dtype)

  @staticmethod
  def make_mtp_cache(cfg: ModelConfig, batch: int, slots: int, dtype):
    return mla_cache(cfg, batch, slots, dtype)


# ---- configuration --------------------------------------------------------------------------

def read_config(hf_config, arch: str) -> ModelConfig:
  rope = dict(getattr(hf_config, "rope_parameters", None) or {})
  theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
  scaling = rope_scaling_items(rope, hf_config.max_position_embeddings)
  if getattr(hf_config, "attention_bias", False):
    raise ValueError("attention_bias=True is not supported for latent attention (no published "
                     "DeepSeek-V3 or GLM-4.7-Flash checkpoint has projection biases)")
  fields = common_fields(hf_config, {"rope_theta": theta})  # the YaRN part is read above
  moe = read_sigmoid_moe(hf_config)
  layer_types = getattr(hf_config, "mlp_layer_types", None)
  if arch == GLM4_MOE_LITE and layer_types is not None:
    unknown = sorted(set(layer_types) - set(MLP_LAYER_TYPES))
    if unknown or len(layer_types) != hf_config.num_hidden_layers:
      raise ValueError(f"mlp_layer_types must give one of {list(MLP_LAYER_TYPES)} for each of "
                       f"the {hf_config.num_hidden_layers} layers; got {list(layer_types)}")
    moe = dataclasses.replace(
        moe, first_k_dense_replace=0,
        mlp_only_layers=tuple(i for i, t in enumerate(layer_types) if t == "dense"))
  q_lora_rank = getattr(hf_config, "q_lora_rank", None) or 0
  return ModelConfig(
      architecture=arch, **fields, moe=moe,
      mla=MLAConfig(q_lora_rank=int(q_lora_rank), kv_lora_rank=int(hf_config.kv_lora_rank),
                    qk_nope_head_dim=int(hf_config.qk_nope_head_dim),
                    qk_rope_head_dim=int(hf_config.qk_rope_head_dim),
                    v_head_dim=int(hf_config.v_head_dim)),
      rope_scaling=scaling, rope_interleave=bool(getattr(hf_config, "rope_interleave", False)))


# ---- checkpoint layout ----------------------------------------------------------------------

def mla_rules(cfg: ModelConfig, p: str) -> dict:
  """`{p}self_attn.*` -> an MLAttention. kv_b_proj's rows are per head [key nope | value]."""
  d, n = cfg.hidden_size, cfg.num_heads
  q, c = cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank
  nope, r, v = cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
  a = p + "self_attn."
  rule = lambda name, hf_shape, build: W.TensorRule((a + name,), (hf_shape,), build)
  transpose = lambda shape: (lambda w: np.ascontiguousarray(w.T).reshape(shape))
  # Unquantized w_uk / w_uv are [N, P, C]; FP8 ones are read as [N, C, P] here, the generic
  # FP8 rule then moves C back last (jspec.models.linear.linear with lead=1).
  fp8 = quantization.block_for(cfg, "self_attn.kv_b_proj") is not None
  kv_b = lambda part: (lambda w: np.ascontiguousarray(
      np.swapaxes(w.reshape(n, nope + v, c)[:, part], 1, 2) if fp8
      else w.reshape(n, nope + v, c)[:, part]))
  rules = {
      ("kv_a_proj",): rule("kv_a_proj_with_mqa.weight", (c + r, d), lambda w: np.pad(
          w.T, ((0, 0), (0, kv_a_width(cfg) - c - r)))),  # FP8: zero rows to its block
      ("kv_a_norm", "scale"): W.norm_rule(a + "kv_a_layernorm.weight", c),
      ("w_uk",): rule("kv_b_proj.weight", (n * (nope + v), c), kv_b(slice(0, nope))),
      ("w_uv",): rule("kv_b_proj.weight", (n * (nope + v), c), kv_b(slice(nope, nope + v))),
      ("o_proj",): rule("o_proj.weight", (d, n * v), transpose((n, v, d))),
  }
  if q:
    rules[("q_a_proj",)] = rule("q_a_proj.weight", (q, d), transpose((d, q)))
    rules[("q_a_norm", "scale")] = W.norm_rule(a + "q_a_layernorm.weight", q)
    rules[("q_b_proj",)] = rule("q_b_proj.weight", (n * (nope + r), q),
                                transpose((q, n, nope + r)))
  else:
    rules[("q_proj",)] = rule("q_proj.weight", (n * (nope + r), d), transpose((d, n, nope + r)))
  return rules


def mixer_rules(cfg: ModelConfig, p: str, layer_type: str, names: set[str]) -> dict:
  """Every layer's token mixer is latent attention (`mla_rules`)."""
  del layer_type, names
  return W.prefixed(("attn",), mla_rules(cfg, p))


moe_rules = W.sigmoid_moe_rules
