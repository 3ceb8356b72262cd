"""The family-neutral decoder: the pre-norm residual block, the causal LM over a stack of such
blocks, the config fields every decoder-only checkpoint spells the same way, and the builders
of checkpoint rules for both. Every family (jspec.models.registry) builds on this module and
names only what it does differently: its layer class, its caches, its MoE block's tensors
(`moe_rules`) and its token mixer's tensors (`mixer_rules`).

The forward pass returns the final hidden states *after* the final norm; logits are a separate
call so that callers compute them only where needed (the last prompt position in prefill,
every verify position in decoding) and in float32.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
from flax import nnx

from jspec.config import ModelConfig, MTPConfig
from jspec.models import quantization
from jspec.models import weights as W
from jspec.models.caches import KVCache
from jspec.models.layers import Attention
from jspec.models.linear import QKV_NAMES, fp8_rows_fit
from jspec.models.mlp import MLP
from jspec.models.moe import MoE
from jspec.models.norms import RMSNorm
from jspec.models.params import mask_padded_vocab, param

# (cfg, layer prefix, checkpoint names) -> the rules of one MoE block, relative to the layer's
# `mlp` (jspec.models.weights.expert_rules for Qwen3-MoE's layout).
MoeRules = Callable[[ModelConfig, str, set], dict]
# (cfg, layer prefix, layer type, checkpoint names) -> the rules of one token mixer, under the
# layer's attribute name for it ("attn", "linear_attn").
MixerRules = Callable[[ModelConfig, str, str, set], dict]


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h)); the MLP is dense or
  MoE. `make_attention` is the token mixer's class: the config's attention (GQA with the
  config's biases and q/k norms) here, latent attention in a subclass."""

  make_attention = Attention

  def __init__(self, cfg: ModelConfig, is_moe: bool, dtype, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.attn = self.make_attention(cfg, dtype, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.is_moe = is_moe
    if is_moe:
      self.mlp = MoE(cfg, dtype, rngs)
    else:
      self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs,
                     quantization.blocks_for(cfg, quantization.MLP_KINDS))

  def __call__(self, x_BTD, positions_BT, cache, kv_window: int, experts_fn: Callable,
               valid_BT=None):
    h_BTD, mlp_out_BTD, cache = self.deferred(x_BTD, None, positions_BT, cache, kv_window,
                                              experts_fn, valid_BT)
    return h_BTD + mlp_out_BTD, cache

  def deferred(self, x_BTD, pending_BTD, positions_BT, cache, kv_window: int,
               experts_fn: Callable, valid_BT=None):
    """The layer on x + pending (pending: the previous layer's MLP output, None for none),
    the add done with the input norm: (h, mlp_out, cache), the output x' = h + mlp_out left
    to the next norm. Why: with row kernels the add and the norm after it are one kernel,
    where an add ending the layer would be one more (jspec.models.row_kernels)."""
    del valid_BT  # A KV / latent cache needs no padding mask: padded slots are never attended.
    x_BTD, normed_BTD = layer_input(self.input_norm, x_BTD, pending_BTD,
                                    takes_e4m3(self.attn, x_BTD))
    attn_out_BTD, cache = self.attn(normed_BTD, positions_BT, cache, kv_window, sum_later=True)
    return (*mlp_block(self, x_BTD, attn_out_BTD, experts_fn), cache)


def mlp_block(layer, x_BTD, mixed_BTD, experts_fn: Callable):
  """(h, mlp(norm(h))) for h = x + the token mixer's output, through the layer's
  `post_attn_norm` and `mlp` (a MoE where `layer.is_moe`). A MoE layer's norm and router
  product run as one kernel where they can (MoE.norm_and_route)."""
  if layer.is_moe:
    fused = layer.mlp.norm_and_route(layer.post_attn_norm, x_BTD, mixed_BTD, experts_fn)
    if fused is not None:
      h_BTD, normed_BTD, routing = fused
      return h_BTD, layer.mlp(normed_BTD, experts_fn, routing)
  b, t, _ = x_BTD.shape
  quantize = (layer.mlp.reads_e4m3(b * t, experts_fn) if layer.is_moe
              else takes_e4m3(layer.mlp, x_BTD))
  h_BTD, normed_BTD = layer.post_attn_norm.add_and_norm(x_BTD, mixed_BTD, quantize)
  return h_BTD, (layer.mlp(normed_BTD, experts_fn) if layer.is_moe
                 else layer.mlp(normed_BTD, sum_later=True))


def layer_input(norm, x_BTD, pending_BTD, quantize: bool = False):
  """(x + pending, its norm): the layer input and what its token mixer reads (quantize:
  RMSNorm.add_and_norm's)."""
  if pending_BTD is None:
    return x_BTD, norm(x_BTD, quantize)
  return norm.add_and_norm(x_BTD, pending_BTD, quantize)


def takes_e4m3(module, x_BTD) -> bool:
  """Whether `module` (a layer's token mixer or MLP) takes its input as a norm's e4m3 rows
  (linear.E4m3Rows) in this step: its FP8 products read them where the LLM set
  `fp8_e4m3_rows` (jspec.backends.FP8_E4M3_ROWS); an attention layer's, in fp8_qkv_kernel."""
  if isinstance(module, Attention):
    return (getattr(module, "fp8_e4m3_rows", False) and module.fp8_qkv_kernel is not None
            and type(module)._project_rotated is Attention._project_rotated
            and fp8_rows_fit(module, x_BTD, QKV_NAMES))
  takes = getattr(module, "takes_e4m3_rows", None)
  return takes is not None and takes(x_BTD)


class CausalLM(nnx.Module):
  """What every family's model offers the loop: embedding, the layer stack over per-layer
  caches, the final norm, float32 logits, and `init_caches`. As it stands it is the model of
  Qwen3, Llama and GLM-4.5: a `layer_class` layer per config layer, MoE exactly where
  `cfg.layer_is_moe(i)` says so, KV caches. Families change `layer_class`, `make_norm`,
  `layer_cache` / `make_mtp_cache` (the caches of their layers and MTP heads), or `__init__`."""

  make_norm = RMSNorm
  layer_class = DecoderLayer

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    self._init_embeddings(cfg, dtype, rngs)
    self.layers = nnx.List([self.layer_class(cfg, cfg.layer_is_moe(i), dtype, rngs)
                            for i in range(cfg.num_layers)])

  @classmethod
  def make_mtp_decoder(cls, cfg: ModelConfig, is_moe: bool, dtype, rngs: nnx.Rngs):
    """One MTP layer: a full decoder layer of the family (vLLM's MTP modules)."""
    return cls.layer_class(cfg, is_moe, dtype, rngs)

  def _init_embeddings(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    self.cfg = cfg
    # Rows past vocab_size (padding to the vocabulary shards: ModelConfig.padded_for) are zeros.
    v, vp, d = cfg.vocab_size, cfg.padded_vocab_size, cfg.hidden_size
    rows = "vocab" if cfg.tie_word_embeddings else "embed_vocab"  # ShardingRules says why
    self.embed = param(rngs, (v, d), dtype, (rows, "embed"), scale=1.0, pad_to=(vp, d))
    self.final_norm = self.make_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = param(rngs, (d, v), dtype, ("embed", "vocab"), pad_to=(d, vp))
    # Set by the LLM where the mesh splits the vocabulary (jspec.sharding.vocab):
    # (embed [V, D], tokens [B, T]) -> [B, T, D], each shard looking up its own rows.
    self.embedding_lookup = None

  def embed_tokens(self, tokens_BT):
    # Clip, not fill: placeholder ids (-1) in rejected slots must embed to finite garbage,
    # since stale cache slots are masked by -inf scores but still multiplied by 0 probabilities.
    if self.embedding_lookup is not None:
      return self.embedding_lookup(self.embed[...], tokens_BT)
    return jnp.take(self.embed[...], tokens_BT, axis=0, mode="clip")

  def logits(self, hidden_BTD):
    """float32 logits from post-norm hidden states, through the (possibly tied) lm_head; over
    the padded vocabulary, -inf past the true one."""
    tied_head_DV = getattr(self, "tied_head_DV", None)  # the CPU's (with_loop_constants)
    if tied_head_DV is not None:
      logits_BTV = jnp.einsum("btd,dv->btv", hidden_BTD.astype(jnp.float32), tied_head_DV)
    elif self.cfg.tie_word_embeddings:
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
    # Each layer's last residual add is left to the next norm (DecoderLayer.deferred).
    pending_BTD = None
    new_caches, aux = [], {}
    for i, (layer, cache) in enumerate(zip(self.layers, caches)):
      if i in aux_layers:
        aux[i] = x_BTD if pending_BTD is None else x_BTD + pending_BTD
      x_BTD, pending_BTD, cache = layer.deferred(x_BTD, pending_BTD, positions_BT, cache,
                                                 kv_window, experts_fn, valid_BT)
      new_caches.append(cache)
    _, hidden_BTD = layer_input(self.final_norm, x_BTD, pending_BTD)
    if aux_layers:
      return hidden_BTD, tuple(new_caches), tuple(aux[i] for i in aux_layers)
    return hidden_BTD, tuple(new_caches)

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


# ---- configuration ----------------------------------------------------------------------------

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
      mtp=MTPConfig(int(num_mtp)) if num_mtp else None)


# ---- checkpoint layout ------------------------------------------------------------------------

def attention_mixer_rules(cfg: ModelConfig, p: str, layer_type: str, names: set[str]) -> dict:
  """`{p}self_attn.*` -> a DecoderLayer's `attn` (jspec.models.weights.attention_rules)."""
  del layer_type, names  # every layer attends
  return W.prefixed(("attn",), W.attention_rules(cfg, p))


def layer_rules(cfg: ModelConfig, p: str, layer_type: str, is_moe: bool, names: set[str],
                moe_rules: MoeRules, mixer_rules: MixerRules = attention_mixer_rules) -> dict:
  """The rules of one decoder layer whose tensors start with `p`: its two norms, its token
  mixer (`mixer_rules`) and its dense MLP or MoE block (`moe_rules`)."""
  d = cfg.hidden_size
  rules = {("input_norm", "scale"): W.norm_rule(p + "input_layernorm.weight", d),
           ("post_attn_norm", "scale"): W.norm_rule(p + "post_attention_layernorm.weight", d)}
  rules.update(mixer_rules(cfg, p, layer_type, names))
  mlp = (moe_rules(cfg, p, names) if is_moe
         else W.dense_mlp_rules(p + "mlp.", d, cfg.intermediate_size))
  rules.update(W.prefixed(("mlp",), mlp))
  return rules


def decoder_rules(cfg: ModelConfig, names: set[str], moe_rules: MoeRules,
                  mixer_rules: MixerRules = attention_mixer_rules
                  ) -> Callable[[str, bool], dict]:
  """(prefix, is_moe) -> the rules of one full-attention decoder layer (an MTP head's)."""
  return lambda p, is_moe: layer_rules(cfg, p, "full_attention", is_moe, names, moe_rules,
                                       mixer_rules)


def target_rules(cfg: ModelConfig, names: set[str], moe_rules: MoeRules,
                 mixer_rules: MixerRules = attention_mixer_rules) -> dict:
  """Checkpoint tensor names -> the parameters of a whole CausalLM."""
  rules = W.embedding_rules(cfg, "norm.weight")
  for i in range(cfg.num_layers):
    rules.update(W.prefixed(("layers", i), layer_rules(
        cfg, f"{cfg.weight_prefix}layers.{i}.", cfg.layer_type(i), cfg.layer_is_moe(i), names,
        moe_rules, mixer_rules)))
  return rules
