"""Gated DeltaNet pieces against a NumPy reference of the published recurrence (float32):
the chunked form (prefill), the one-step form (decode/verify), the causal conv, the padding
mask, and both ways of committing a verify window."""

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.caches import RecurrentCache, RecurrentWindow, conv_window_after
from jspec.models.gated_deltanet import causal_conv, chunked_delta_rule, delta_rule_steps


def numpy_delta_rule(state, q, k, v, g, beta):
  """S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; out = S^T q, one position at a time
  (transformers' torch_recurrent_gated_delta_rule, heads grouped [G, R]). q is pre-scaled."""
  state = state.astype(np.float64).copy()
  outs = []
  for t in range(k.shape[1]):
    state *= np.exp(g[:, t])[..., None, None]
    memory = np.einsum("bgrkv,bgk->bgrv", state, k[:, t])
    delta = (v[:, t] - memory) * beta[:, t][..., None]
    state += np.einsum("bgk,bgrv->bgrkv", k[:, t], delta)
    outs.append(np.einsum("bgrkv,bgk->bgrv", state, q[:, t]))
  return state, (np.stack(outs, axis=1) if outs else None)


def random_inputs(rng, batch, length, heads, per_key, key_dim, value_dim):
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(rng.normal(size=(batch, length, heads, key_dim))).astype(np.float32)
  k = unit(rng.normal(size=(batch, length, heads, key_dim))).astype(np.float32)
  v = rng.normal(size=(batch, length, heads, per_key, value_dim)).astype(np.float32)
  # Mild and strong decays: the state must carry information across chunks.
  g = -rng.uniform(0.005, 1.0, size=(batch, length, heads, per_key)).astype(np.float32)
  beta = rng.uniform(0.05, 1.0, size=(batch, length, heads, per_key)).astype(np.float32)
  state = 0.3 * rng.normal(size=(batch, heads, per_key, key_dim, value_dim)).astype(np.float32)
  return state, q, k, v, g, beta


