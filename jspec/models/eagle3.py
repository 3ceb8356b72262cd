"""EAGLE-3 draft heads as published (Li et al. 2025, "EAGLE-3"; vLLM `llama_eagle3.py`).

Checkpoint layout (config `architectures: ["LlamaForCausalLMEagle3"]`, a Llama config with
`num_hidden_layers: 1`, `draft_vocab_size`, optionally `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids`, `norm_before_residual`):
  fc.weight                        [H, 3 * H_target]  the target's three layer inputs -> H
  midlayer.input_layernorm.weight  [H]     norm of the token embedding
  midlayer.hidden_norm.weight      [H]     norm of the hidden state
  midlayer.self_attn.{q,k,v}_proj  [*, 2H] attention over concat[norm(embed), norm(hidden)]
  midlayer.self_attn.o_proj, midlayer.post_attention_layernorm, midlayer.mlp.*  (Llama)
  norm.weight, lm_head.weight [V_draft, H], d2t [V_draft] (draft id -> target id offset),
  t2d [V_target] (bool: which target ids the draft vocabulary holds; not needed to draft),
  embed_tokens.weight (only in heads trained with their own embedding; else the target's).

One step at position i (vLLM `LlamaDecoderLayer.forward` for layer 0, then `LlamaModel`):
    residual = h;  x = concat[input_layernorm(embed(t_{i+1})), hidden_norm(h)]
    residual = residual + o_proj(attn(x));  y = residual + mlp(post_attention_layernorm(residual))
    logits = lm_head(norm(y)) over the draft vocabulary, scattered to target ids d + d2t[d]
(`norm_before_residual`: the residual is hidden_norm(h) instead of h.) At a target position h
is fc(concat[the target's inputs of the aux layers]); for the next draft step it is the head's
own pre-norm output y (vLLM feeds back `hidden_prenorm`). The aux layers are the config's
`eagle_aux_hidden_state_layer_ids`, else vLLM's default (2, L // 2, L - 3)
(`get_eagle3_aux_hidden_state_layers`), where id i is the input of target layer i.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.config import ModelConfig
from jspec.models import weights as W
from jspec.models.caches import KVCache
from jspec.models.layers import Attention
from jspec.models.mlp import MLP
from jspec.models.norms import RMSNorm
from jspec.models.params import param
from jspec.sharding.rules import global_array

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  layer: ModelConfig                 # the midlayer's Llama config (vocab: the target's)
  draft_vocab_size: int
  target_hidden_size: int
  aux_layer_ids: tuple[int, ...]     # inputs of these target layers feed `fc`
  norm_before_residual: bool = False
  has_own_embed: bool = False


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
  """vLLM's default (`get_eagle3_aux_hidden_state_layers` in llama.py, qwen2.py, ...)."""
  return (2, num_target_layers // 2, num_target_layers - 3)


def read_eagle3_config(hf_config, target_cfg: ModelConfig, names: set[str]) -> Eagle3Config:
  from jspec.models import llama  # the midlayer is a Llama layer
  archs = list(getattr(hf_config, "architectures", None) or [])
  if not set(archs) & set(EAGLE3_ARCHITECTURES):
    raise ValueError(f"an eagle3 draft needs a config with architectures "
                     f"{list(EAGLE3_ARCHITECTURES)}; got {archs or hf_config.model_type!r}")
  if int(hf_config.num_hidden_layers) != 1:
    raise ValueError(f"EAGLE-3 heads have one decoder layer (midlayer); this config has "
                     f"num_hidden_layers={hf_config.num_hidden_layers}")
  layer = llama.read_config(hf_config, llama.LLAMA)
  if layer.attention_bias or layer.o_proj_bias:
    raise ValueError("EAGLE-3 heads with attention biases are not supported (no published head "
                     "jspec knows has them); attention_bias must be false")
  if layer.vocab_size != target_cfg.vocab_size:
    raise ValueError(f"the EAGLE-3 head's vocab_size {layer.vocab_size} differs from the "
                     f"target's {target_cfg.vocab_size}")
  layer = dataclasses.replace(layer, vocab_size=target_cfg.vocab_size)
  aux = tuple(int(i) for i in (getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
                               or default_aux_layers(target_cfg.num_layers)))
  if len(aux) != 3 or not all(0 <= i < target_cfg.num_layers for i in aux):
    raise ValueError(f"EAGLE-3 aux layers {aux} must be three layer ids of the target "
                     f"(0 .. {target_cfg.num_layers - 1})")
  target_hidden = int(getattr(hf_config, "target_hidden_size", None) or layer.hidden_size)
  if target_hidden != target_cfg.hidden_size:
    raise ValueError(f"the EAGLE-3 head reads target hidden states of size {target_hidden}; "
                     f"the target's hidden_size is {target_cfg.hidden_size}")
  has_own_embed = "embed_tokens.weight" in names
  if layer.hidden_size != target_cfg.hidden_size and not has_own_embed:
    # Without its own table the head embeds with the target's, whose rows are the target's width.
    raise ValueError(f"the EAGLE-3 head's hidden_size {layer.hidden_size} differs from the "
                     f"target's {target_cfg.hidden_size} and it has no embed_tokens.weight of "
                     "its own: the target's embedding cannot feed it")
  return Eagle3Config(
      layer=layer, draft_vocab_size=int(getattr(hf_config, "draft_vocab_size", None)
                                        or layer.vocab_size),
      target_hidden_size=target_hidden, aux_layer_ids=aux,
      norm_before_residual=bool(getattr(hf_config, "norm_before_residual", False)),
      has_own_embed=has_own_embed)


class _WideInputAttention(Attention):
  """Llama attention whose q/k/v read a 2H-wide input (the embedding and hidden halves)."""

  def __init__(self, cfg: ModelConfig, input_size: int, dtype, rngs: nnx.Rngs):
    super().__init__(cfg, dtype, rngs)
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kv_axis = "kv_heads" if self.kv_replicas == 1 else None
    self.q_proj = param(rngs, (input_size, n, h), dtype, ("mtp_concat", "q_heads", "head_dim"))
    self.k_proj = param(rngs, (input_size, k, h), dtype, ("mtp_concat", kv_axis, "head_dim"))
    self.v_proj = param(rngs, (input_size, k, h), dtype, ("mtp_concat", kv_axis, "head_dim"))


class Eagle3Layer(nnx.Module):
  """The midlayer with the head's final norm and lm_head: the `layers[i]` surface of
  jspec.speculative.drafters.hidden_state."""

  def __init__(self, ecfg: Eagle3Config, dtype, rngs: nnx.Rngs):
    cfg, d = ecfg.layer, ecfg.layer.hidden_size
    self.input_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
    self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
    self.attn = _WideInputAttention(cfg, 2 * d, dtype, rngs)
    self.post_attn_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
    self.mlp = MLP(d, cfg.intermediate_size, dtype, rngs)
    self.final_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
    # The draft vocabulary is small and not split (a replicated [D, V_draft] head).
    self.head = param(rngs, (d, ecfg.draft_vocab_size), dtype, ("embed", None))
    if ecfg.has_own_embed:
      self.embed = param(rngs, (cfg.vocab_size, d), dtype, (None, "embed"), scale=1.0)
    self.has_own_embed = ecfg.has_own_embed
    self.norm_before_residual = ecfg.norm_before_residual
    self.target_ids = nnx.data(None)  # [V_draft] int32, set at load (d + d2t[d])

  def __call__(self, target, next_tokens_BT, hidden_BTD, positions_BT, cache: KVCache,
               kv_window: int, experts_fn: Callable):
    del experts_fn  # dense
    if self.has_own_embed:
      embedded_BTD = jnp.take(self.embed[...], next_tokens_BT, axis=0, mode="clip")
    else:
      embedded_BTD = target.embed_tokens(next_tokens_BT)
    normed_hidden_BTD = self.hidden_norm(hidden_BTD)
    residual_BTD = normed_hidden_BTD if self.norm_before_residual else hidden_BTD
    x_BT2D = jnp.concatenate([self.input_norm(embedded_BTD), normed_hidden_BTD], axis=-1)
    attn_out_BTD, cache = self.attn(x_BT2D, positions_BT, cache, kv_window)
    residual_BTD = residual_BTD + attn_out_BTD
    prenorm_BTD = residual_BTD + self.mlp(self.post_attn_norm(residual_BTD))
    return self.final_norm(prenorm_BTD), prenorm_BTD, cache

  def logits(self, target, normed_BTD):
    """float32 logits over the target's padded vocabulary: the draft vocabulary's columns at
    their target ids, -inf elsewhere (so drafts are target ids, and a sampled draft's
    distribution is zero outside the draft vocabulary, which rejection sampling accounts for)."""
    draft_BTN = jnp.einsum("btd,dn->btn", normed_BTD, self.head[...],
                           preferred_element_type=jnp.float32)
    full_BTV = jnp.full(draft_BTN.shape[:-1] + (target.cfg.padded_vocab_size,), -jnp.inf,
                        jnp.float32)
    return full_BTV.at[..., self.target_ids[...]].set(draft_BTN)


class Eagle3Head(nnx.Module):

  def __init__(self, ecfg: Eagle3Config, dtype, rngs: nnx.Rngs):
    self.ecfg = ecfg
    self.cfg = ecfg.layer
    d = ecfg.layer.hidden_size
    self.fc = param(rngs, (3 * ecfg.target_hidden_size, d), dtype, ("mtp_concat", "embed"))
    self.layers = nnx.List([Eagle3Layer(ecfg, dtype, rngs)])
    self.aux_layers = ecfg.aux_layer_ids

  def set_target_ids(self, target_ids_N, sharding):
    """The target id of each draft id (`draft_to_target_ids`), placed replicated."""
    self.layers[0].target_ids = nnx.Variable(global_array(np.asarray(target_ids_N, np.int32),
                                                          sharding))

  def target_features(self, target, hidden_BTD, aux_BTD):
    """fc over the target's three aux layer inputs (vLLM `combine_hidden_states`)."""
    del target, hidden_BTD
    concat_BTC = jnp.concatenate(aux_BTD, axis=-1)
    return jnp.einsum("btc,cd->btd", concat_BTC, self.fc[...])

  def init_caches(self, batch: int, slots: int, dtype) -> tuple:
    cfg = self.cfg
    return (KVCache.zeros(batch, cfg.cache_kv_heads, slots, cfg.head_dim, dtype),)


def eagle3_rules(ecfg: Eagle3Config) -> dict:
  """Published tensor names -> Eagle3Head parameters (d2t / t2d are read apart: integers)."""
  cfg, d = ecfg.layer, ecfg.layer.hidden_size
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  t = lambda shape: (lambda a: np.ascontiguousarray(a.T).reshape(shape))
  rule = lambda name, hf_shape, build: W.TensorRule((name,), (hf_shape,), build)
  a = "midlayer.self_attn."
  layer = {
      ("input_norm", "scale"): W.norm_rule("midlayer.input_layernorm.weight", d),
      ("hidden_norm", "scale"): W.norm_rule("midlayer.hidden_norm.weight", d),
      ("post_attn_norm", "scale"): W.norm_rule("midlayer.post_attention_layernorm.weight", d),
      ("final_norm", "scale"): W.norm_rule("norm.weight", d),
      ("attn", "q_proj"): rule(a + "q_proj.weight", (n * h, 2 * d), t((2 * d, n, h))),
      ("attn", "k_proj"): rule(a + "k_proj.weight", (k * h, 2 * d), t((2 * d, k, h))),
      ("attn", "v_proj"): rule(a + "v_proj.weight", (k * h, 2 * d), t((2 * d, k, h))),
      ("attn", "o_proj"): rule(a + "o_proj.weight", (d, n * h), t((n, h, d))),
      ("head",): rule("lm_head.weight", (ecfg.draft_vocab_size, d), t((d, ecfg.draft_vocab_size))),
  }
  layer.update(W.prefixed(("mlp",), W.dense_mlp_rules("midlayer.mlp.", d, cfg.intermediate_size)))
  if ecfg.has_own_embed:
    layer[("embed",)] = rule("embed_tokens.weight", (cfg.vocab_size, d), lambda x: x)
  rules = W.prefixed(("layers", 0), layer)
  rules[("fc",)] = rule("fc.weight", (d, 3 * ecfg.target_hidden_size),
                        t((3 * ecfg.target_hidden_size, d)))
  return rules


def draft_to_target_ids(d2t_N: np.ndarray | None, draft_vocab: int, target_vocab: int):
  """Target id of each draft id: d + d2t[d] (vLLM `Eagle3LlamaForCausalLM.compute_logits`);
  without d2t the draft vocabulary is the target's."""
  ids = np.arange(draft_vocab, dtype=np.int64)
  if d2t_N is not None:
    if tuple(d2t_N.shape) != (draft_vocab,):
      raise ValueError(f"d2t has shape {tuple(d2t_N.shape)}, expected ({draft_vocab},)")
    ids = ids + d2t_N.astype(np.int64)
  elif draft_vocab != target_vocab:
    raise ValueError(f"draft_vocab_size {draft_vocab} differs from the target's {target_vocab} "
                     "and the checkpoint has no d2t mapping")
  if ids.min() < 0 or ids.max() >= target_vocab or len(np.unique(ids)) != draft_vocab:
    raise ValueError("d2t maps draft ids outside the target vocabulary or onto one id twice")
  return ids.astype(np.int32)
