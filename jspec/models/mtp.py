"""Multi-token-prediction (MTP) draft heads, DeepSeek-V3 style, in two checkpoint layouts.

The math (DeepSeek-V3 report section 2.2; vLLM `deepseek_mtp.py` and `qwen3_next_mtp.py`):
the MTP input at position i pairs the target's hidden state h_i (the one that predicted
t_{i+1}) with the embedding of t_{i+1}, and predicts t_{i+2}:

    x_i = proj( concat[ norm_e(embed(t_{i+1})), norm_h(h_i) ] )      # embedding FIRST
    y_i = decoder_layer(x_i)            # causal attention over the head's own KV cache, RoPE position i
    logits_i = lm_head( norm_f(y_i) )

h_i is the target's final hidden state AFTER its final norm (what vLLM's model runner hands
to the proposer). The norms and the decoder layer are the target family's own (`make_norm`,
`make_mtp_decoder` of its model class): plain RMSNorm and the neutral decoder layer
(jspec.models.decoder) for Qwen3 and GLM-4.5, (1 + w) norms and a gated-attention layer for
Qwen3-Next / Qwen3.5 (vLLM `qwen3_5_mtp.py`).
The layer's cache is the family's too (`make_mtp_cache`: a KV cache, or MLA's latent cache).
`embed` and `lm_head` are the target's, except in the DeepSeek-V3 layout where the layer's own
`embed_tokens` / `shared_head.head` differ from them (loading compares the bytes and keeps one
copy of what is equal).

DeepSeek-V3 / GLM-4.5 layout only: the embedding at RoPE position 0 is zeroed before `enorm`,
as vLLM `deepseek_mtp.py` (`DeepSeekMultiTokenPredictorLayer.forward`) and `glm4_moe_mtp.py`
do for the models with this layout ("masking inputs at position 0, as not needed by MTP").
Position 0 pairs the first prompt token's hidden state with the second token; the Qwen3-Next
layout (`qwen3_next_mtp.py`) keeps that embedding.

For draft step j > 1 the head is applied again at the next position to its own previous
output, with layer (j - 1) mod num_layers; the hidden state fed back differs by layout,
following the reference implementations:
  - Qwen3-Next / Qwen3.5 (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`): the head's forward
    returns norm_f(y) and vLLM feeds that back -> POST-norm feedback.
  - DeepSeek-V3 / GLM-4.5 (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`): the forward returns
    y (the residual stream) and `shared_head.norm` is applied only for logits -> PRE-norm feedback.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.config import ModelConfig
from jspec.models.caches import KVCache
from jspec.models.params import mask_padded_vocab, param

MTP_LAYOUTS = ("qwen3_next", "deepseek_v3")


@dataclasses.dataclass(frozen=True)
class MTPSpec:
  """What a checkpoint's MTP weights look like; found from its tensor names (weights.py)."""
  layout: str
  num_layers: int
  is_moe: bool
  has_own_head: bool = False   # DeepSeek-V3 `shared_head.head`, unequal to the target's head
  has_own_embed: bool = False  # DeepSeek-V3 `embed_tokens`, unequal to the target's embedding

  @property
  def post_norm_feedback(self) -> bool:
    return self.layout == "qwen3_next"

  @property
  def zeroes_first_embedding(self) -> bool:
    return self.layout == "deepseek_v3"


