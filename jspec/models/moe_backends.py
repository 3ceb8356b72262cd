"""Expert computation backends for the MoE layer.

Every backend has one signature, so the MoE layer (and the EP shard_map around it) never
knows which one runs:

    experts(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD) -> y_TD

    y[t] = sum_k topk_weights[t, k] * down_e( silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e]) ),
    e = topk_ids[t, k]

The weighted sum over the top-k runs in float32 and the result is cast to x's dtype. Ids
outside [0, E) contribute nothing: expert parallelism passes the ids of experts held by
another shard as -1 (or any out-of-range value) so that a shard computes its own experts only.

Shape letters: T tokens, K experts per token, E experts, D hidden size, F expert
intermediate size.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jspec.pallas_kernels.experts_ragged import experts_ragged_dot, swiglu as _swiglu
from jspec.pallas_kernels.experts import PALLAS_EXPERT_TILE, takes_x_e4m3

ExpertsFn = Callable[..., jax.Array]

MOE_BACKENDS = ("auto", "pallas", "ragged_dot", "dense", "reference")


def experts_reference(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD):
  """Gathers each token's K expert weight matrices: simple, exact, memory-hungry at large T."""
  num_experts = w_gate_EDF.shape[0]
  valid_TK = (topk_ids_TK >= 0) & (topk_ids_TK < num_experts)
  ids_TK = jnp.where(valid_TK, topk_ids_TK, 0)
  hp = jax.lax.Precision.HIGHEST
  gate_TKF = jnp.einsum("td,tkdf->tkf", x_TD, w_gate_EDF[ids_TK], precision=hp)
  up_TKF = jnp.einsum("td,tkdf->tkf", x_TD, w_up_EDF[ids_TK], precision=hp)
  act_TKF = _swiglu(gate_TKF.astype(jnp.float32), up_TKF.astype(jnp.float32)).astype(x_TD.dtype)
  out_TKD = jnp.einsum("tkf,tkfd->tkd", act_TKF, w_down_EFD[ids_TK], precision=hp)
  weights_TK = jnp.where(valid_TK, topk_weights_TK, 0.0).astype(jnp.float32)
  y_TD = jnp.einsum("tkd,tk->td", out_TKD.astype(jnp.float32), weights_TK)
  return y_TD.astype(x_TD.dtype)


def experts_dense(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD):
  """Runs every expert on every token and masks: reads each weight once, wasteful in FLOPs."""
  num_experts = w_gate_EDF.shape[0]
  gate_TEF = jnp.einsum("td,edf->tef", x_TD, w_gate_EDF)
  up_TEF = jnp.einsum("td,edf->tef", x_TD, w_up_EDF)
  act_TEF = _swiglu(gate_TEF.astype(jnp.float32), up_TEF.astype(jnp.float32)).astype(x_TD.dtype)
  out_TED = jnp.einsum("tef,efd->ted", act_TEF, w_down_EFD)
  # Combine weights as a dense [T, E] matrix; out-of-range ids match no column.
  onehot_TKE = topk_ids_TK[..., None] == jnp.arange(num_experts)
  weights_TE = jnp.einsum("tke,tk->te", onehot_TKE.astype(jnp.float32),
                          topk_weights_TK.astype(jnp.float32))
  y_TD = jnp.einsum("ted,te->td", out_TED.astype(jnp.float32), weights_TE)
  return y_TD.astype(x_TD.dtype)


def resolve_moe_backend(name: str) -> str:
  """Maps "auto" to a concrete backend for the current devices; validates the name."""
  if name not in MOE_BACKENDS:
    raise ValueError(f"moe_backend={name!r} is not supported; choose one of {MOE_BACKENDS}")
  if name == "auto":
    from jspec.pallas_kernels import platform
    return "pallas" if platform.on_hopper() else "reference"
  return name


def expert_tile(name: str) -> int:
  return PALLAS_EXPERT_TILE if resolve_moe_backend(name) == "pallas" else 1


def get_experts_fn(name: str) -> ExpertsFn:
  name = resolve_moe_backend(name)
  if name == "pallas":
    # Mosaic GPU; interpret mode off-GPU. It picks its path by the static size of each call:
    # the decode path (every selected expert streamed once over all T tokens) up to
    # DECODE_MAX_TOKENS tokens and DECODE_MAX_COPIES token copies, the grouped path above.
    from jspec.pallas_kernels import experts_pallas
    return experts_pallas
  return {"reference": experts_reference, "dense": experts_dense,
          "ragged_dot": experts_ragged_dot}[name]


def live_tokens_only(experts_fn: ExpertsFn, live_BT: jax.Array) -> ExpertsFn:
  """`experts_fn` that computes the tokens of live_BT [B, T] only (the MoE layer's T = B x T
  rows, row-major): a dead token's ids become -1, which every backend skips, so that its
  output is zeros and the experts only it picked are not read. Why: a step's padding rows (a
  batch bucket's spare rows, the free slots of the continuous scheduler, a prefill chunk's
  positions past its prompt) route like any token, and at expert parallelism one padding row
  can double the experts a shard reads (ep = 2 at batch 1: a bucket of 2 rows, one padding)."""
  def experts(x_TD, topk_ids_TK, topk_weights_TK, *weights, **rows):
    if x_TD.shape[0] != live_BT.size:
      raise ValueError(f"live_BT {live_BT.shape} does not cover the layer's {x_TD.shape[0]} "
                       "tokens")
    ids_TK = jnp.where(live_BT.reshape(-1, 1), topk_ids_TK, -1).astype(topk_ids_TK.dtype)
    return experts_fn(x_TD, ids_TK, topk_weights_TK, *weights, **rows)
  # x's e4m3 rows (x_e4m3) go through as they are: the wrapper changes the ids only.
  experts.takes_x_e4m3 = takes_x_e4m3(experts_fn)
  return experts
