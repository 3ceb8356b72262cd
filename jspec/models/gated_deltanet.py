"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5
(transformers `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet`; Yang et al. 2024).

Per token: project to q, k (G key heads of Dk), v, z (G*R value heads of Dv) and b, a (one per
value head); run q, k, v through a causal depthwise conv1d (kernel X) and SiLU; L2-normalise
q and k, scale q by Dk^-1/2; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias). Each
value head keeps a [Dk, Dv] state S, updated by the gated delta rule with its key head's k:

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   out = S^T q

then out is normalised per head with a plain-w RMSNorm gated by silu(z), and projected back.

Layout: value heads are grouped under their key head (value head j reads key head j // R,
transformers' repeat_interleave), so every parameter, the conv window and the state have the
key-head axis G first, and splitting G over tp keeps each group's q, k, v, z and state on one
shard with no communication inside the layer. The projections of q, k, v, z, b, a are one
[D, G, P] matrix (a single read of the weights at decode) with per-head columns
[q (Dk) | k (Dk) | v (R*Dv) | z (R*Dv) | b (R) | a (R)], the conv channels are [q | k | v].
In an FP8 checkpoint (jspec.models.quantization) the q, k, v, z and output projections are
e4m3 with block scales, and b, a stay unquantized (the Qwen FP8 releases list `in_proj_ba` /
`in_proj_a` / `in_proj_b` in modules_to_not_convert): the in-projection is then two, `in_proj`
[G, q | k | v | z, D] in FP8 and `in_proj_ba` [D, G, b | a].

Two forms of the same recurrence (jspec.models.delta_rule): `chunked_delta_rule` for prefill
(the UT transform over chunks of 64 positions, as transformers' `torch_chunk_gated_delta_rule`),
and `delta_rule_steps` one position at a time for decode and verify windows. XLA fuses each
position's update into one or two kernels; a hand-written Triton kernel holding the state on
chip across the window measured slower at decode and at most 20% faster on 4-token windows
(BENCHMARKS.md "Qwen3.5"), so the XLA form is what runs.

Shape letters: B batch, T positions, D hidden, G key heads, R value heads per key head,
Dk/Dv key/value dims (K, V in einsums), C conv channels per key head, X conv kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.models.caches import RecurrentCache, RecurrentWindow, conv_window_after
from jspec.models import quantization
from jspec.models.delta_rule import chunked_delta_rule, delta_rule_steps
from jspec.models.linear import linear, project_named
from jspec.models.norms import GatedRMSNorm
from jspec.models.params import param

def l2_normalize(x, eps: float = 1e-6):
  """x / sqrt(sum(x^2) + eps), in float32 (transformers' `l2norm`, as the FLA kernels)."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def causal_conv(window_BWGC, inputs_BTGC, weight_XGC):
  """Depthwise causal conv1d + SiLU: output t sums weight[j] * input[t - (X-1) + j], the
  inputs before this call coming from the window of the last X-1 (zeros at the start)."""
  kernel = weight_XGC.shape[0]
  length = inputs_BTGC.shape[1]
  full_BYGC = jnp.concatenate([window_BWGC, inputs_BTGC], axis=1).astype(jnp.float32)
  weight32 = weight_XGC.astype(jnp.float32)
  out_BTGC = sum(full_BYGC[:, j:j + length] * weight32[j] for j in range(kernel))
  return jax.nn.silu(out_BTGC).astype(inputs_BTGC.dtype)


class GatedDeltaNet(nnx.Module):

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    d = cfg.hidden_size
    self.heads = cfg.linear.num_key_heads
    self.per_key = cfg.linear.num_value_heads // cfg.linear.num_key_heads
    self.key_dim, self.value_dim = cfg.linear.key_head_dim, cfg.linear.value_head_dim
    self.kernel = cfg.linear.conv_kernel
    g, r, dk, dv = self.heads, self.per_key, self.key_dim, self.value_dim
    self.channels = 2 * dk + r * dv
    self.fp8_block = block = cfg.fp8_block
    heads_axes = ("embed", "linear_heads", None)
    if block is None:  # one matrix: a single read of the weights at decode
      self.in_proj = param(rngs, (d, g, self.channels + r * dv + 2 * r), dtype, heads_axes)
      self.in_proj_scale = self.in_proj_ba = None
    else:
      self.in_proj, self.in_proj_scale = linear(
          rngs, (d, g, self.channels + r * dv), dtype, heads_axes, 1,
          quantization.block_for(cfg, "linear_attn.in_proj_qkvz"))
      self.in_proj_ba = param(rngs, (d, g, 2 * r), dtype, heads_axes)
    self.conv = param(rngs, (self.kernel, g, self.channels), dtype,
                      (None, "linear_heads", None), scale=self.kernel ** -0.5)
    self.a_log = param(rngs, (g, r), dtype, ("linear_heads", None), scale=0.5)
    self.dt_bias = param(rngs, (g, r), dtype, ("linear_heads", None), scale=0.5)
    self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps, dtype)
    self.out_proj, self.out_proj_scale = linear(
        rngs, (g, r, dv, d), dtype, ("linear_heads", None, None, "embed"), 3,
        quantization.block_for(cfg, "linear_attn.out_proj"), scale=(g * r * dv) ** -0.5)
    # FP8 weights only: the product of steps with few rows, set by the LLM as
    # Attention.fp8_projection is (None: scaled, then XLA's dot).
    self.fp8_projection = None
    self.fp8_lanes = None  # as Attention.fp8_lanes
    # How a verify window is kept until commit (jspec.models.caches): "replay" or "store".
    # Set by the LLM (`recurrent_commit`); static, so it is part of the compiled program.
    self.commit_mode = "store"

  def empty_cache(self, batch: int, dtype) -> RecurrentCache:
    return RecurrentCache.zeros(batch, self.kernel - 1, self.heads, self.channels, self.per_key,
                                self.key_dim, self.value_dim, dtype)

  def __call__(self, x_BTD, cache: RecurrentCache, valid_BT=None):
    """(output [B,T,D], cache). valid_BT given (prefill): the chunked form, padding masked,
    the cache committed at each row's last valid position. None: the recurrent form over a
    decode/verify window, returned as a RecurrentWindow for the loop to commit."""
    b, t, _ = x_BTD.shape
    g, r, dk, dv, c = self.heads, self.per_key, self.key_dim, self.value_dim, self.channels
    proj_BTGP = project_named(self, x_BTD, "in_proj", "btd,dgp->btgp")
    ba_BTGP = proj_BTGP[..., c + r * dv:] if self.in_proj_ba is None else jnp.einsum(
        "btd,dgp->btgp", x_BTD, self.in_proj_ba[...])
    conv_in_BTGC = proj_BTGP[..., :c]
    z_BTGRV = proj_BTGP[..., c:c + r * dv].reshape(b, t, g, r, dv)
    b_BTGR, a_BTGR = ba_BTGP[..., :r], ba_BTGP[..., r:]
    mixed_BTGC = causal_conv(cache.conv, conv_in_BTGC, self.conv[...])
    q_BTGK = l2_normalize(mixed_BTGC[..., :dk])
    k_BTGK = l2_normalize(mixed_BTGC[..., dk:2 * dk])
    v_BTGRV = mixed_BTGC[..., 2 * dk:].reshape(b, t, g, r, dv).astype(jnp.float32)
    beta_BTGR = jax.nn.sigmoid(b_BTGR).astype(jnp.float32)
    g_BTGR = -jnp.exp(self.a_log[...].astype(jnp.float32)) * jax.nn.softplus(
        a_BTGR.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))

    if valid_BT is not None:
      live = valid_BT[:, :, None, None]
      g_BTGR, beta_BTGR = jnp.where(live, g_BTGR, 0.0), jnp.where(live, beta_BTGR, 0.0)
      state, out_BTGRV = chunked_delta_rule(cache.state, q_BTGK, k_BTGK, v_BTGRV, g_BTGR,
                                            beta_BTGR)
      num_valid_B = jnp.sum(valid_BT, axis=1).astype(jnp.int32)
      new_cache = RecurrentCache(conv_window_after(cache.conv, conv_in_BTGC, num_valid_B), state)
    else:
      q_BTGK = q_BTGK * dk ** -0.5
      if self.commit_mode == "store":
        _, out_BTGRV, states = delta_rule_steps(cache.state, q_BTGK, k_BTGK, v_BTGRV, g_BTGR,
                                                beta_BTGR, keep_states=True)
        new_cache = RecurrentWindow(cache, conv_in_BTGC, states_after=states)
      else:
        _, out_BTGRV, _ = delta_rule_steps(cache.state, q_BTGK, k_BTGK, v_BTGRV, g_BTGR,
                                           beta_BTGR)
        new_cache = RecurrentWindow(cache, conv_in_BTGC, keys=k_BTGK, values=v_BTGRV,
                                    log_decay=g_BTGR, beta=beta_BTGR)
    normed_BTGRV = self.norm(out_BTGRV.astype(x_BTD.dtype), z_BTGRV)
    return project_named(self, normed_BTGRV, "out_proj", "btgrv,grvd->btd", 3), new_cache
