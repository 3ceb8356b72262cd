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
    # Rounded to dtype on the host (ml_dtypes, as jnp.asarray does), then widened exactly: no
    # device conversion to compile for each of the 60 shapes.
    x = random_logits(rng, shape).astype(np.dtype(dtype)).astype(np.float32)
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


# ---- the argmax of a split vocabulary in one all-reduce (jspec.sharding.vocab) ----------------

SPLITS = [((1, 2, 1), "tp", 2), ((1, 4, 1), "tp", 3), ((2, 2, 1), "tp", 2), ((2, 4, 1), "tp", 3),
          ((1, 2, 2), "tp", 2)]  # (dp, tp, ep), the vocabulary's axes, logits' rank


@pytest.mark.parametrize("mesh_shape, vocab, ndim", SPLITS)
def test_the_split_argmax_equals_vocab_argmax_in_one_all_reduce(mesh_shape, vocab, ndim):
  """Every shard's best (key, index) through one all-reduce: the tokens vocab_argmax gives
  (ties to the lowest index across shards, a NaN row's first NaN, -0.0 tied with +0.0), rows
  over the batch axes as the loop lays logits out, and no all-gather."""
  from jspec.sharding.rules import MeshConfig, ShardingRules
  from jspec.sharding.vocab import sharded_vocab_argmax
  dp, tp, ep = mesh_shape
  mesh = MeshConfig(dp=dp, tp=tp, ep=ep).make_mesh()
  rules = ShardingRules(vocab=vocab)
  argmax = jax.jit(sharded_vocab_argmax(mesh, rules))
  whole = jax.jit(vocab_argmax)  # one program per shape, not its ops compiled one by one
  rng = np.random.default_rng(dp * 100 + tp * 10 + ep + ndim)
  for case in range(12):
    shape = (dp * ep * int(rng.integers(1, 4)),) + (3,) * (ndim - 2) + (
        tp * int(rng.integers(1, 40)),)
    x = random_logits(rng, shape).astype(np.float32)
    if case % 3 == 0:  # the same best value in two shards: the lower index must win
      x[..., 0] = x[..., -1] = 50.0
    layout = rules.sharding(mesh, ("batch",) + (None,) * (ndim - 2) + ("vocab",))
    placed = jax.device_put(x, layout)
    np.testing.assert_array_equal(np.asarray(argmax(placed)), np.asarray(whole(x)),
                                  err_msg=f"case {case}, shape {shape}")
  text = argmax.lower(placed).compile().as_text()
  assert text.count("all-reduce-start") + text.count("all-reduce(") == 1
  assert "all-gather" not in text


def test_no_split_argmax_where_the_vocabulary_is_whole_or_split_with_the_batch():
  from jspec.sharding.rules import MeshConfig, ShardingRules
  from jspec.sharding.vocab import sharded_vocab_argmax
  assert sharded_vocab_argmax(MeshConfig(dp=2).make_mesh(), ShardingRules()) is None
  assert sharded_vocab_argmax(MeshConfig(tp=2).make_mesh(), ShardingRules(vocab=None)) is None
  assert sharded_vocab_argmax(MeshConfig(tp=2, ep=2).make_mesh(),
                              ShardingRules(vocab=("ep", "tp"))) is None
