"""Qwen3-MoE sparse block: softmax router, top-k, optional renormalisation, expert backend,
and (Qwen3-Next / Qwen3.5, transformers' `Qwen2MoeSparseMoeBlock`) a shared expert.

Routing follows transformers' `Qwen3MoeSparseMoeBlock`: softmax over all experts in float32,
top-k, renormalise the k weights when `norm_topk_prob`, cast to the activation dtype. The
expert computation itself is a pluggable function (jspec.models.moe_backends) so the same layer
runs the jnp reference, XLA's ragged_dot or the Pallas kernels, and the expert-parallel
shard_map (jspec.sharding) wraps exactly that function.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.models.layers import MLP, param


def route(router_logits_TE, top_k: int, norm_topk_prob: bool, dtype):
  probs_TE = jax.nn.softmax(router_logits_TE.astype(jnp.float32), axis=-1)
  weights_TK, ids_TK = jax.lax.top_k(probs_TE, top_k)
  if norm_topk_prob:
    weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
  return ids_TK.astype(jnp.int32), weights_TK.astype(dtype)


class MoE(nnx.Module):

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    self.router = param(rngs, (d, e), dtype, ("embed", "experts_router"))
    self.w_gate = param(rngs, (e, d, f), dtype, ("experts", "embed", "moe_mlp"), scale=d ** -0.5)
    self.w_up = param(rngs, (e, d, f), dtype, ("experts", "embed", "moe_mlp"), scale=d ** -0.5)
    self.w_down = param(rngs, (e, f, d), dtype, ("experts", "moe_mlp", "embed"), scale=f ** -0.5)
    self.top_k = cfg.num_experts_per_tok
    self.norm_topk_prob = cfg.norm_topk_prob
    self.has_shared_expert = cfg.shared_expert_intermediate_size > 0
    if self.has_shared_expert:
      # Every token also goes through one dense SwiGLU, scaled by sigmoid(x @ gate).
      self.shared_expert = MLP(d, cfg.shared_expert_intermediate_size, dtype, rngs)
      self.shared_expert_gate = param(rngs, (d, 1), dtype, ("embed", None))

  def __call__(self, x_BTD, experts_fn: Callable):
    b, t, d = x_BTD.shape
    x_TD = x_BTD.reshape(b * t, d)
    router_logits_TE = jnp.einsum("td,de->te", x_TD, self.router[...])
    ids_TK, weights_TK = route(router_logits_TE, self.top_k, self.norm_topk_prob, x_TD.dtype)
    y_TD = experts_fn(x_TD, ids_TK, weights_TK, self.w_gate[...], self.w_up[...],
                      self.w_down[...])
    y_BTD = y_TD.reshape(b, t, d)
    if self.has_shared_expert:
      gate_BT1 = jax.nn.sigmoid(jnp.einsum("btd,do->bto", x_BTD, self.shared_expert_gate[...]))
      y_BTD = y_BTD + gate_BT1 * self.shared_expert(x_BTD)
    return y_BTD
