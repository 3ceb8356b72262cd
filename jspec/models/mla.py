"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash; transformers `DeepseekV3Attention`)
over a latent cache.

Projections (transformers names):
  queries  q_a_proj -> q_a_layernorm -> q_b_proj, or one q_proj when q_lora_rank is absent;
           per head [nope (P) | rope (R)]
  latent   kv_a_proj_with_mqa -> [latent (C) | rope key (R)]; kv_a_layernorm on the latent;
           the rope key is one head shared by all query heads
  kv_b     the latent -> per head [key nope (P) | value (V)]: W_UK [N, P, C], W_UV [N, V, C]
  o_proj   per head values -> hidden
The cache (jspec.models.caches.MLACache) keeps per token the normalised latent and the roped
key, C + R values shared by every head, instead of N keys and values.

Two exact forms of the same attention (vLLM `vllm/v1/attention/backends/mla/common.py`):
  absorbed  for decode and verify windows (T <= ABSORBED_MAX_TOKENS): the query's nope part
            goes through W_UK into latent space, q_lat = q_nope W_UK [N, C]; scores are
            q_lat . latent + q_rope . k_rope, i.e. one product of [q_lat | q_rope] with the
            cached row; the probabilities weight the latent rows, and W_UV maps the result
            to each head's value space before o_proj. Only the cache is read per slot.
  expanded  for prefill: every cached latent is expanded to per-head keys and values through
            kv_b (as transformers does), then ordinary attention; cheaper when the window is as
            long as the context.
Queries and every per-head weight split over tp ("q_heads"); the latent and its projection
are the same on every tp shard (replicated, as vLLM and SGLang keep them).

The absorbed form's attention over the latent has two implementations: `latent_attention`
(XLA: scores for the whole cache bucket in float32, then the weighted rows; the latent read
twice) and the flash-decoding kernel jspec.pallas_kernels.mla_decode (each latent block read
once for both products, only each sequence's valid slots, split over the sequence and
merged). `LLM(attention_backend=...)` picks: "pallas", or "auto" on a Hopper GPU, sets
`latent_kernel` on every MLAttention (jspec.models.decode_attention.sharded_mla_decode: under
shard_map, sequences over the batch axes, heads over tp, the latent whole on every shard as
the cache is stored); decode, verify, draft steps and extends then use it. Prefill keeps the
expanded form.

Caching conventions are the KV cache's (jspec.models.layers.Attention): the window's rows
are written at their absolute positions before attending, a query at position p sees slots
j <= p, and only the first `kv_window` slots are read (the kernel reads fewer: each
sequence's slots up to its window's last position).

Shape letters: B batch, T query tokens, S cache slots, D hidden, N heads, Q q_lora_rank,
C kv_lora_rank, P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim, L = C + R.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.config import ModelConfig
from jspec.models import rope as rope_lib
from jspec.models.caches import MLACache, write_slots
from jspec.models import quantization
from jspec.models.linear import linear, project_many_named, project_named
from jspec.models.norms import RMSNorm
from jspec.models.params import param
from jspec.models.tree_attention import active_layout

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not the
# config's rms_norm_eps (DeepseekV3RMSNorm(q_lora_rank), Glm4MoeLiteRMSNorm(kv_lora_rank)).
LATENT_NORM_EPS = 1e-6
# Windows of at most this many tokens per sequence attend in the absorbed form (decode,
# verify, draft steps and extends); longer ones (prefill chunks) in the expanded form.
ABSORBED_MAX_TOKENS = 64


# An FP8 q_a_proj and kv_a_proj_with_mqa in one call of the few-row kernel. DeepSeek-V3 on an
# H200, 6 layers, batch 1: a step 1.1% shorter than with kv_a in a call of its own (BENCHMARKS.md,
# "q_a and kv_a in one FP8 call ..."); before its rows were padded to whole blocks, kv_a took
# XLA's scaled product (3.9 µs a layer).
FUSED_LATENT_PROJECTIONS = True