@pytest.mark.parametrize("seed", range(6))
def test_chunked_and_stepwise_forms_match_the_recurrence(seed):
  rng = np.random.default_rng(seed)
  batch, heads, per_key = rng.integers(1, 3), rng.integers(1, 3), rng.integers(1, 3)
  key_dim, value_dim = rng.choice([8, 16]), rng.choice([8, 24])
  length = int(rng.choice([1, 5, 63, 64, 65, 130]))
  state, q, k, v, g, beta = random_inputs(rng, batch, length, heads, per_key, key_dim, value_dim)
  want_state, want_out = numpy_delta_rule(state, q * key_dim ** -0.5, k, v, g, beta)

  got_state, got_out = chunked_delta_rule(*(jnp.asarray(a) for a in (state, q, k, v, g, beta)))
  np.testing.assert_allclose(got_out, want_out, atol=2e-4, rtol=1e-4)
  np.testing.assert_allclose(got_state, want_state, atol=2e-4, rtol=1e-4)

  steps = min(length, 9)  # the one-step form serves windows of a few tokens
  sl = lambda a: jnp.asarray(a[:, :steps])
  want_state, want_out = numpy_delta_rule(state, q[:, :steps] * key_dim ** -0.5, k[:, :steps],
                                          v[:, :steps], g[:, :steps], beta[:, :steps])
  got_state, got_out, per_step = delta_rule_steps(
      jnp.asarray(state), sl(q) * key_dim ** -0.5, sl(k), sl(v), sl(g), sl(beta),
      keep_states=True)
  np.testing.assert_allclose(got_out, want_out, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got_state, want_state, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(per_step[:, -1], got_state, atol=0, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_padding_positions_leave_the_state_untouched(seed):
  """Prefill masks padding with g = 0, beta = 0: the state after the bucket equals the state
  after each row's own prompt, and valid outputs are unchanged."""
  rng = np.random.default_rng(100 + seed)
  length = int(rng.choice([20, 70, 129]))
  state, q, k, v, g, beta = random_inputs(rng, 3, length, 2, 2, 8, 8)
  lens = rng.integers(1, length + 1, size=3)
  valid = np.arange(length)[None, :] < lens[:, None]
  masked = lambda a: np.where(valid[:, :, None, None], a, 0).astype(np.float32)
  got_state, got_out = chunked_delta_rule(*(jnp.asarray(a) for a in (
      state, q, k, v, masked(g), masked(beta))))
  for row, n in enumerate(lens):
    want_state, want_out = numpy_delta_rule(state[row:row + 1], q[row:row + 1, :n] * 8 ** -0.5,
                                            k[row:row + 1, :n], v[row:row + 1, :n],
                                            g[row:row + 1, :n], beta[row:row + 1, :n])
    np.testing.assert_allclose(got_state[row], want_state[0], atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(got_out[row, :n], want_out[0], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_causal_conv_matches_numpy_with_carried_window(seed):
  rng = np.random.default_rng(200 + seed)
  kernel, batch, heads, channels = int(rng.choice([2, 4])), 2, 3, 5
  history = rng.normal(size=(batch, 11, heads, channels)).astype(np.float32)
  weight = rng.normal(size=(kernel, heads, channels)).astype(np.float32)
  split = int(rng.integers(0, 11))
  # Reference: one pass over the whole history from zeros, transformers' causal_conv1d_fn.
  padded = np.concatenate([np.zeros((batch, kernel - 1, heads, channels)), history], axis=1)
  conv = sum(padded[:, j:j + 11] * weight[j] for j in range(kernel))
  want = conv / (1 + np.exp(-conv))
  window = np.zeros((batch, kernel - 1, heads, channels), np.float32)
  first = causal_conv(jnp.asarray(window), jnp.asarray(history[:, :split]), jnp.asarray(weight))
  window = conv_window_after(jnp.asarray(window), jnp.asarray(history[:, :split]),
                             jnp.full((batch,), split, jnp.int32))
  second = causal_conv(window, jnp.asarray(history[:, split:]), jnp.asarray(weight))
  np.testing.assert_allclose(np.concatenate([first, second], axis=1), want, atol=1e-5)


@pytest.mark.parametrize("mode", ["replay", "store"])
def test_commit_keeps_exactly_the_emitted_positions(mode):
  """A verify window of T positions committed at n (0..T per row) equals running only the
  first n positions: the state, and the conv window of the last pre-conv inputs."""
  rng = np.random.default_rng(7)
  batch, width = 5, 4
  state, q, k, v, g, beta = random_inputs(rng, batch, width, 2, 2, 8, 8)
  conv = rng.normal(size=(batch, 3, 2, 6)).astype(np.float32)
  inputs = rng.normal(size=(batch, width, 2, 6)).astype(np.float32)
  start = RecurrentCache(jnp.asarray(conv), jnp.asarray(state))
  if mode == "store":
    _, _, states = delta_rule_steps(jnp.asarray(state), None, jnp.asarray(k), jnp.asarray(v),
                                    jnp.asarray(g), jnp.asarray(beta), keep_states=True)
    window = RecurrentWindow(start, jnp.asarray(inputs), states_after=states)
  else:
    window = RecurrentWindow(start, jnp.asarray(inputs), keys=jnp.asarray(k),
                             values=jnp.asarray(v), log_decay=jnp.asarray(g),
                             beta=jnp.asarray(beta))
  num_emit = np.array([0, 1, 2, 3, 4])
  committed = window.commit(jnp.asarray(num_emit))
  for row, n in enumerate(num_emit):
    want_state, _ = numpy_delta_rule(state[row:row + 1], q[row:row + 1, :n], k[row:row + 1, :n],
                                     v[row:row + 1, :n], g[row:row + 1, :n],
                                     beta[row:row + 1, :n])
    np.testing.assert_allclose(committed.state[row], want_state[0], atol=1e-5, rtol=1e-5)
    want_conv = np.concatenate([conv[row], inputs[row, :n]], axis=0)[-3:]
    np.testing.assert_array_equal(committed.conv[row], want_conv)
