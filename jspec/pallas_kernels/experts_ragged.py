"""The experts of a MoE layer through one grouped GEMM with `jax.lax.ragged_dot`'s signature:
the "ragged_dot" backend of jspec.models.moe_backends, and the Pallas expert kernels' fallback
where Hopper cannot take their operands (jspec.pallas_kernels.experts). It lives below both so
that the kernels need not import the backend table that lists them.

Shape letters: T tokens, K experts per token, E experts, D hidden size, F expert intermediate
size, M token copies (T * K).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu(gate, up):
  return jax.nn.silu(gate) * up


def experts_ragged_dot(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
                       ragged_dot=jax.lax.ragged_dot):
  """Sorts token copies by expert and calls a grouped GEMM with `jax.lax.ragged_dot`'s
  signature: XLA's by default; benchmarks pass others (tokamax) through `ragged_dot`."""
  num_tokens, top_k = topk_ids_TK.shape
  num_experts = w_gate_EDF.shape[0]
  flat_ids_M = topk_ids_TK.reshape(-1)
  valid_M = (flat_ids_M >= 0) & (flat_ids_M < num_experts)
  # Invalid copies sort last, into a group of their own that no expert owns.
  sort_key_M = jnp.where(valid_M, flat_ids_M, num_experts)
  order_M = jnp.argsort(sort_key_M, stable=True)
  group_sizes_E = jnp.bincount(sort_key_M, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  x_MD = x_TD[order_M // top_k]
  gate_MF = ragged_dot(x_MD, w_gate_EDF, group_sizes_E)
  up_MF = ragged_dot(x_MD, w_up_EDF, group_sizes_E)
  act_MF = swiglu(gate_MF.astype(jnp.float32), up_MF.astype(jnp.float32)).astype(x_TD.dtype)
  out_MD = ragged_dot(act_MF, w_down_EFD, group_sizes_E)
  weights_M = jnp.where(valid_M, topk_weights_TK.reshape(-1), 0.0)[order_M].astype(jnp.float32)
  # Rows past the last group are left unwritten by ragged_dot: zero them explicitly.
  out_MD = jnp.where(valid_M[order_M][:, None], out_MD.astype(jnp.float32), 0.0)
  y_TD = jnp.zeros((num_tokens, x_TD.shape[1]), jnp.float32)
  y_TD = y_TD.at[order_M // top_k].add(out_MD * weights_M[:, None])
  return y_TD.astype(x_TD.dtype)
