"""Permute token rows into the padded expert order, and unpermute + combine back.

Both are row gathers, written in XLA: a gather of T*K rows of D elements is a small share of
the layer's bytes at every size (the weights dominate at decode sizes, the GEMMs' arithmetic
at prefill sizes), and XLA's gather already runs at copy speed on contiguous rows.

The combine is a gather, not a scatter-add: y[t] = sum_k out[pos[t, k]] in float32, summed
in k order, so the result is bitwise deterministic. The routing weight was already applied
in the down GEMM's epilogue.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.pallas_kernels.routing import RoutingPlan


def permute_rows(x_TD: jax.Array, plan: RoutingPlan) -> jax.Array:
  """x_PD: token rows in padded expert order (pad rows repeat token 0)."""
  return jnp.take(x_TD, plan.row_token_P, axis=0, mode="clip")


def unpermute_combine(out_PD: jax.Array, plan: RoutingPlan, dtype) -> jax.Array:
  """y_TD[t] = sum_k out_PD[pos_TK[t, k]] in float32; pos -1 contributes nothing."""
  valid_TK = plan.pos_TK >= 0
  rows_TKD = jnp.take(out_PD, jnp.maximum(plan.pos_TK, 0), axis=0, mode="clip")
  rows_TKD = jnp.where(valid_TK[..., None], rows_TKD.astype(jnp.float32), 0.0)
  y_TD = rows_TKD[:, 0]
  for k in range(1, rows_TKD.shape[1]):  # Fixed summation order: deterministic.
    y_TD = y_TD + rows_TKD[:, k]
  return y_TD.astype(dtype)
