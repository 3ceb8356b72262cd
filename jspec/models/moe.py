"""Sparse MoE blocks: a router, the routed experts through a pluggable backend, shared experts.

Two routers, as `cfg.moe.router_scoring` says:
  softmax  Qwen3-MoE / Qwen3.5 (transformers `Qwen3MoeSparseMoeBlock`): softmax over all
           experts in float32, top-k, the k weights renormalised when `norm_topk_prob`.
  sigmoid  DeepSeek-V3 / GLM-4.5 (transformers `DeepseekV3TopkRouter`, `Glm4MoeTopkRouter`;
           DeepSeek's "noaux_tc"): router logits and sigmoid scores in float32; the correction
           bias is added to the scores only to CHOOSE experts; each of `n_group` groups is
           scored by the sum of its two best biased scores, the best `topk_group` groups are
           kept and the top-k experts are chosen inside them; the weights are the chosen
           experts' UNBIASED scores, renormalised (sum + 1e-20) when `norm_topk_prob`, times
           `routed_scaling_factor`.
Shared experts: Qwen's one `shared_expert` behind a sigmoid gate, or DeepSeek / GLM's
`shared_experts` (`num_shared_experts` of them as one dense SwiGLU, ungated), added to the
routed output.

The routed experts are a pluggable function (jspec.models.moe_backends) so the same layer runs
the jnp reference, XLA's ragged_dot or the Pallas kernels, and the expert-parallel shard_map
(jspec.sharding) wraps exactly that function; routing runs before it, on every shard alike.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.config import MoEConfig
from jspec.models import quantization
from jspec.models.linear import E4m3Rows, as_values, linear, reduced
from jspec.models.mlp import MLP
from jspec.models.params import param
from jspec.pallas_kernels import fp8_experts, norm_router, router_topk
from jspec.pallas_kernels.experts import takes_decode_plan, takes_x_e4m3
from jspec.sharding.tensor_parallel import PartialSum

ROUTER_SCORINGS = ("softmax", "sigmoid")
# Whether the router's top-k kernel writes the batch-1 decode plan (MoE._route_with_plan);
# benchmarks turn it off to time it.
ROUTER_PLAN = True
# Whether a layer's residual add and RMSNorm and its router product run as one kernel
# (MoE.norm_and_route); benchmarks turn it off to time it.
NORM_ROUTER = True
# What DeepSeek-style configs may say, and what jspec implements exactly of it.
SCORING_FUNCS = ("sigmoid",)
TOPK_METHODS = ("noaux_tc",)
_NORM_EPSILON = 1e-20  # transformers' denominator guard when renormalising sigmoid weights


def route(router_logits_TE, top_k: int, norm_topk_prob: bool, dtype):
  """Softmax routing: (expert ids [T, K] int32, weights [T, K] in `dtype`)."""
  probs_TE = jax.nn.softmax(router_logits_TE.astype(jnp.float32), axis=-1)
  weights_TK, ids_TK = jax.lax.top_k(probs_TE, top_k)
  if norm_topk_prob:
    weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
  return ids_TK.astype(jnp.int32), weights_TK.astype(dtype)


def route_sigmoid(router_logits_TE, correction_bias_E, top_k: int, n_group: int,
                  topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float, dtype):
  """Sigmoid group-limited routing: (expert ids [T, K] int32, weights [T, K] in `dtype`).

  `correction_bias_E` may be None (no bias). Ties go to the lower expert (and group) index,
  as `jax.lax.top_k` breaks them.
  """
  scores_TE = jax.nn.sigmoid(router_logits_TE.astype(jnp.float32))
  choice_TE = scores_TE
  if correction_bias_E is not None:
    choice_TE = scores_TE + correction_bias_E.astype(jnp.float32)
  if topk_group < n_group:  # keeping every group changes nothing: skip the group scores
    t, e = choice_TE.shape
    grouped_TGX = choice_TE.reshape(t, n_group, e // n_group)
    group_scores_TG = jnp.sum(jax.lax.top_k(grouped_TGX, 2)[0], axis=-1)
    _, groups_TS = jax.lax.top_k(group_scores_TG, topk_group)
    kept_TG = jnp.any(groups_TS[:, :, None] == jnp.arange(n_group), axis=1)
    kept_TE = jnp.repeat(kept_TG, e // n_group, axis=1)
    choice_TE = jnp.where(kept_TE, choice_TE, -jnp.inf)
  _, ids_TK = jax.lax.top_k(choice_TE, top_k)
  weights_TK = jnp.take_along_axis(scores_TE, ids_TK, axis=1)
  if norm_topk_prob:
    weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + _NORM_EPSILON)
  weights_TK = weights_TK * routed_scaling_factor
  return ids_TK.astype(jnp.int32), weights_TK.astype(dtype)


def _whole(fn):
  return fn


class MoE(nnx.Module):
  """The sparse block `cfg` describes: its router, routed experts and shared experts."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    d, e, f = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.intermediate_size
    if cfg.moe.router_scoring not in ROUTER_SCORINGS:
      raise ValueError(f"router_scoring={cfg.moe.router_scoring!r} is not supported; jspec "
                       f"supports {list(ROUTER_SCORINGS)}")
    self.router = param(rngs, (d, e), dtype, ("embed", "experts_router"))
    # Expert weights padded with zeros to the backend's tile (ModelConfig.padded_for): every
    # backend reads these same arrays, and the zeros add nothing (a zero gate/up column gives
    # silu(0) * 0 = 0; a zero down row or hidden column contributes 0 to every sum).
    d_pad, f_pad = cfg.moe_padded_hidden_size, cfg.moe_padded_intermediate_size
    self.fp8_block = block = quantization.block_for(cfg, "mlp.experts")
    if block is None:
      self.w_gate = param(rngs, (e, d, f), dtype, ("experts", "embed", "moe_mlp"),
                          scale=d ** -0.5, pad_to=(e, d_pad, f_pad))
      self.w_up = param(rngs, (e, d, f), dtype, ("experts", "embed", "moe_mlp"),
                        scale=d ** -0.5, pad_to=(e, d_pad, f_pad))
      self.w_down = param(rngs, (e, f, d), dtype, ("experts", "moe_mlp", "embed"),
                          scale=f ** -0.5, pad_to=(e, f_pad, d_pad))
      self.w_gate_scale = self.w_up_scale = self.w_down_scale = None
    else:
      # FP8 experts as published: [E, out, in] e4m3 with their block scales; whole blocks
      # (quantization.refuse_unsupported), so the Pallas tile needs no padding.
      if (d_pad, f_pad) != (d, f):
        raise ValueError(f"FP8 experts of hidden size {d} and intermediate size {f} would be "
                         f"padded to the expert kernels' tile ({d_pad}, {f_pad}); FP8 experts "
                         "take no padding: use moe_backend='reference' or 'ragged_dot'")
      self.w_gate, self.w_gate_scale = linear(rngs, (e, d, f), dtype,
                                              ("experts", "embed", "moe_mlp"), 1, block,
                                              scale=d ** -0.5, lead=1)
      self.w_up, self.w_up_scale = linear(rngs, (e, d, f), dtype,
                                          ("experts", "embed", "moe_mlp"), 1, block,
                                          scale=d ** -0.5, lead=1)
      self.w_down, self.w_down_scale = linear(rngs, (e, f, d), dtype,
                                              ("experts", "moe_mlp", "embed"), 1, block,
                                              scale=f ** -0.5, lead=1)
    self.hidden_padding = d_pad - d
    # A model built for the Pallas expert kernels (expert_tile > 1) hands them FP8 experts as
    # stored: at decode sizes they read the e4m3 bytes (jspec.pallas_kernels.fp8_experts).
    self.fp8_to_backend = (block is not None and tuple(block) == (fp8_experts.BLOCK,) * 2
                           and cfg.expert_tile > 1)
    # Set inside a traced program before a loop of steps: the three block scales repeated
    # over the kernel's lanes (Fp8Experts.lanes; projections.with_loop_constants), or None.
    self.fp8_expert_lanes = None
    # Expert-parallel shards the expert weights are split over (set by the LLM): FP8 steps
    # that gather their routed experts pad them to a multiple of it.
    self.expert_shards = 1
    # Runs the routing (top-k over experts) on each shard's own tokens where the mesh splits
    # them (set by the LLM: jspec.sharding.moe.per_token_shard); the identity otherwise.
    self.per_token_shard = _whole
    # Softmax routing of a step's few tokens in the router kernels (set by the LLM where
    # norm_backend is "pallas": jspec.models.row_kernels.sharded_router); XLA's otherwise.
    self.router_kernel = None
    # The same with the residual add and RMSNorm before the layer, the norm and the router
    # product in one kernel (row_kernels.sharded_norm_router; `norm_and_route`).
    self.norm_router_kernel = None
    # Whether the norm before the layer also writes norm(h) in e4m3 for the FP8 experts' gate /
    # up (set by the LLM: jspec.backends.FP8_E4M3_ROWS; `reads_e4m3`).
    self.fp8_e4m3_rows = False
    self.top_k = cfg.moe.num_experts_per_tok
    self.norm_topk_prob = cfg.moe.norm_topk_prob
    self.scoring = cfg.moe.router_scoring
    self.n_group, self.topk_group = cfg.moe.n_group, cfg.moe.topk_group
    self.routed_scaling_factor = cfg.moe.routed_scaling_factor
    self.has_correction_bias = cfg.moe.router_correction_bias
    if self.has_correction_bias:
      # float32 whatever the model dtype, as transformers and vLLM keep it: biases of similar
      # experts differ below bfloat16's resolution, and they decide which experts run.
      self.correction_bias = param(rngs, (e,), jnp.float32, ("experts_router",), scale=0.1)
    self.has_shared_expert = cfg.moe.shared_expert_intermediate_size > 0
    if self.has_shared_expert:
      # Every token also goes through one dense SwiGLU, scaled by sigmoid(x @ gate).
      self.shared_expert = MLP(d, cfg.moe.shared_expert_intermediate_size, dtype, rngs,
                               quantization.blocks_for(cfg, quantization.SHARED_KINDS))
      self.shared_expert_gate = param(rngs, (d, 1), dtype, ("embed", None))
    self.has_shared_experts = cfg.moe.num_shared_experts > 0
    if self.has_shared_experts:
      self.shared_experts = MLP(d, f * cfg.moe.num_shared_experts, dtype, rngs,
                                quantization.blocks_for(cfg, quantization.SHARED_KINDS))

  def _route(self, x_TD):
    dtype = x_TD.dtype
    if self.scoring == "softmax":
      if self.router_kernel is not None and x_TD.shape[0] <= router_topk.MAX_TOKENS:
        return self.router_kernel(x_TD, self.router[...])
      router_logits_TE = jnp.einsum("td,de->te", x_TD, self.router[...])
      return self.per_token_shard(
          lambda logits, _: route(logits, self.top_k, self.norm_topk_prob, dtype))(
              router_logits_TE, None)
    # transformers computes these logits from float32 copies of x and the router weight.
    router_logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32),
                                  self.router[...].astype(jnp.float32),
                                  precision=jax.lax.Precision.HIGHEST)
    bias_E = self.correction_bias[...] if self.has_correction_bias else None
    return self.per_token_shard(lambda logits, bias: route_sigmoid(
        logits, bias, self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
        self.routed_scaling_factor, dtype))(router_logits_TE, bias_E)

  def _plans(self, num_tokens: int, experts_fn: Callable) -> bool:
    """Whether the router kernel writes the decode plan (router_topk.route_softmax_plan): one
    token of batch-1 decode for the Pallas experts, as the model stores them (FP8 experts
    gathered into copies get other ids), so that no XLA kernel runs between the top-k and
    the expert kernels."""
    return (ROUTER_PLAN and self.scoring == "softmax" and num_tokens == 1
            and takes_decode_plan(experts_fn)
            and (self.fp8_block is None or self.fp8_to_backend))

  def _route_with_plan(self, x_TD, experts_fn: Callable):
    """(ids [1, K], weights [1, K], decode plan) where `_plans` (the plan written by the
    router's top-k kernel), else None."""
    if self.router_kernel is None or not self._plans(x_TD.shape[0], experts_fn):
      return None
    return self.router_kernel(x_TD, self.router[...], plan=True)

  def norm_and_route(self, norm, x_BTD, delta_BTD, experts_fn: Callable):
    """(h, norm(h), routing) for h = x + delta before this layer, `norm` its RMSNorm: the norm
    and the router product in one kernel where the norm and the routing run as kernels
    (norm_router_kernel) and delta is summed already or may be summed first (an FP8 product's
    PartialSum, `optional`); None elsewhere. `routing` goes to __call__ with norm(h)."""
    b, t, _ = x_BTD.shape
    if (self.norm_router_kernel is None or not NORM_ROUTER
        or (isinstance(delta_BTD, PartialSum) and not delta_BTD.optional)
        or delta_BTD.dtype != x_BTD.dtype or not norm.on_kernel(x_BTD)
        or b * t > router_topk.MAX_TOKENS):
      return None
    # An FP8 o_proj's K slices (or, at tp, its shards) summed first: this kernel taking the
    # partials itself measured no faster (BENCHMARKS.md, "FP8 o_proj and down_proj partials
    # summed in the norm ...").
    delta_BTD = reduced(delta_BTD)
    return self.norm_router_kernel(x_BTD, delta_BTD, norm.scale[...], self.router[...],
                                   eps=norm.eps, zero_centered=norm.zero_centered,
                                   plan=self._plans(b * t, experts_fn),
                                   quantize=(self.reads_e4m3(b * t, experts_fn)
                                             and norm_router.quantizes(b * t, x_BTD.shape[2])))

  def reads_e4m3(self, num_tokens: int, experts_fn: Callable) -> bool:
    """Whether the FP8 experts' gate / up take norm(h) in e4m3 as the norm's kernel writes it
    (linear.E4m3Rows): the Pallas experts (takes_x_e4m3) on their FP8 decode path, which
    multiplies e4m3 rows on the FP8 tensor cores with no pass over x of its own."""
    return (self.fp8_e4m3_rows and self.fp8_to_backend and takes_x_e4m3(experts_fn)
            and not self.hidden_padding
            and num_tokens <= fp8_experts.DECODE_PATH_MAX_TOKENS
            and fp8_experts.fits_kernel(*(fp8_experts.Fp8Experts(w[...], sc[...]) for w, sc in (
                (self.w_gate, self.w_gate_scale), (self.w_up, self.w_up_scale),
                (self.w_down, self.w_down_scale)))))

  def _experts_for(self, ids_TK, dtype):
    """(ids, w_gate [E', D, F], w_up, w_down [E', F, D]) as the expert backends take them.

    FP8 experts are multiplied by their scales first, in `dtype`. Where the step routes fewer
    token copies than there are experts (decode and verify steps), only the routed experts
    are: copy c gets its own expert c (a gather of its e4m3 weights and scales), padded to a
    multiple of `expert_shards` so that expert parallelism splits them evenly; the same
    products as with every expert. Otherwise every expert is, each step (no expert kernel
    reads e4m3 yet: both write the multiplied copies and read them again)."""
    weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
    if self.fp8_block is None:
      return (ids_TK, *weights)
    scales = (self.w_gate_scale[...], self.w_up_scale[...], self.w_down_scale[...])
    num_experts = weights[0].shape[0]
    copies = ids_TK.size
    if copies < num_experts:
      rows = -(-copies // self.expert_shards) * self.expert_shards
      flat_ids = ids_TK.reshape(-1)
      valid = (flat_ids >= 0) & (flat_ids < num_experts)
      take = jnp.pad(jnp.where(valid, flat_ids, 0), (0, rows - copies))
      weights = tuple(w[take] for w in weights)
      scales = tuple(sc[take] for sc in scales)
      ids_TK = jnp.where(valid, jnp.arange(copies), -1).reshape(ids_TK.shape).astype(
          ids_TK.dtype)
    return (ids_TK, *(jnp.swapaxes(quantization.dequantize(w, sc, 1, self.fp8_block, dtype,
                                                           jnp), 1, 2)
                      for w, sc in zip(weights, scales)))

  def __call__(self, x_BTD, experts_fn: Callable, routing=None):
    """`routing`: norm_and_route's for this x, None: routed here. x may be the norm's e4m3
    rows (`reads_e4m3`), which only the FP8 experts' gate / up read."""
    e4m3_rows, x_BTD = x_BTD, as_values(x_BTD)
    b, t, d = x_BTD.shape
    x_TD = x_BTD.reshape(b * t, d)
    routing = routing or self._route_with_plan(x_TD, experts_fn) or self._route(x_TD)
    ids_TK, weights_TK, *planned = routing  # (ids, weights) or (ids, weights, decode plan)
    plan = planned[0] if planned else None
    # Activations follow the weights' padded hidden size in, and drop it on the way out.
    x_in_TD = jnp.pad(x_TD, ((0, 0), (0, self.hidden_padding))) if self.hidden_padding else x_TD
    if self.fp8_to_backend:
      lanes = self.fp8_expert_lanes or (None,) * 3
      expert_ids_TK, expert_weights = ids_TK, [
          fp8_experts.Fp8Experts(w[...], sc[...], ln) for (w, sc), ln in zip((
              (self.w_gate, self.w_gate_scale), (self.w_up, self.w_up_scale),
              (self.w_down, self.w_down_scale)), lanes)]
    else:
      expert_ids_TK, *expert_weights = self._experts_for(ids_TK, x_TD.dtype)
    given = {} if plan is None else {"plan": plan}
    if isinstance(e4m3_rows, E4m3Rows):
      given["x_e4m3"] = (e4m3_rows.x8.reshape(b * t, d), e4m3_rows.lanes[0])
    y_TD = experts_fn(x_in_TD, expert_ids_TK, weights_TK, *expert_weights, **given)
    y_BTD = y_TD[:, :d].reshape(b, t, d)
    if self.has_shared_expert:
      gate_BT1 = jax.nn.sigmoid(jnp.einsum("btd,do->bto", x_BTD, self.shared_expert_gate[...]))
      y_BTD = y_BTD + gate_BT1 * self.shared_expert(x_BTD)
    if self.has_shared_experts:
      y_BTD = y_BTD + self.shared_experts(x_BTD)
    return y_BTD


# ---- DeepSeek-V3 / GLM-4.5 configuration keys -------------------------------------------------

def read_sigmoid_moe(hf_config) -> MoEConfig:
  """The MoE group of a DeepSeek-V3 / GLM-4.5 style config, validated.

  `scoring_func` and `topk_method` (DeepSeek's config.json keys; GLM's configs omit them and
  mean sigmoid / noaux_tc, the only routing transformers implements for either) must name what
  jspec implements: another routing is refused, never replaced by this one.
  """
  scoring = getattr(hf_config, "scoring_func", None) or "sigmoid"
  if scoring not in SCORING_FUNCS:
    raise ValueError(f"scoring_func={scoring!r} is not supported; jspec supports "
                     f"{list(SCORING_FUNCS)}")
  method = getattr(hf_config, "topk_method", None) or "noaux_tc"
  if method not in TOPK_METHODS:
    raise ValueError(f"topk_method={method!r} is not supported; jspec supports "
                     f"{list(TOPK_METHODS)}")
  freq = getattr(hf_config, "moe_layer_freq", None) or 1
  if freq != 1:
    raise ValueError(f"moe_layer_freq={freq!r} is not supported; jspec supports 1 (every "
                     "layer from first_k_dense_replace on is MoE, as in transformers)")
  num_experts = int(getattr(hf_config, "n_routed_experts", None)
                    or getattr(hf_config, "num_local_experts", 0) or 0)
  top_k = int(hf_config.num_experts_per_tok)
  n_group = int(getattr(hf_config, "n_group", None) or 1)
  topk_group = int(getattr(hf_config, "topk_group", None) or 1)
  if num_experts < 1 or num_experts % n_group:
    raise ValueError(f"n_group={n_group} must divide n_routed_experts={num_experts}")
  if not 1 <= topk_group <= n_group:
    raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
  per_group = num_experts // n_group
  if n_group > 1 and per_group < 2:
    raise ValueError(f"group-limited routing scores each group by its top-2 experts; "
                     f"n_routed_experts={num_experts} / n_group={n_group} leaves {per_group}")
  if not 1 <= top_k <= topk_group * per_group:
    raise ValueError(f"num_experts_per_tok={top_k} must be in [1, topk_group * experts per "
                     f"group = {topk_group * per_group}]")
  return MoEConfig(
      num_experts=num_experts, num_experts_per_tok=top_k,
      intermediate_size=int(hf_config.moe_intermediate_size),
      norm_topk_prob=bool(hf_config.norm_topk_prob), router_scoring="sigmoid",
      router_correction_bias=True, n_group=n_group, topk_group=topk_group,
      routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", None) or 1.0),
      num_shared_experts=int(getattr(hf_config, "n_shared_experts", None) or 0),
      first_k_dense_replace=int(getattr(hf_config, "first_k_dense_replace", None) or 0))