class MTPLayer(nnx.Module):

  def __init__(self, cfg: ModelConfig, spec: MTPSpec, dtype, rngs: nnx.Rngs, family):
    d = cfg.hidden_size
    self.embed_norm = family.make_norm(d, cfg.rms_norm_eps, dtype)
    self.hidden_norm = family.make_norm(d, cfg.rms_norm_eps, dtype)
    self.proj = param(rngs, (2 * d, d), dtype, ("mtp_concat", "embed"))
    self.decoder = family.make_mtp_decoder(cfg, spec.is_moe, dtype, rngs)
    self.final_norm = family.make_norm(d, cfg.rms_norm_eps, dtype)
    v, vp = cfg.vocab_size, cfg.padded_vocab_size  # padded as the target's (sharded_configs)
    if spec.has_own_head:
      self.head = param(rngs, (d, v), dtype, ("embed", "vocab"), pad_to=(d, vp))
    if spec.has_own_embed:
      self.embed = param(rngs, (v, d), dtype, ("embed_vocab", "embed"), scale=1.0,
                         pad_to=(vp, d))
    # As CausalLM.embedding_lookup: set by the LLM where the mesh splits the vocabulary.
    self.embedding_lookup = None
    self.post_norm_feedback = spec.post_norm_feedback
    self.zeroes_first_embedding = spec.zeroes_first_embedding
    self.has_own_head = spec.has_own_head
    self.has_own_embed = spec.has_own_embed
    # Set by restrict_vocab (data, not static: they become arrays of the module's state).
    self.draft_head = nnx.data(None)  # [D, N] columns of the head
    self.draft_ids = nnx.data(None)   # [N] the token ids of those columns

  def __call__(self, target, next_tokens_BT, hidden_BTD, positions_BT,
               cache: KVCache, kv_window: int, experts_fn: Callable):
    """Returns (post-norm hidden [B, T, D], feedback hidden [B, T, D], updated cache).

    Logits are a separate call (`logits`) so callers project only the positions they use.
    """
    if self.has_own_embed and self.embedding_lookup is not None:
      embedded_BTD = self.embedding_lookup(self.embed[...], next_tokens_BT)
    elif self.has_own_embed:  # clipped like the target's lookup (CausalLM.embed_tokens says why)
      embedded_BTD = jnp.take(self.embed[...], next_tokens_BT, axis=0, mode="clip")
    else:
      embedded_BTD = target.embed_tokens(next_tokens_BT)
    if self.zeroes_first_embedding:
      embedded_BTD = jnp.where((positions_BT == 0)[..., None], 0, embedded_BTD)
    embedded_BTD = self.embed_norm(embedded_BTD)
    concat_BT2D = jnp.concatenate([embedded_BTD, self.hidden_norm(hidden_BTD)], axis=-1)
    x_BTD = jnp.einsum("btc,cd->btd", concat_BT2D, self.proj[...])
    h_BTD, mlp_out_BTD, cache = self.decoder.deferred(x_BTD, None, positions_BT, cache,
                                                      kv_window, experts_fn)
    y_BTD, normed_BTD = self.final_norm.add_and_norm(h_BTD, mlp_out_BTD)
    feedback_BTD = normed_BTD if self.post_norm_feedback else y_BTD
    return normed_BTD, feedback_BTD, cache

  def restrict_vocab(self, target, ids_N: jax.Array, head_sharding):
    """Drafts only among the tokens `ids_N` (a reduced draft vocabulary, as in FR-Spec and
    EAGLE-3): each draft step reads an [D, N] slice of the head instead of all [D, V], and the
    other tokens get -inf logits. Verification still scores the full vocabulary, so outputs
    are unchanged: greedy drafts outside the set are simply never proposed, and a sampled
    draft's distribution q is zero outside it, which rejection sampling accounts for exactly.
    `ids_N` must be replicated; the slice is placed with `head_sharding` ("embed", "vocab")."""
    if self.has_own_head or not target.cfg.tie_word_embeddings:
      weight = self.head[...] if self.has_own_head else target.lm_head[...]  # [D, V]
      columns = lambda w, ids: jnp.take(w, ids, axis=1)
    else:  # Tied: the head is the [V, D] embedding table; take rows, then transpose.
      weight = target.embed[...]  # [V, D]
      columns = lambda w, ids: jnp.take(w, ids, axis=0).T
    take = jax.jit(columns, out_shardings=head_sharding)
    self.draft_head = nnx.Param(take(weight, ids_N), logical_axes=("embed", "vocab"),
                                init_scale=None)
    self.draft_ids = nnx.Variable(ids_N)

  def logits(self, target, normed_BTD):
    """float32 logits through `shared_head.head` when the checkpoint has one, else the target's
    (over the draft vocabulary only, -inf elsewhere, after `restrict_vocab`)."""
    if self.draft_ids is not None:
      kept_BTN = jnp.einsum("btd,dn->btn", normed_BTD, self.draft_head[...],
                            preferred_element_type=jnp.float32)
      full_BTV = jnp.full(kept_BTN.shape[:-1] + (target.cfg.padded_vocab_size,), -jnp.inf,
                          jnp.float32)
      return full_BTV.at[..., self.draft_ids[...]].set(kept_BTN)
    if self.has_own_head:
      logits_BTV = jnp.einsum("btd,dv->btv", normed_BTD, self.head[...],
                              preferred_element_type=jnp.float32)
      return mask_padded_vocab(logits_BTV, target.cfg.vocab_size)
    return target.logits(normed_BTD)


class MTPHead(nnx.Module):
  """The checkpoint's MTP layers; draft step j uses layer (j - 1) mod num_layers."""

  def __init__(self, cfg: ModelConfig, spec: MTPSpec, dtype, rngs: nnx.Rngs, family):
    """`family`: the target's model class, whose blocks (and caches) the head is built from."""
    self.cfg = cfg  # its own: a draft replicated over tp keeps KV heads uncopied
    self.spec = spec
    self.family = family
    self.layers = nnx.List([MTPLayer(cfg, spec, dtype, rngs, family)
                            for _ in range(spec.num_layers)])

  aux_layers = ()  # reads the target's final hidden state only

  def target_features(self, target, hidden_BTD, aux_BTD):
    """The first layer's hidden input at a target position: the target's final hidden state."""
    del target, aux_BTD
    return hidden_BTD

  def init_caches(self, batch: int, slots: int, dtype) -> tuple:
    """One cache per layer, of the family's kind (`make_mtp_cache`); the memory plan counts
    these same caches (jax.eval_shape of this method)."""
    return tuple(self.family.make_mtp_cache(self.cfg, batch, slots, dtype) for _ in self.layers)
