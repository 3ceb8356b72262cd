"""The gated delta rule over a short window (decode, verify, commit) as one Pallas kernel.

Per value head the recurrence keeps a [Dk, Dv] float32 state S and, for each position t,

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   out_t = S^T q_t

Written with jnp ops one position at a time, XLA runs each of these as its own fusion and
the state goes through HBM several times per position (read for the decay, the memory read
S^T k, the update and the output S^T q). At batch 8 on Qwen3.5-9B shapes that traffic, not
the weights, is what made a 4-token verify cost 1.28x a decode step. Here a program holds a
[Dk, block_v] slice of one head's state in registers for the whole window: the state is read
once, and written once or not at all.

Columns of S are independent (column j only ever meets v[j], out[j]), so a head's state is
split over Dv into programs with no communication. The window length is padded to a power
of two with g = 0 and beta = 0, which leave S exactly unchanged; the caller uses the same
fact to mask the rejected tail of a verify window when it commits.

Triton lowering on a GPU; the Pallas interpreter elsewhere (tests).

Shape letters: B batch, T window positions, H value heads (G key heads x R per key head),
Dk key dim, Dv value dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform

BLOCK_V = 32


def _pick(vector_T, t: int):
  """Element t of a loaded [T] vector as a scalar (a masked sum: no dynamic slicing)."""
  return jnp.sum(jnp.where(jnp.arange(vector_T.shape[0]) == t, vector_T, 0.0))


def _kernel(*refs, length: int, has_query: bool, write_state: bool):
  refs = list(refs)
  state_ref, key_ref, value_ref, decay_ref, beta_ref = refs[:5]
  query_ref = refs[5] if has_query else None
  outs = refs[5 + has_query:]
  out_ref = outs.pop(0) if has_query else None
  state_out_ref = outs.pop(0) if write_state else None

  state_KV = state_ref[...].astype(jnp.float32)   # [Dk, block_v]
  decay_T = decay_ref[...].astype(jnp.float32)
  beta_T = beta_ref[...].astype(jnp.float32)
  for t in range(length):
    key_K1 = jnp.transpose(key_ref[pl.ds(t, 1), :].astype(jnp.float32))     # [Dk, 1]
    value_1V = value_ref[pl.ds(t, 1), :].astype(jnp.float32)                 # [1, block_v]
    state_KV = state_KV * jnp.exp(_pick(decay_T, t))
    memory_1V = jnp.sum(state_KV * key_K1, axis=0, keepdims=True)
    state_KV = state_KV + key_K1 * ((value_1V - memory_1V) * _pick(beta_T, t))
    if has_query:
      query_K1 = jnp.transpose(query_ref[pl.ds(t, 1), :].astype(jnp.float32))
      out_ref[pl.ds(t, 1), :] = jnp.sum(state_KV * query_K1, axis=0, keepdims=True)
  if write_state:
    state_out_ref[...] = state_KV


@functools.partial(jax.jit, static_argnames=("write_state", "block_v", "num_warps"))
def delta_rule_window(state_BGRKV, query_BTGK, key_BTGK, value_BTGRV, decay_BTGR, beta_BTGR, *,
                      write_state: bool = True, block_v: int = BLOCK_V, num_warps: int = 4):
  """The recurrence over a window of T positions, in float32.

  query_BTGK may be None (a commit: no outputs). Returns (outputs [B, T, G, R, Dv] or None,
  final state [B, G, R, Dk, Dv] or None when not write_state). Positions with decay 0 and
  beta 0 leave the state as it was. Operands keep their layouts (no transposes around the
  call); a window whose length is not a power of two is zero-padded to one.
  """
  batch, length, groups, key_dim = key_BTGK.shape
  per_key, value_dim = value_BTGRV.shape[3:]
  block_v = min(block_v, value_dim)
  if value_dim % block_v:
    raise ValueError(f"value head dim {value_dim} must be a multiple of block_v={block_v}")
  padded = pl.next_power_of_2(length)
  pad_time = lambda x: (x if padded == length else
                        jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2)))
  has_query = query_BTGK is not None

  # Grid: (batch, value head, column block); value head h belongs to key head h // R.
  grid = (batch, groups * per_key, value_dim // block_v)
  state_spec = pl.BlockSpec((None, None, None, key_dim, block_v),
                            lambda b, h, j: (b, h // per_key, h % per_key, 0, j))
  key_spec = pl.BlockSpec((None, padded, None, key_dim), lambda b, h, j: (b, 0, h // per_key, 0))
  value_spec = pl.BlockSpec((None, padded, None, None, block_v),
                            lambda b, h, j: (b, 0, h // per_key, h % per_key, j))
  scalar_spec = pl.BlockSpec((None, padded, None, None),
                             lambda b, h, j: (b, 0, h // per_key, h % per_key))
  in_specs = [state_spec, key_spec, value_spec, scalar_spec, scalar_spec]
  operands = [state_BGRKV, pad_time(key_BTGK), pad_time(value_BTGRV), pad_time(decay_BTGR),
              pad_time(beta_BTGR)]
  out_specs, out_shape = [], []
  if has_query:
    in_specs.append(key_spec)
    operands.append(pad_time(query_BTGK))
    out_specs.append(value_spec)
    out_shape.append(jax.ShapeDtypeStruct((batch, padded, groups, per_key, value_dim),
                                          jnp.float32))
  if write_state:
    out_specs.append(state_spec)
    out_shape.append(jax.ShapeDtypeStruct(state_BGRKV.shape, jnp.float32))

  on_gpu = platform.on_gpu()
  results = list(pl.pallas_call(
      functools.partial(_kernel, length=length, has_query=has_query, write_state=write_state),
      grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=(pltriton.CompilerParams(num_warps=num_warps, num_stages=1) if on_gpu
                       else None),
      interpret=not on_gpu,
  )(*operands))
  out = results.pop(0)[:, :length] if has_query else None
  state = results.pop(0) if write_state else None
  return out, state
