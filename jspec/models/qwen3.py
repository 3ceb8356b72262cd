"""Qwen3 dense and Qwen3-MoE causal language models (transformers `Qwen3ForCausalLM`,
`Qwen3MoeForCausalLM`), written as NNX modules over an explicit KV cache.

The forward pass returns the final hidden states *after* the final norm; logits are a separate
call so that callers compute them only where needed (the last prompt position in prefill,
every verify position in decoding) and in float32.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
from flax import nnx

from jspec.config import ModelConfig
from jspec.models import weights as W
from jspec.models.caches import KVCache
from jspec.models.layers import MLP, Attention, RMSNorm, mask_padded_vocab, param
from jspec.models.moe import MoE


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

  def __init__(self, cfg: ModelConfig, is_moe: bool, dtype, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.attn = Attention(cfg, dtype, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.is_moe = is_moe
    if is_moe:
      self.mlp = MoE(cfg, dtype, rngs)
    else:
      self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs, cfg.fp8_block)

  def __call__(self, x_BTD, positions_BT, cache: KVCache, kv_window: int,
               experts_fn: Callable, valid_BT=None):
    del valid_BT  # A KV cache needs no padding mask: padded slots are never attended to.
    attn_out_BTD, cache = self.attn(self.input_norm(x_BTD), positions_BT, cache, kv_window)
    h_BTD = x_BTD + attn_out_BTD
    normed_BTD = self.post_attn_norm(h_BTD)
    mlp_out_BTD = self.mlp(normed_BTD, experts_fn) if self.is_moe else self.mlp(normed_BTD)
    return h_BTD + mlp_out_BTD, cache


class CausalLM(nnx.Module):
  """What every family's model offers the loop: embedding, the layer stack over per-layer
  caches, the final norm, float32 logits, and `init_caches`. Families set `layers`,
  `final_norm` and `make_norm` / `make_mtp_decoder` / `make_mtp_cache` (the blocks and cache
  of their MTP heads)."""

  def _init_embeddings(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    self.cfg = cfg
    # Rows past vocab_size (padding to the vocabulary shards: ModelConfig.padded_for) are zeros.
    v, vp, d = cfg.vocab_size, cfg.padded_vocab_size, cfg.hidden_size
    self.embed = param(rngs, (v, d), dtype, ("vocab", "embed"), scale=1.0, pad_to=(vp, d))
    self.final_norm = self.make_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = param(rngs, (d, v), dtype, ("embed", "vocab"), pad_to=(d, vp))

  def embed_tokens(self, tokens_BT):
    # Clip, not fill: placeholder ids (-1) in rejected slots must embed to finite garbage,
    # since stale cache slots are masked by -inf scores but still multiplied by 0 probabilities.
    return jnp.take(self.embed[...], tokens_BT, axis=0, mode="clip")

  def logits(self, hidden_BTD):
    """float32 logits from post-norm hidden states, through the (possibly tied) lm_head; over
    the padded vocabulary, -inf past the true one."""
    if self.cfg.tie_word_embeddings:
      logits_BTV = jnp.einsum("btd,vd->btv", hidden_BTD, self.embed[...],
                              preferred_element_type=jnp.float32)
    else:
      logits_BTV = jnp.einsum("btd,dv->btv", hidden_BTD, self.lm_head[...],
                              preferred_element_type=jnp.float32)
    return mask_padded_vocab(logits_BTV, self.cfg.vocab_size)

  def __call__(self, tokens_BT, positions_BT, caches: Sequence, kv_window: int,
               experts_fn: Callable, seq_lens_B=None, aux_layers: tuple[int, ...] = ()):
    """Returns (post-final-norm hidden states [B, T, D], updated caches), and with
    `aux_layers` also the input of each of those layers [B, T, D] (the residual stream before
    layer i, what vLLM hands an EAGLE-3 head: `LlamaModel.forward`'s aux_hidden_states).

    `seq_lens_B` given: a prefill pass, tokens at positions >= seq_lens_B are padding and
    every cache comes back committed. None: a decode or verify window, whose caches the loop
    commits (jspec.models.caches.commit) once it knows how many tokens it keeps.
    """
    valid_BT = None if seq_lens_B is None else positions_BT < seq_lens_B[:, None]
    x_BTD = self.embed_tokens(tokens_BT)
    new_caches, aux = [], {}
    for i, (layer, cache) in enumerate(zip(self.layers, caches)):
      if i in aux_layers:
        aux[i] = x_BTD
      x_BTD, cache = layer(x_BTD, positions_BT, cache, kv_window, experts_fn, valid_BT)
      new_caches.append(cache)
    if aux_layers:
      return self.final_norm(x_BTD), tuple(new_caches), tuple(aux[i] for i in aux_layers)
    return self.final_norm(x_BTD), tuple(new_caches)

  def init_caches(self, batch: int, slots: int, dtype) -> tuple:
    return tuple(self.layer_cache(i, batch, slots, dtype) for i in range(self.cfg.num_layers))

  def layer_cache(self, layer_index: int, batch: int, slots: int, dtype):
    cfg = self.cfg
    return KVCache.zeros(batch, cfg.cache_kv_heads, slots, cfg.head_dim, dtype)

  @staticmethod
  def make_mtp_cache(cfg: ModelConfig, batch: int, slots: int, dtype):
    """The cache of one MTP layer (a `make_mtp_decoder` layer) of a head built with `cfg`:
    a KV cache here; families whose MTP layer keeps another kind override this."""
    return KVCache.zeros(batch, cfg.cache_kv_heads, slots, cfg.head_dim, dtype)


class Qwen3CausalLM(CausalLM):
  """Both Qwen3 families: a layer is MoE exactly where `cfg.layer_is_moe(i)` says so."""

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
  rope = getattr(hf_config, "rope_parameters", None) or {}
  moe = {}
  if arch == "Qwen3MoeForCausalLM":
    moe = dict(num_experts=hf_config.num_experts,
               num_experts_per_tok=hf_config.num_experts_per_tok,
               moe_intermediate_size=hf_config.moe_intermediate_size,
               norm_topk_prob=bool(hf_config.norm_topk_prob),
               mlp_only_layers=tuple(hf_config.mlp_only_layers or ()),
               decoder_sparse_step=int(hf_config.decoder_sparse_step or 1))
  return ModelConfig(architecture=arch, **common_fields(hf_config, rope), **moe)


def common_fields(hf_config, rope: dict) -> dict:
  """The fields every decoder-only config spells the same way (after AutoConfig)."""
  rope_type = rope.get("rope_type", "default")
  if rope_type != "default":
    raise ValueError(f"rope_type={rope_type!r} is not supported; jspec supports 'default'")
  rope_theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
  if rope_theta is None:
    raise ValueError("config has neither rope_parameters['rope_theta'] nor rope_theta")
  num_heads = hf_config.num_attention_heads
  head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
  eos = getattr(hf_config, "eos_token_id", None)
  eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
  num_mtp = (getattr(hf_config, "num_nextn_predict_layers", None)
             or getattr(hf_config, "mtp_num_hidden_layers", None) or 0)
  return dict(
      vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
      intermediate_size=getattr(hf_config, "intermediate_size", 0) or 0,
      num_layers=hf_config.num_hidden_layers, num_heads=num_heads,
      num_kv_heads=hf_config.num_key_value_heads, head_dim=head_dim,
      rms_norm_eps=hf_config.rms_norm_eps, rope_theta=float(rope_theta),
      tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
      max_position_embeddings=hf_config.max_position_embeddings, eos_token_ids=eos_ids,
      num_mtp_layers=int(num_mtp))


def decoder_rules(cfg: ModelConfig, names: set[str]) -> Callable[[str, bool], dict]:
  """(prefix, is_moe) -> the rules of one DecoderLayer whose tensors start with prefix."""
  def rules(p: str, is_moe: bool) -> dict:
    d = cfg.hidden_size
    out = {("input_norm", "scale"): W.norm_rule(p + "input_layernorm.weight", d),
           ("post_attn_norm", "scale"): W.norm_rule(p + "post_attention_layernorm.weight", d)}
    out.update(W.prefixed(("attn",), W.attention_rules(cfg, p)))
    mlp = (W.expert_rules(cfg, p, names) if is_moe
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
