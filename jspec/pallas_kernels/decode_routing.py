"""Routing metadata for the decode-sized expert kernels, computed in XLA without a sort.

At decode and verify sizes (a few tokens, a few hundred token copies) every expert that any
token selected is a *slot*, and each slot multiplies all T tokens: the few tokens are wgmma's
N dimension, so a token that did not select the slot's expert costs arithmetic on data
already on chip and no bytes, and a per-slot routing weight of 0 keeps it out of the sum.
That trades a permute (a gather kernel and a padded layout) for nothing: each selected
expert's weights are read exactly once however many tokens chose it, and a slot needs no
row list.

Slots are the selected experts in increasing order, found by a compare-and-count over
[copies, E] and a prefix count over E. One token (batch-1 decode) needs neither: a router's
top-k picks K distinct experts, so each pick is its own slot (a repeated pick would only be
read twice, and still summed right), and an id outside [0, E) becomes expert E, which the
kernels' TMA reads as zeros without touching memory. The softmax router's top-k kernel writes
that plan itself at batch-1 decode (jspec.pallas_kernels.router_topk.route_softmax_plan): a
change to the one-token branch of plan_decode must be made there too (tests/test_router_plan.py
compares the two bit for bit).

Shape letters: T tokens, K experts per token, E experts, S slots (at most min(E, T*K)),
N padded tokens (wgmma's N: T rounded up to a power of two, at least 8), R = max(N, 32) (the
routing weights of one slot as one 128-byte TMA block).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The routing weights of a slot travel as one TMA block of at least 128 bytes (32 floats).
WEIGHT_BLOCK = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodePlan:
  """Which experts run, and where each token copy's result lives.

  Attributes:
    slot_expert_S: expert of each slot; past the last used slot (and for an invalid pick of
      a single token) E, an expert the kernels read as zeros.
    num_slots_1: number of slots to run, as a 1-element int32 array (the kernels' loop bound).
    weight_SR: float32 routing weight of token r for slot s's expert (repeated picks of one
      expert summed); 0 where the token did not pick it, on padded tokens and past T.
    slot_TK: slot of each (token, k) copy; -1 where the id is out of range or repeats an
      earlier pick of the same token (its weight is already in weight_SR).
  """

  slot_expert_S: jax.Array
  num_slots_1: jax.Array
  weight_SR: jax.Array
  slot_TK: jax.Array


def padded_tokens(num_tokens: int) -> int:
  """wgmma's N for T tokens: a power of two, at least 8 (the SMEM tile's row granule)."""
  return max(8, 1 << max(0, (num_tokens - 1).bit_length()))


def weight_columns(num_tokens: int) -> int:
  return max(padded_tokens(num_tokens), WEIGHT_BLOCK)


def max_slots(num_tokens: int, top_k: int, num_experts: int) -> int:
  return top_k if num_tokens == 1 else max(1, min(num_experts, num_tokens * top_k))


def plan_decode(topk_ids_TK: jax.Array, topk_weights_TK: jax.Array,
                num_experts: int) -> DecodePlan:
  num_tokens, top_k = topk_ids_TK.shape
  ids_TK = topk_ids_TK.astype(jnp.int32)
  valid_TK = (ids_TK >= 0) & (ids_TK < num_experts)
  weights_TK = jnp.where(valid_TK, topk_weights_TK.astype(jnp.float32), 0.0)
  columns = weight_columns(num_tokens)
  if num_tokens == 1:
    return DecodePlan(
        slot_expert_S=jnp.where(valid_TK[0], ids_TK[0], num_experts),
        num_slots_1=jnp.full((1,), top_k, jnp.int32),
        weight_SR=jnp.pad(weights_TK.reshape(top_k, 1), ((0, 0), (0, columns - 1))),
        slot_TK=jnp.where(valid_TK, jnp.arange(top_k, dtype=jnp.int32)[None], -1))

  num_slots_max = max_slots(num_tokens, top_k, num_experts)
  # A pick that repeats an earlier pick of the same token adds its weight to that slot and is
  # combined once (the reference sums both copies; the slot's weight already holds both).
  k_idx = jnp.arange(top_k)
  earlier_KK = k_idx[None, :] < k_idx[:, None]  # [k, k']: k' before k
  repeat_TK = jnp.any((ids_TK[:, :, None] == ids_TK[:, None, :]) & earlier_KK[None], axis=2)

  experts_E = jnp.arange(num_experts, dtype=jnp.int32)
  picked_E = jnp.any((ids_TK.reshape(-1)[:, None] == experts_E[None, :])
                     & valid_TK.reshape(-1)[:, None], axis=0)
  # Inclusive count of picked experts up to e: expert e (if picked) has slot count_E[e] - 1.
  count_E = jnp.cumsum(picked_E.astype(jnp.int32))
  num_slots = count_E[-1]
  slot_S = jnp.arange(num_slots_max, dtype=jnp.int32)
  slot_expert_S = jnp.sum(count_E[None, :] <= slot_S[:, None], axis=1, dtype=jnp.int32)
  slot_of_TK = jnp.where(valid_TK, count_E[jnp.clip(ids_TK, 0, num_experts - 1)] - 1, -1)
  # Every output below reads count_E only, so XLA can compute them side by side.
  rows_RK = jnp.pad(slot_of_TK, ((0, columns - num_tokens), (0, 0)), constant_values=-1)
  weights_RK = jnp.pad(weights_TK, ((0, columns - num_tokens), (0, 0)))
  weight_SR = jnp.sum(jnp.where(rows_RK[None] == slot_S[:, None, None], weights_RK[None], 0.0),
                      axis=2)
  return DecodePlan(slot_expert_S=slot_expert_S, num_slots_1=num_slots.reshape(1),
                    weight_SR=weight_SR, slot_TK=jnp.where(repeat_TK, -1, slot_of_TK))


def plan_unless_given(plan: DecodePlan | None, topk_ids_TK: jax.Array,
                      topk_weights_TK: jax.Array, num_experts: int) -> DecodePlan:
  """`plan`, made beforehand from these ids and weights (by the router's top-k kernel at
  batch-1 decode), or plan_decode's of them where None."""
  if plan is None:
    return plan_decode(topk_ids_TK, topk_weights_TK, num_experts)
  num_tokens, top_k = topk_ids_TK.shape
  slots = max_slots(num_tokens, top_k, num_experts)
  if plan.slot_TK.shape != (num_tokens, top_k) or plan.slot_expert_S.shape != (slots,):
    raise ValueError(f"a decode plan of slot_TK {plan.slot_TK.shape} and slot_expert_S "
                     f"{plan.slot_expert_S.shape} does not plan ids {topk_ids_TK.shape} over "
                     f"{num_experts} experts (slot_TK {(num_tokens, top_k)}, {slots} slots)")
  return plan


def combine_slots(out_SND: jax.Array, plan: DecodePlan, dtype) -> jax.Array:
  """y_TD[t] = sum_k out_SND[slot_TK[t, k], t] in float32, in k order (deterministic).

  The routing weight was applied in the down kernel's epilogue; a slot of -1 adds nothing.
  """
  num_tokens, top_k = plan.slot_TK.shape
  valid_TK = plan.slot_TK >= 0
  token_T = jnp.arange(num_tokens)
  y_TD = None
  for k in range(top_k):  # Fixed summation order.
    rows_TD = out_SND[jnp.maximum(plan.slot_TK[:, k], 0), token_T].astype(jnp.float32)
    rows_TD = jnp.where(valid_TK[:, k, None], rows_TD, 0.0)
    y_TD = rows_TD if y_TD is None else y_TD + rows_TD
  return y_TD.astype(dtype)
