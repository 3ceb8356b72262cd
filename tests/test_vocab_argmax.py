"""Specification of `vocab_argmax`, the argmax every greedy and sampled token goes through:
NumPy's argmax (lowest index among ties, the first NaN where a row holds one), and, with the
vocabulary split over devices, reduced by all-reduces only (no all-gather)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.speculative.sampling import sample, vocab_argmax


def random_logits(rng, shape):
  """Continuous values, small integers (ties), and entries -inf, +inf, NaN or -0.0 (which ties
  with the integers' +0.0)."""
  kind = rng.integers(0, 5)
  if kind == 0:
    x = rng.normal(0, 3, shape)
  else:
    x = rng.integers(-2, 3, shape).astype(np.float64)
  specials = rng.random(shape) < rng.choice([0.0, 0.01, 0.2])
  x = np.where(specials, rng.choice([-np.inf, np.inf, np.nan, -0.0], shape, p=[0.5, 0.2, 0.15, 0.15]), x)
  if rng.random() < 0.1:
    x[..., :] = -np.inf  # every row fully masked
  return x


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vocab_argmax_equals_numpy_argmax_on_ties_infinities_and_nans(dtype):
  rng = np.random.default_rng(0)
  fn = jax.jit(vocab_argmax, static_argnames="axis")
  for case in range(60):
    ndim = rng.integers(1, 4)
    shape = tuple(int(s) for s in rng.integers(1, 40, ndim))
    axis = int(rng.integers(-ndim, ndim))
    x = np.asarray(jnp.asarray(random_logits(rng, shape), dtype).astype(jnp.float32))
    got = np.asarray(fn(jnp.asarray(x, dtype), axis=axis))
    np.testing.assert_array_equal(got, np.argmax(x, axis=axis),
                                  err_msg=f"case {case}: shape {shape}, axis {axis}")


def test_sample_draws_what_jax_random_categorical_draws():
  rng = np.random.default_rng(1)
  ours = jax.jit(sample)
  theirs = jax.jit(jax.vmap(jax.random.categorical))
  for v in (1, 7, 300):
    for case in range(4):
      n = 64
      probs = rng.dirichlet(np.full(v, 0.3), n) * (rng.random((n, v)) < 0.7)
      probs[np.arange(n), rng.integers(0, v, n)] += 0.1  # no row all zeros
      probs = jnp.asarray(probs / probs.sum(-1, keepdims=True), jnp.float32)
      keys = jax.random.split(jax.random.key(100 * v + case), n)
      np.testing.assert_array_equal(np.asarray(ours(probs, keys)),
                                    np.asarray(theirs(keys, jnp.log(probs))),
                                    err_msg=f"V={v}, case {case}")


def test_a_vocabulary_split_over_devices_is_reduced_without_an_all_gather():
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",))  # the CPU suite makes 8 devices
  split = NamedSharding(mesh, P(None, "tp"))
  rng = np.random.default_rng(2)
  x = random_logits(rng, (3, 512)).astype(np.float32)
  fn = jax.jit(vocab_argmax, in_shardings=split)
  hlo = fn.lower(jax.device_put(x, split)).compile().as_text()
  assert "all-reduce" in hlo
  assert "all-gather" not in hlo
  np.testing.assert_array_equal(np.asarray(fn(jax.device_put(x, split))), np.argmax(x, -1))
