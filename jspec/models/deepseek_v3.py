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

from typing import Callable

import numpy as np
from flax import nnx

from jspec.config import ModelConfig
from jspec.models import weights as W
from jspec.models.layers import MLP, RMSNorm
from jspec.models.mla import MLAttention, mla_cache
from jspec.models.moe import MoE, read_sigmoid_moe_fields
from jspec.models.qwen3 import CausalLM, common_fields
from jspec.models.rope import rope_scaling_items

GLM4_MOE_LITE = "Glm4MoeLiteForCausalLM"
MLP_LAYER_TYPES = ("dense", "sparse")


class DecoderLayer(nnx.Module):
  """x + mla(norm(x)), then h + mlp(norm(h)); the MLP is dense or MoE."""

  def __init__(self, cfg: ModelConfig, is_moe: bool, dtype, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.attn = MLAttention(cfg, dtype, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.is_moe = is_moe
    self.mlp = (MoE(cfg, dtype, rngs) if is_moe
                else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs, cfg.fp8_block))

  def __call__(self, x_BTD, positions_BT, cache, kv_window: int, experts_fn: Callable,
               valid_BT=None):
    del valid_BT  # A latent cache needs no padding mask: padded slots are never attended to.
    attn_out_BTD, cache = self.attn(self.input_norm(x_BTD), positions_BT, cache, kv_window)
    h_BTD = x_BTD + attn_out_BTD
    normed_BTD = self.post_attn_norm(h_BTD)
    mlp_out_BTD = self.mlp(normed_BTD, experts_fn) if self.is_moe else self.mlp(normed_BTD)
    return h_BTD + mlp_out_BTD, cache


class DeepseekV3CausalLM(CausalLM):

  make_norm = RMSNorm

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    self._init_embeddings(cfg, dtype, rngs)
    self.layers = nnx.List([DecoderLayer(cfg, cfg.layer_is_moe(i), dtype, rngs)
                            for i in range(cfg.num_layers)])

  def layer_cache(self, layer_index: int, batch: int, slots: int, dtype):
    return mla_cache(self.cfg, batch, slots, dtype)

  @staticmethod
  def make_mtp_decoder(cfg: ModelConfig, is_moe: bool, dtype, rngs: nnx.Rngs):
    # vLLM deepseek_mtp.py: the NextN layer is a full decoder layer of the model (MLA + MoE).
    return DecoderLayer(cfg, is_moe, dtype, rngs)

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
  moe = read_sigmoid_moe_fields(hf_config)
  layer_types = getattr(hf_config, "mlp_layer_types", None)
  if arch == GLM4_MOE_LITE and layer_types is not None:
    unknown = sorted(set(layer_types) - set(MLP_LAYER_TYPES))
    if unknown or len(layer_types) != hf_config.num_hidden_layers:
      raise ValueError(f"mlp_layer_types must give one of {list(MLP_LAYER_TYPES)} for each of "
                       f"the {hf_config.num_hidden_layers} layers; got {list(layer_types)}")
    moe.update(first_k_dense_replace=0,
               mlp_only_layers=tuple(i for i, t in enumerate(layer_types) if t == "dense"))
  q_lora_rank = getattr(hf_config, "q_lora_rank", None) or 0
  return ModelConfig(
      architecture=arch, **fields, **moe,
      q_lora_rank=int(q_lora_rank), kv_lora_rank=int(hf_config.kv_lora_rank),
      qk_nope_head_dim=int(hf_config.qk_nope_head_dim),
      qk_rope_head_dim=int(hf_config.qk_rope_head_dim), v_head_dim=int(hf_config.v_head_dim),
      rope_scaling=scaling, rope_interleave=bool(getattr(hf_config, "rope_interleave", False)))


# ---- checkpoint layout ----------------------------------------------------------------------

def mla_rules(cfg: ModelConfig, p: str) -> dict:
  """`{p}self_attn.*` -> an MLAttention. kv_b_proj's rows are per head [key nope | value]."""
  d, n = cfg.hidden_size, cfg.num_heads
  q, c = cfg.q_lora_rank, cfg.kv_lora_rank
  nope, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  a = p + "self_attn."
  rule = lambda name, hf_shape, build: W.TensorRule((a + name,), (hf_shape,), build)
  transpose = lambda shape: (lambda w: np.ascontiguousarray(w.T).reshape(shape))
  # Unquantized w_uk / w_uv are [N, P, C]; FP8 ones are read as [N, C, P] here, the generic
  # FP8 rule then moves C back last (jspec.models.layers.linear with lead=1).
  fp8 = cfg.fp8_block is not None
  kv_b = lambda part: (lambda w: np.ascontiguousarray(
      np.swapaxes(w.reshape(n, nope + v, c)[:, part], 1, 2) if fp8
      else w.reshape(n, nope + v, c)[:, part]))
  rules = {
      ("kv_a_proj",): rule("kv_a_proj_with_mqa.weight", (c + r, d), transpose((d, c + r))),
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


def _layer_rules(cfg: ModelConfig, p: str, is_moe: bool, names: set[str]) -> dict:
  d = cfg.hidden_size
  rules = {("input_norm", "scale"): W.norm_rule(p + "input_layernorm.weight", d),
           ("post_attn_norm", "scale"): W.norm_rule(p + "post_attention_layernorm.weight", d)}
  rules.update(W.prefixed(("attn",), mla_rules(cfg, p)))
  mlp = (W.sigmoid_moe_rules(cfg, p, names) if is_moe
         else W.dense_mlp_rules(p + "mlp.", d, cfg.intermediate_size))
  rules.update(W.prefixed(("mlp",), mlp))
  return rules


def decoder_rules(cfg: ModelConfig, names: set[str]) -> Callable[[str, bool], dict]:
  """(prefix, is_moe) -> the rules of one decoder layer (an MTP layer's)."""
  return lambda p, is_moe: _layer_rules(cfg, p, is_moe, names)


def target_rules(cfg: ModelConfig, names: set[str]) -> dict:
  rules = W.embedding_rules(cfg, "norm.weight")
  for i in range(cfg.num_layers):
    rules.update(W.prefixed(("layers", i), _layer_rules(
        cfg, f"{cfg.weight_prefix}layers.{i}.", cfg.layer_is_moe(i), names)))
  return rules
