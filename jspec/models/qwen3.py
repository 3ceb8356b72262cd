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
from jspec.models.layers import MLP, Attention, LayerCache, RMSNorm, param
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
      self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)

  def __call__(self, x_BTD, positions_BT, cache: LayerCache, kv_window: int,
               experts_fn: Callable):
    attn_out_BTD, cache = self.attn(self.input_norm(x_BTD), positions_BT, cache, kv_window)
    h_BTD = x_BTD + attn_out_BTD
    normed_BTD = self.post_attn_norm(h_BTD)
    mlp_out_BTD = self.mlp(normed_BTD, experts_fn) if self.is_moe else self.mlp(normed_BTD)
    return h_BTD + mlp_out_BTD, cache


class Qwen3CausalLM(nnx.Module):
  """Both Qwen3 families: a layer is MoE exactly where `cfg.layer_is_moe(i)` says so."""

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, ("vocab", "embed"),
                       scale=1.0)
    self.layers = nnx.List([DecoderLayer(cfg, cfg.layer_is_moe(i), dtype, rngs)
                            for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype, ("embed", "vocab"))

  def embed_tokens(self, tokens_BT):
    # Clip, not fill: placeholder ids (-1) in rejected slots must embed to finite garbage,
    # since stale cache slots are masked by -inf scores but still multiplied by 0 probabilities.
    return jnp.take(self.embed[...], tokens_BT, axis=0, mode="clip")

  def logits(self, hidden_BTD):
    """float32 logits from post-norm hidden states, through the (possibly tied) lm_head."""
    if self.cfg.tie_word_embeddings:
      return jnp.einsum("btd,vd->btv", hidden_BTD, self.embed[...],
                        preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", hidden_BTD, self.lm_head[...],
                      preferred_element_type=jnp.float32)

  def __call__(self, tokens_BT, positions_BT, caches: Sequence[LayerCache], kv_window: int,
               experts_fn: Callable):
    """Returns (post-final-norm hidden states [B, T, D], updated caches)."""
    x_BTD = self.embed_tokens(tokens_BT)
    new_caches = []
    for layer, cache in zip(self.layers, caches):
      x_BTD, cache = layer(x_BTD, positions_BT, cache, kv_window, experts_fn)
      new_caches.append(cache)
    return self.final_norm(x_BTD), tuple(new_caches)


def empty_caches(cfg: ModelConfig, num_layers: int, batch: int, cache_len: int, dtype):
  """Zeroed per-layer (keys, values) of shape [B, K, S, H]."""
  shape = (batch, cfg.cache_kv_heads, cache_len, cfg.head_dim)
  return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))
