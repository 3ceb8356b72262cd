"""The gated delta rule, the recurrence inside Gated DeltaNet (jspec.models.gated_deltanet),
in its two forms: `delta_rule_steps` one position at a time (decode and verify windows, and
`advance_state`, which a replayed verify window's commit runs in jspec.models.caches), and
`chunked_delta_rule` over chunks of CHUNK positions (prefill).

It lives apart from the layer so that the cache kinds, which replay it at commit, and the
layer, which builds those caches, both import it from below.

Shape letters: B batch, T positions, G key heads, R value heads per key head, Dk/Dv key/value
dims (K, V in einsums).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64


def delta_rule_steps(state_BGRKV, q_BTGK, k_BTGK, v_BTGRV, g_BTGR, beta_BTGR, *, live_BT=None,
                     keep_states: bool = False):
  """The recurrence one position at a time (float32). Returns (final state, outputs
  [B,T,G,R,Dv] or None when q is None, states after each position [B,T,G,R,Dk,Dv] or None).
  Positions where `live_BT` is False leave the state as it was (a commit's rejected tail)."""
  outs, states = [], []
  state = state_BGRKV
  for t in range(k_BTGK.shape[1]):
    decayed = state * jnp.exp(g_BTGR[:, t])[..., None, None]
    k_BGK = k_BTGK[:, t]
    memory_BGRV = jnp.einsum("bgrkv,bgk->bgrv", decayed, k_BGK)
    delta_BGRV = (v_BTGRV[:, t] - memory_BGRV) * beta_BTGR[:, t][..., None]
    updated = decayed + jnp.einsum("bgk,bgrv->bgrkv", k_BGK, delta_BGRV)
    if live_BT is not None:
      updated = jnp.where(live_BT[:, t][:, None, None, None, None], updated, state)
    state = updated
    if q_BTGK is not None:
      outs.append(jnp.einsum("bgrkv,bgk->bgrv", state, q_BTGK[:, t]))
    if keep_states:
      states.append(state)
  out = jnp.stack(outs, axis=1) if outs else None
  return state, out, (jnp.stack(states, axis=1) if keep_states else None)


def advance_state(state_BGRKV, k_BTGK, v_BTGRV, g_BTGR, beta_BTGR, num_B):
  """The state after the first num_B positions of a window (a replayed commit)."""
  live_BT = jnp.arange(k_BTGK.shape[1])[None, :] < num_B[:, None]
  return delta_rule_steps(state_BGRKV, None, k_BTGK, v_BTGRV, g_BTGR, beta_BTGR,
                          live_BT=live_BT)[0]


def chunked_delta_rule(state_BGRKV, q_BTGK, k_BTGK, v_BTGRV, g_BTGR, beta_BTGR,
                       chunk: int = CHUNK):
  """The same recurrence over chunks: within a chunk the delta-rule updates are condensed by
  the UT transform (a unit lower-triangular solve) into matrix products, and the state is
  carried from chunk to chunk. Positions padded to a multiple of `chunk` get g = 0 and
  beta = 0, which leave the state untouched (so do a prompt's padding positions, which the
  caller masks the same way). Returns (final state, outputs [B,T,G,R,Dv]), float32."""
  batch, length, heads, key_dim = k_BTGK.shape
  per_key, value_dim = v_BTGRV.shape[3:]
  pad = (-length) % chunk
  num_chunks = (length + pad) // chunk

  def chunks(x, fill=0.0):  # [B,T,G,R,...] -> [N, B, G, R, chunk, ...], padded
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    x = x.reshape(batch, num_chunks, chunk, *x.shape[2:])
    return jnp.moveaxis(x, (1, 2), (0, 4))

  expand = lambda x: jnp.broadcast_to(x[:, :, :, None], (batch, length, heads, per_key, key_dim))
  q = chunks(expand(q_BTGK) * key_dim ** -0.5)   # [N, B, G, R, c, Dk]
  k = chunks(expand(k_BTGK))
  v = chunks(v_BTGRV)                             # [N, B, G, R, c, Dv]
  g = chunks(g_BTGR)                              # [N, B, G, R, c]
  beta = chunks(beta_BTGR)
  k_beta, v_beta = k * beta[..., None], v * beta[..., None]
  cum = jnp.cumsum(g, axis=-1)
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))
  # exp(cum_i - cum_j) for j <= i: the decay between positions j and i; 0 above the diagonal.
  pairwise = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.)),
                       0.)
  ut_system = jnp.einsum("...ik,...jk->...ij", k_beta, k) * pairwise
  intra = jnp.einsum("...ik,...jk->...ij", q, k) * pairwise
  solve = lambda rhs: jax.scipy.linalg.solve_triangular(ut_system, rhs, lower=True,
                                                        unit_diagonal=True)
  new_values = solve(v_beta)
  k_cumdecay = solve(k_beta * jnp.exp(cum)[..., None])
  q_decayed = q * jnp.exp(cum)[..., None]
  k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
  chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

  def body(state, xs):
    new_v, k_cd, q_d, k_d, intra_c, decay = xs
    v_new = new_v - jnp.einsum("bgrck,bgrkv->bgrcv", k_cd, state)
    out = (jnp.einsum("bgrck,bgrkv->bgrcv", q_d, state)
           + jnp.einsum("bgrij,bgrjv->bgriv", intra_c, v_new))
    state = state * decay + jnp.einsum("bgrck,bgrcv->bgrkv", k_d, v_new)
    return state, out

  state, out = jax.lax.scan(body, state_BGRKV.astype(jnp.float32),
                            (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay))
  # [N, B, G, R, c, Dv] -> [B, T, G, R, Dv]
  out = jnp.moveaxis(out, (0, 4), (1, 2)).reshape(batch, num_chunks * chunk, heads, per_key,
                                                  value_dim)
  return state, out[:, :length]