def kv_a_width(cfg: ModelConfig) -> int:
  """kv_a_proj_with_mqa's output width as stored: C + R, and in an FP8 checkpoint rounded up
  to its block (DeepSeek-V3's 576 rows to 640, zeros past 576, the scales as published: their
  last block row covers the padding), so that the FP8 kernels take it whole."""
  width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
  block = quantization.block_for(cfg, "self_attn.kv_a_proj_with_mqa")
  return width if block is None else -(-width // block[0]) * block[0]


def mla_cache(cfg: ModelConfig, batch: int, slots: int, dtype) -> MLACache:
  return MLACache.zeros(batch, slots, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim, dtype)


def latent_attention(q_BTNL, cache_BSL, positions_BT, scale: float, visible_BTS=None):
  """The absorbed form's attention over the latent: [q_lat | q_rope] against each cached row
  [latent | rope key], causal by position (or where `visible_BTS` [B, T, S] says: a token
  tree); returns the probability-weighted rows [B,T,N,L]
  (their first C values are the latent context). Every head reads the same rows.

  XLA runs this as two matrix products per sequence, scores then the weighted sum, each
  reading every row of the window: twice the latent's bytes, where a fused flash-decoding
  kernel would read them once (`jspec bench` reports the time against the single read)."""
  scores_BNTS = jnp.einsum("btnl,bsl->bnts", q_BTNL, cache_BSL,
                           preferred_element_type=jnp.float32)
  probs_BNTS = _causal_softmax(scores_BNTS * scale, positions_BT, cache_BSL.dtype, visible_BTS)
  # Weights the whole rows, rope key included, and lets the caller drop those R columns: the
  # cache stays one operand of both products (no sliced copy of it), for R / L more
  # multiply-adds.
  return jnp.einsum("bnts,bsl->btnl", probs_BNTS, cache_BSL)


def _causal_softmax(scores_BNTS, positions_BT, dtype, visible_BTS=None):
  """Softmax over the slots each query sees: those up to its position, or `visible_BTS`."""
  if visible_BTS is None:
    visible_BTS = jnp.arange(scores_BNTS.shape[-1])[None, None, :] <= positions_BT[:, :, None]
  scores_BNTS = jnp.where(visible_BTS[:, None], scores_BNTS, -jnp.inf)
  return jax.nn.softmax(scores_BNTS, axis=-1).astype(dtype)


class MLAttention(nnx.Module):

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    d, n = cfg.hidden_size, cfg.num_heads
    mla = cfg.mla
    p, r, v, c = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    self.q_lora_rank = mla.q_lora_rank
    # FP8 checkpoints: every projection kept as published (jspec.models.linear.linear), the
    # per-head query weights flattened (the checkpoint's blocks straddle heads of p + r).
    self.fp8_block = cfg.fp8_block
    block = lambda name: quantization.block_for(cfg, "self_attn." + name)
    if self.q_lora_rank:
      self.q_a_proj, self.q_a_proj_scale = linear(rngs, (d, self.q_lora_rank), dtype,
                                                  ("embed", None), 1, block("q_a_proj"))
      self.q_a_norm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype, axis_name=None)
      self.q_b_proj, self.q_b_proj_scale = linear(
          rngs, (self.q_lora_rank, n, p + r), dtype, (None, "q_heads", "head_dim"), 1,
          block("q_b_proj"), flatten_out=True)
    else:
      self.q_proj, self.q_proj_scale = linear(rngs, (d, n, p + r), dtype,
                                              ("embed", "q_heads", "head_dim"), 1,
                                              block("q_proj"), flatten_out=True)
    self.kv_a_proj, self.kv_a_proj_scale = linear(rngs, (d, kv_a_width(cfg)), dtype,
                                                  ("embed", "latent"), 1,
                                                  block("kv_a_proj_with_mqa"))
    self.kv_a_norm = RMSNorm(c, LATENT_NORM_EPS, dtype, axis_name="latent")
    if block("kv_b_proj") is None:
      self.w_uk = param(rngs, (n, p, c), dtype, ("q_heads", "head_dim", "latent"),
                        scale=c ** -0.5)
      self.w_uv = param(rngs, (n, v, c), dtype, ("q_heads", "head_dim", "latent"),
                        scale=c ** -0.5)
      self.w_uk_scale = self.w_uv_scale = None
    else:  # kv_b_proj's per-head [nope | value] rows: stored [N, P, C] and [N, V, C] alike
      self.w_uk, self.w_uk_scale = linear(rngs, (n, c, p), dtype,
                                          ("q_heads", "latent", "head_dim"), 1,
                                          block("kv_b_proj"), scale=c ** -0.5, lead=1)
      self.w_uv, self.w_uv_scale = linear(rngs, (n, c, v), dtype,
                                          ("q_heads", "latent", "head_dim"), 1,
                                          block("kv_b_proj"), scale=c ** -0.5, lead=1)
    self.o_proj, self.o_proj_scale = linear(rngs, (n, v, d), dtype,
                                            ("q_heads", "head_dim", "embed"), 2,
                                            block("o_proj"), scale=(n * v) ** -0.5)
    self.nope_dim, self.rope_dim, self.latent_dim, self.num_heads = p, r, c, n
    self.value_dim = v
    inv_freq, self.rope_attention_factor = rope_lib.inv_frequencies(r, cfg.rope_theta,
                                                                    cfg.rope_scaling)
    self.inv_freq = tuple(float(f) for f in inv_freq)  # static: a constant of the program
    self.rope_interleave = cfg.rope_interleave
    self.scale = rope_lib.softmax_scale(p + r, cfg.rope_scaling)
    # (q [B,T,N,L], cache [B,S,L], positions [B,T]) -> context [B,T,N,C], set by the LLM for
    # attention_backend "pallas" (jspec.models.decode_attention.sharded_mla_decode); None: XLA.
    self.latent_kernel = None
    # Windows of more query rows (heads x positions, all shards' heads counted) keep XLA's
    # path; None: every window through the kernel (set by the LLM with `latent_kernel`).
    self.latent_kernel_max_rows = None
    # (q [B,T,N,P+R], keys [B,S,N,P+R], values [B,S,N,V], positions [B,T]) -> [B,T,N,V]: the
    # expanded form's attention through a fused kernel (jspec.models.prefill_attention), set
    # by the LLM; None: XLA's two products.
    self.prefill_attention = None
    # FP8 weights only: (x [.., K], w8 [N, K], scale) -> [.., N], set by the LLM on Hopper
    # (jspec.models.projections.sharded_fp8_projection); None: scaled, then XLA's dot.
    self.fp8_projection = None
    self.fp8_lanes = None  # as Attention.fp8_lanes
    # FP8 weights at tp: q_b_proj's and o_proj's products shard by shard, q_a's and kv_a's
    # whole on each shard (jspec.models.fp8_tensor_parallel), set by the LLM; None: XLA's.
    self.fp8_tp = None

  def _rope(self, x, positions_BT):
    return rope_lib.apply_rope(x, positions_BT, jnp.asarray(self.inv_freq, jnp.float32),
                               self.rope_attention_factor, self.rope_interleave)

  def _dense(self, x, name: str, spec: str, in_axes: int = 1):
    return project_named(self, x, name, spec, in_axes)

  def _query_product(self, x, name: str, spec: str):
    """q_b_proj or q_proj (its output heads): shard by shard through the FP8 kernels where tp
    splits its FP8 weight (`fp8_tp`), else `_dense`."""
    sharded = self.fp8_tp and self.fp8_tp.layer_column(self, x, (name,), 0)
    return sharded[0] if sharded else self._dense(x, name, spec)

  def _out_product(self, out_BTNV, defer: bool = False):
    """o_proj (its input heads), as _query_product: each shard's partial, one all-reduce, or
    (`defer`) the partials left to the norm after it (Fp8TensorParallel.row's)."""
    sharded = self.fp8_tp and self.fp8_tp.layer_row(self, out_BTNV, "o_proj", 2, defer)
    if sharded is not None:
      return sharded
    return self._dense(out_BTNV, "o_proj", "btnv,nvd->btd", in_axes=2)

  def _head_weight(self, name: str, dtype):
    """w_uk or w_uv [N, *, C] in `dtype` (an FP8 one multiplied by its block scales)."""
    weight, scale = getattr(self, name)[...], getattr(self, name + "_scale")
    if scale is None:
      return weight
    return quantization.dequantize(weight, scale[...], 1, self.fp8_block, dtype, jnp)

  def project(self, x_BTD, positions_BT):
    """(q_nope [B,T,N,P], roped q_rope [B,T,N,R], the window's cache rows [B,T,L])."""
    n, h = self.num_heads, self.nope_dim + self.rope_dim
    if self.q_lora_rank:
      # At tp (whole on every shard), each shard's one call of the FP8 kernel for both,
      # FUSED_LATENT_PROJECTIONS or not (Fp8TensorParallel.layer_whole).
      whole = self.fp8_tp and self.fp8_tp.layer_whole(self, x_BTD, ("q_a_proj", "kv_a_proj"))
      if whole:
        q_BTQ, kv_BTL = whole
      elif FUSED_LATENT_PROJECTIONS:  # one FP8 call where both take the kernel
        q_BTQ, kv_BTL = project_many_named(self, x_BTD, (("q_a_proj", "btd,dq->btq"),
                                                         ("kv_a_proj", "btd,dl->btl")))
      else:
        q_BTQ = self._dense(x_BTD, "q_a_proj", "btd,dq->btq")
        kv_BTL = self._dense(x_BTD, "kv_a_proj", "btd,dl->btl")
      q_BTNH = self._query_product(self.q_a_norm(q_BTQ), "q_b_proj", "btq,qnh->btnh")
    else:
      q_BTNH = self._query_product(x_BTD, "q_proj", "btd,dnh->btnh")
      whole = self.fp8_tp and self.fp8_tp.layer_whole(self, x_BTD, ("kv_a_proj",))
      kv_BTL = whole[0] if whole else self._dense(x_BTD, "kv_a_proj", "btd,dl->btl")
    q_BTNH = q_BTNH.reshape(*x_BTD.shape[:2], n, h)  # FP8: stored flattened
    q_nope_BTNP = q_BTNH[..., :self.nope_dim]
    q_rope_BTNR = self._rope(q_BTNH[..., self.nope_dim:], positions_BT)
    latent_BTC = self.kv_a_norm(kv_BTL[..., :self.latent_dim])
    k_rope_BTR = self._rope(kv_BTL[..., self.latent_dim:self.latent_dim + self.rope_dim],
                            positions_BT)
    return q_nope_BTNP, q_rope_BTNR, jnp.concatenate([latent_BTC, k_rope_BTR], axis=-1)

  def __call__(self, x_BTD, positions_BT, cache: MLACache, kv_window: int,
               absorbed: bool | None = None, sum_later: bool = False):
    """Writes the window's latent rows at `positions_BT`, attends causally over the first
    `kv_window` slots; `absorbed` None: by the window's length (ABSORBED_MAX_TOKENS).
    sum_later: as Attention's: o_proj's output may be a PartialSum where tp splits its FP8
    weight (_out_product)."""
    q_nope_BTNP, q_rope_BTNR, rows_BTL = self.project(x_BTD, positions_BT)
    tree = active_layout(x_BTD.shape[1])
    if tree is not None:  # a token tree's window: its slots, XLA's masked latent attention
      cache = MLACache(write_slots(cache.latent, rows_BTL, tree.slots(positions_BT), 1))
      q_BTNL = self.absorbed_query(q_nope_BTNP, q_rope_BTNR)
      context_BTNL = latent_attention(q_BTNL, cache.latent[:, :kv_window], positions_BT,
                                      self.scale, tree.visible_BTS(positions_BT, kv_window))
      out_BTNV = jnp.einsum("btnc,nvc->btnv", context_BTNL[..., :self.latent_dim],
                            self._head_weight("w_uv", context_BTNL.dtype))
      return self._out_product(out_BTNV, sum_later), cache
    cache = MLACache(write_slots(cache.latent, rows_BTL, positions_BT, slot_axis=1))
    if absorbed is None:
      absorbed = x_BTD.shape[1] <= ABSORBED_MAX_TOKENS
    if absorbed:
      out_BTNV = self.attend_absorbed(q_nope_BTNP, q_rope_BTNR, cache.latent, positions_BT,
                                      kv_window)
    else:
      out_BTNV = self.attend_expanded(q_nope_BTNP, q_rope_BTNR, cache.latent[:, :kv_window],
                                      positions_BT)
    return self._out_product(out_BTNV, sum_later), cache

  def absorbed_query(self, q_nope_BTNP, q_rope_BTNR):
    """[q_nope W_UK | q_rope] [B,T,N,L]: the query in the cache's row space."""
    q_latent_BTNC = jnp.einsum("btnp,npc->btnc", q_nope_BTNP,
                               self._head_weight("w_uk", q_nope_BTNP.dtype))
    return jnp.concatenate([q_latent_BTNC, q_rope_BTNR.astype(q_latent_BTNC.dtype)], axis=-1)

  def attend_absorbed(self, q_nope_BTNP, q_rope_BTNR, cache_BSL, positions_BT,
                      kv_window: int | None = None):
    """Attention in latent space: the cached rows are read as they are, never per head."""
    context_BTNC = self.latent_context(self.absorbed_query(q_nope_BTNP, q_rope_BTNR), cache_BSL,
                                       positions_BT, kv_window)
    return jnp.einsum("btnc,nvc->btnv", context_BTNC,
                      self._head_weight("w_uv", context_BTNC.dtype))

  def latent_context(self, q_BTNL, cache_BSL, positions_BT, kv_window: int | None = None):
    """The probability-weighted latent rows [B, T, N, C]: through `latent_kernel` where set
    (it reads each sequence's slots up to its position, so it takes the whole cache: a
    slice would be copied before the kernel reads it), else `latent_attention` over the first
    `kv_window` slots (None: all)."""
    _, t, n, _ = q_BTNL.shape
    if self.latent_kernel is not None and (self.latent_kernel_max_rows is None
                                           or t * n <= self.latent_kernel_max_rows):
      return self.latent_kernel(q_BTNL, cache_BSL, positions_BT)
    if kv_window is not None:
      cache_BSL = cache_BSL[:, :kv_window]
    context_BTNL = latent_attention(q_BTNL, cache_BSL, positions_BT, self.scale)
    return context_BTNL[..., :self.latent_dim]

  def attend_expanded(self, q_nope_BTNP, q_rope_BTNR, cache_BSL, positions_BT):
    """transformers' form: per-head keys and values from every cached latent, then attention."""
    latent_BSC, k_rope_BSR = cache_BSL[..., :self.latent_dim], cache_BSL[..., self.latent_dim:]
    k_nope_BSNP = jnp.einsum("bsc,npc->bsnp", latent_BSC,
                             self._head_weight("w_uk", latent_BSC.dtype))
    values_BSNV = jnp.einsum("bsc,nvc->bsnv", latent_BSC,
                             self._head_weight("w_uv", latent_BSC.dtype))
    if self.prefill_attention is not None:
      # One head width for the fused call: the shared roped key repeated over the heads.
      q_BTNH = jnp.concatenate([q_nope_BTNP, q_rope_BTNR.astype(q_nope_BTNP.dtype)], axis=-1)
      k_rope_BSNR = jnp.broadcast_to(k_rope_BSR[:, :, None].astype(k_nope_BSNP.dtype),
                                     (*k_nope_BSNP.shape[:3], self.rope_dim))
      keys_BSNH = jnp.concatenate([k_nope_BSNP, k_rope_BSNR], axis=-1)
      return self.prefill_attention(q_BTNH, keys_BSNH, values_BSNV, positions_BT)
    scores_BNTS = (
        jnp.einsum("btnp,bsnp->bnts", q_nope_BTNP, k_nope_BSNP,
                   preferred_element_type=jnp.float32)
        + jnp.einsum("btnr,bsr->bnts", q_rope_BTNR, k_rope_BSR,
                     preferred_element_type=jnp.float32))
    probs_BNTS = _causal_softmax(scores_BNTS * self.scale, positions_BT, values_BSNV.dtype)
    return jnp.einsum("bnts,bsnv->btnv", probs_BNTS, values_BSNV)
