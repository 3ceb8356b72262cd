"""Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: hybrid models whose layers are either
gated full attention or Gated DeltaNet linear attention, as `layer_types` says (transformers
`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`, `Qwen3_5ForCausalLM`,
`Qwen3_5MoeForCausalLM`, `Qwen3NextForCausalLM`). Text generation only.

  - Norms are (1 + w) RMSNorms (`Qwen3NextRMSNorm`), including q/k norms and the MTP head's.
  - Full attention: GQA whose q_proj also emits a per-head output gate; partial RoPE over the
    first `partial_rotary_factor` of each head. Qwen3.5's mRoPE gives text tokens the same
    position on its three (temporal, height, width) axes, and then every frequency sees that
    one position: for text it is exactly 1-D RoPE, which is what runs here.
  - Linear attention: jspec.models.gated_deltanet.
  - MLP: dense SwiGLU, or MoE (softmax top-k, renormalised; Qwen3.5-MoE always renormalises)
    with a shared expert behind a sigmoid gate.
The multimodal layouts keep the text model under `model.language_model.*`; their vision tower
(`model.visual.*`) is never read.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from flax import nnx

from jspec.config import LinearAttentionConfig, ModelConfig, MoEConfig
from jspec.models import quantization
from jspec.models import weights as W
from jspec.models.caches import KVCache
from jspec.models.decoder import CausalLM, common_fields, layer_input, mlp_block
from jspec.models.gated_deltanet import GatedDeltaNet
from jspec.models.layers import Attention
from jspec.models.linear import linear
from jspec.models.mlp import MLP
from jspec.models.moe import MoE
from jspec.models.norms import ZeroCenteredRMSNorm

LAYER_TYPES = ("full_attention", "linear_attention")
MULTIMODAL = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


class GatedAttention(Attention):
  """Qwen3-Next / Qwen3.5 full attention: q_proj emits a query and an output gate per head
  (stored [D, N, 2, H], query first, as the checkpoint's per-head [q | gate] rows), the
  attention output is multiplied by sigmoid(gate) before o_proj, and q/k norms are (1 + w)."""

  norm_cls = ZeroCenteredRMSNorm

  def _init_query(self, cfg, dtype, rngs):
    d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    self.q_proj, self.q_proj_scale = linear(rngs, (d, n, 2, h), dtype,
                                            ("embed", "q_heads", None, "head_dim"), 1,
                                            quantization.block_for(cfg, "self_attn.q_proj"))

  def _project(self, x_BTD):
    qg_BTNCH, k_BTKH, v_BTKH = self._dense_qkv(x_BTD, "btd,dnch->btnch")
    return qg_BTNCH[:, :, :, 0], k_BTKH, v_BTKH, qg_BTNCH[:, :, :, 1]


class DecoderLayer(nnx.Module):
  """x + mixer(norm(x)), then h + mlp(norm(h)); the mixer is gated attention or Gated DeltaNet."""

  def __init__(self, cfg: ModelConfig, layer_type: str, is_moe: bool, dtype, rngs: nnx.Rngs):
    self.input_norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.layer_type = layer_type
    if layer_type == "full_attention":
      self.attn = GatedAttention(cfg, dtype, rngs)
    else:
      self.linear_attn = GatedDeltaNet(cfg, dtype, rngs)
    self.post_attn_norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.is_moe = is_moe
    self.mlp = (MoE(cfg, dtype, rngs) if is_moe
                else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs,
                         quantization.blocks_for(cfg, quantization.MLP_KINDS)))

  def __call__(self, x_BTD, positions_BT, cache, kv_window: int, experts_fn: Callable,
               valid_BT=None):
    h_BTD, mlp_out_BTD, cache = self.deferred(x_BTD, None, positions_BT, cache, kv_window,
                                              experts_fn, valid_BT)
    return h_BTD + mlp_out_BTD, cache

  def deferred(self, x_BTD, pending_BTD, positions_BT, cache, kv_window: int,
               experts_fn: Callable, valid_BT=None):
    """As jspec.models.decoder.DecoderLayer.deferred: the layer on x + pending, returning
    (h, mlp_out, cache)."""
    x_BTD, normed_BTD = layer_input(self.input_norm, x_BTD, pending_BTD)
    if self.layer_type == "full_attention":
      mixed_BTD, cache = self.attn(normed_BTD, positions_BT, cache, kv_window, sum_later=True)
    else:
      mixed_BTD, cache = self.linear_attn(normed_BTD, cache, valid_BT)
    return (*mlp_block(self, x_BTD, mixed_BTD, experts_fn), cache)


class Qwen35CausalLM(CausalLM):

  make_norm = ZeroCenteredRMSNorm

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    self._init_embeddings(cfg, dtype, rngs)
    self.layers = nnx.List([DecoderLayer(cfg, cfg.layer_type(i), cfg.layer_is_moe(i), dtype, rngs)
                            for i in range(cfg.num_layers)])

  def layer_cache(self, layer_index: int, batch: int, slots: int, dtype):
    layer = self.layers[layer_index]
    if layer.layer_type == "linear_attention":
      return layer.linear_attn.empty_cache(batch, dtype)
    return KVCache.zeros(batch, self.cfg.cache_kv_heads, slots, self.cfg.head_dim, dtype)

  @staticmethod
  def make_mtp_decoder(cfg: ModelConfig, is_moe: bool, dtype, rngs: nnx.Rngs):
    # vLLM qwen3_5_mtp.py: the MTP layer is a full-attention decoder layer of the family.
    return DecoderLayer(cfg, "full_attention", is_moe, dtype, rngs)


# ---- configuration --------------------------------------------------------------------------

def read_config(hf_config, arch: str) -> ModelConfig:
  text = getattr(hf_config, "text_config", None) if arch in MULTIMODAL else hf_config
  if text is None:
    raise ValueError(f"{arch} config has no text_config")
  rope = dict(getattr(text, "rope_parameters", None) or {})
  layer_types = tuple(text.layer_types)
  unknown = sorted(set(layer_types) - set(LAYER_TYPES))
  if unknown:
    raise ValueError(f"layer_types has unknown kinds {unknown}; jspec supports {list(LAYER_TYPES)}")
  if len(layer_types) != text.num_hidden_layers:
    raise ValueError(f"layer_types lists {len(layer_types)} layers but num_hidden_layers is "
                     f"{text.num_hidden_layers}")
  fields = common_fields(text, rope)
  if arch in MULTIMODAL:  # the wrapper's tie_word_embeddings decides, as in transformers
    fields["tie_word_embeddings"] = bool(getattr(hf_config, "tie_word_embeddings", False))
  moe = None
  num_experts = int(getattr(text, "num_experts", 0) or 0)
  if num_experts:
    moe = MoEConfig(
        num_experts=num_experts, num_experts_per_tok=text.num_experts_per_tok,
        intermediate_size=text.moe_intermediate_size,
        # Qwen3.5-MoE's router always renormalises (Qwen3VLMoeTextTopKRouter).
        norm_topk_prob=bool(getattr(text, "norm_topk_prob", True)),
        mlp_only_layers=tuple(getattr(text, "mlp_only_layers", None) or ()),
        decoder_sparse_step=int(getattr(text, "decoder_sparse_step", None) or 1),
        shared_expert_intermediate_size=int(
            getattr(text, "shared_expert_intermediate_size", 0) or 0))
  partial = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
  media = tuple(int(t) for name in ("image_token_id", "video_token_id")
                if (t := getattr(hf_config, name, None)) is not None)
  return ModelConfig(
      architecture=arch, **fields, moe=moe, layer_types=layer_types,
      partial_rotary_factor=float(partial),
      linear=LinearAttentionConfig(num_key_heads=text.linear_num_key_heads,
                                   num_value_heads=text.linear_num_value_heads,
                                   key_head_dim=text.linear_key_head_dim,
                                   value_head_dim=text.linear_value_head_dim,
                                   conv_kernel=text.linear_conv_kernel_dim),
      weight_prefix="model.language_model." if arch in MULTIMODAL else "model.",
      multimodal_token_ids=media)


def skipped_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
  return ("model.visual.",) if cfg.architecture in MULTIMODAL else ()


# ---- checkpoint layout ----------------------------------------------------------------------

def linear_attention_rules(cfg: ModelConfig, p: str, names: set[str]) -> dict:
  """`{p}linear_attn.*` -> GatedDeltaNet, from Qwen3.5's separate in_proj_{qkv,z,b,a} or
  Qwen3-Next's per-key-head fused in_proj_qkvz / in_proj_ba (transformers'
  `fix_query_key_value_ordering`), whichever the layer has."""
  d, g = cfg.hidden_size, cfg.linear.num_key_heads
  r = cfg.linear.num_value_heads // g
  dk, dv, x = cfg.linear.key_head_dim, cfg.linear.value_head_dim, cfg.linear.conv_kernel
  q = p + "linear_attn."
  channels = 2 * g * dk + g * r * dv

  def heads_last(a, width):  # HF [rows, D] with rows grouped by head -> [D, G, width]
    return a.T.reshape(d, g, width)

  qkvz_width = 2 * dk + 2 * r * dv
  if q + "in_proj_qkvz.weight" in names:  # rows per key head: [q | k | v | z], then [b | a]
    qkvz = W.TensorRule((q + "in_proj_qkvz.weight",), ((g * qkvz_width, d),),
                        lambda a: heads_last(a, qkvz_width))
    ba = W.TensorRule((q + "in_proj_ba.weight",), ((g * 2 * r, d),),
                      lambda a: heads_last(a, 2 * r))
  else:  # rows: [q (all heads) | k | v], z, b, a each by value head

    def split_qkvz(qkv, z):
      qkv = qkv.T
      parts = (qkv[:, :g * dk].reshape(d, g, dk), qkv[:, g * dk:2 * g * dk].reshape(d, g, dk),
               qkv[:, 2 * g * dk:].reshape(d, g, r * dv), heads_last(z, r * dv))
      return np.concatenate(parts, axis=-1)

    qkvz = W.TensorRule((q + "in_proj_qkv.weight", q + "in_proj_z.weight"),
                        ((channels, d), (g * r * dv, d)), split_qkvz)
    ba = W.TensorRule((q + "in_proj_b.weight", q + "in_proj_a.weight"),
                      ((g * r, d), (g * r, d)),
                      lambda b, a: np.concatenate([heads_last(b, r), heads_last(a, r)], -1))
  if cfg.fp8_block:  # b and a unquantized, beside q, k, v, z (GatedDeltaNet says why)
    projections = {("in_proj",): qkvz, ("in_proj_ba",): ba}
  else:
    projections = {("in_proj",): W.TensorRule(
        qkvz.names + ba.names, qkvz.hf_shapes + ba.hf_shapes,
        lambda *a: np.concatenate([qkvz.build(*a[:len(qkvz.names)]),
                                   ba.build(*a[len(qkvz.names):])], axis=-1))}

  def conv(w):  # [channels, 1, X], channels [q all | k all | v all] -> [X, G, q_g | k_g | v_g]
    w = w[:, 0, :].T
    return np.concatenate([w[:, :g * dk].reshape(x, g, dk),
                           w[:, g * dk:2 * g * dk].reshape(x, g, dk),
                           w[:, 2 * g * dk:].reshape(x, g, r * dv)], axis=-1)

  return {
      **projections,
      ("conv",): W.TensorRule((q + "conv1d.weight",), ((channels, 1, x),), conv),
      ("a_log",): W.TensorRule((q + "A_log",), ((g * r,),), lambda a: a.reshape(g, r)),
      ("dt_bias",): W.TensorRule((q + "dt_bias",), ((g * r,),), lambda a: a.reshape(g, r)),
      ("norm", "scale"): W.norm_rule(q + "norm.weight", dv),
      ("out_proj",): W.TensorRule((q + "out_proj.weight",), ((d, g * r * dv),),
                                  lambda a: np.ascontiguousarray(a.T).reshape(g, r, dv, d)),
  }


def moe_rules(cfg: ModelConfig, p: str, names: set[str]) -> dict:
  rules = W.expert_rules(cfg, p, names)
  if cfg.moe.shared_expert_intermediate_size:
    d = cfg.hidden_size
    rules.update(W.prefixed(("shared_expert",), W.dense_mlp_rules(
        p + "mlp.shared_expert.", d, cfg.moe.shared_expert_intermediate_size)))
    rules[("shared_expert_gate",)] = W.TensorRule(
        (p + "mlp.shared_expert_gate.weight",), ((1, d),), lambda a: np.ascontiguousarray(a.T))
  return rules


def mixer_rules(cfg: ModelConfig, p: str, layer_type: str, names: set[str]) -> dict:
  """Gated attention in full-attention layers, Gated DeltaNet in the others."""
  if layer_type == "full_attention":
    return W.prefixed(("attn",), W.attention_rules(cfg, p, gated=True))
  return W.prefixed(("linear_attn",), linear_attention_rules(cfg, p, names))
