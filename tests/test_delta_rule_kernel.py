"""The fused delta-rule window kernel (jspec.pallas_kernels.delta_rule) against the NumPy
recurrence, in the Pallas interpreter here and compiled on a GPU (`-m gpu`): outputs, the
final state, a commit that keeps only each row's first n positions, and a Gated DeltaNet
layer whose replayed verify windows run through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.models import caches as cache_lib
from jspec.models import gated_deltanet
from jspec.pallas_kernels.delta_rule import delta_rule_window
from test_gated_deltanet import numpy_delta_rule, random_inputs

CASES = [  # batch, T, key heads, value heads per key head, Dk, Dv
    (1, 1, 1, 1, 16, 32), (2, 3, 2, 2, 16, 64), (3, 4, 1, 3, 32, 32), (2, 6, 2, 1, 16, 96),
    (1, 2, 3, 2, 64, 128),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("seed", range(2))
def test_window_matches_the_recurrence(case, seed):
  rng = np.random.default_rng(seed * 31 + sum(case))
  batch, length, heads, per_key, key_dim, value_dim = case
  state, q, k, v, g, beta = random_inputs(rng, batch, length, heads, per_key, key_dim, value_dim)
  q = q * key_dim ** -0.5
  want_state, want_out = numpy_delta_rule(state, q, k, v, g, beta)
  out, final = delta_rule_window(*(jnp.asarray(a) for a in (state, q, k, v, g, beta)))
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(final, want_state, atol=2e-5, rtol=1e-5)
  only_out, no_state = delta_rule_window(*(jnp.asarray(a) for a in (state, q, k, v, g, beta)),
                                         write_state=False)
  assert no_state is None
  np.testing.assert_array_equal(only_out, out)


@pytest.mark.parametrize("seed", range(3))
def test_commit_through_the_kernel_keeps_the_first_n_positions(seed, monkeypatch):
  """advance_state (a replayed commit) on the kernel path: rows keep 0..T positions."""
  monkeypatch.setattr(gated_deltanet, "window_kernel_enabled", lambda: True)
  rng = np.random.default_rng(50 + seed)
  batch, length = 6, 5
  state, _, k, v, g, beta = random_inputs(rng, batch, length, 2, 2, 16, 32)
  num = rng.integers(0, length + 1, size=batch)
  num[:2] = (0, length)
  got = gated_deltanet.advance_state(*(jnp.asarray(a) for a in (state, k, v, g, beta, num)))
  for row, n in enumerate(num):
    want, _ = numpy_delta_rule(state[row:row + 1], k[row:row + 1, :n], k[row:row + 1, :n],
                               v[row:row + 1, :n], g[row:row + 1, :n], beta[row:row + 1, :n])
    np.testing.assert_allclose(got[row], want[0], atol=2e-5, rtol=1e-5)


def test_layer_windows_on_the_kernel_equal_the_xla_steps(monkeypatch):
  """A Gated DeltaNet layer in replay mode: three verify windows committed at 1, 4 and 2 give
  the same outputs and state with the kernel as with the XLA one-step form."""
  from jspec.bench.presets import PRESETS
  import dataclasses
  cfg = dataclasses.replace(PRESETS["qwen3.5-9b"], hidden_size=64, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=32)
  layer = gated_deltanet.GatedDeltaNet(cfg, jnp.float32, nnx.Rngs(3))
  layer.commit_mode = "replay"
  x = jax.random.normal(jax.random.key(4), (2, 16, cfg.hidden_size))

  def run():
    cache, outs, start = layer.empty_cache(2, jnp.float32), [], 0
    for keep in (1, 4, 2):
      out, window = layer(x[:, start:start + 4], cache)
      outs.append(out[:, :keep])
      cache = cache_lib.commit((window,), jnp.full((2,), keep, jnp.int32))[0]
      start += keep
    return np.concatenate(outs, axis=1), np.asarray(cache.state)

  want_out, want_state = run()
  monkeypatch.setattr(gated_deltanet, "window_kernel_enabled", lambda: True)
  got_out, got_state = run()
  np.testing.assert_allclose(got_out, want_out, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got_state, want_state, atol=1e-5, rtol=1e-5)
