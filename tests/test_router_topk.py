"""The softmax router's kernels (jspec.pallas_kernels.router_topk) against jspec.models.moe.route
on XLA's logits: the same experts in the same order and the same weights.

Inputs whose products are exact in float32 in any order (small integers times multiples of
1/64) make the logits bit-equal whatever the kernel's sum order, so the ids must be equal
exactly, ties included (many: the logits are few distinct values); random float inputs check
the weights within float32 rounding. On the CPU the kernels run interpreted; `-m gpu` runs
them compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.moe import route
from jspec.pallas_kernels import router_topk
from jspec.pallas_kernels.router_topk import route_softmax


# (tokens, hidden, experts, top_k): batch 1 at Qwen3-30B-A3B's router (2048 x 128, top 8),
# Qwen3-Next's 512 experts and top 10 (k not a power of two), Mixtral's 8 and top 2, a verify
# window, one expert chosen, every expert chosen.
SHAPES = [(1, 2048, 128, 8), (5, 256, 512, 10), (3, 128, 8, 2), (16, 192, 64, 1),
          (2, 64, 16, 16), (9, 512, 256, 6)]


def _reference(x, router, top_k, norm):
  logits = jnp.einsum("td,de->te", x, router)
  return route(logits, top_k, norm, x.dtype)


def _exact_inputs(rng, tokens, hidden, experts, dtype):
  x = rng.integers(-2, 3, (tokens, hidden)).astype(np.float32)
  router = rng.integers(-8, 9, (hidden, experts)).astype(np.float32) / 64
  return jnp.asarray(x, dtype), jnp.asarray(router, dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_exact_logits_give_the_same_experts_and_weights(shape, dtype, norm):
  tokens, hidden, experts, top_k = shape
  # A seed of its own per case, the same in every process (str hashes are salted per process).
  rng = np.random.default_rng([SHAPES.index(shape), int(dtype == jnp.bfloat16), int(norm)])
  x, router = _exact_inputs(rng, tokens, hidden, experts, dtype)
  ids, weights = route_softmax(x, router, top_k=top_k, norm=norm)
  ref_ids, ref_weights = _reference(x, router, top_k, norm)
  assert ids.shape == (tokens, top_k) and weights.dtype == dtype
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_allclose(np.asarray(weights, np.float32), np.asarray(ref_weights, np.float32),
                             rtol=2e-6 if dtype == jnp.float32 else 1e-2, atol=0)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_random_float_inputs_within_rounding(shape):
  tokens, hidden, experts, top_k = shape
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
  router = jnp.asarray(rng.standard_normal((hidden, experts)) * hidden ** -0.5, jnp.float32)
  ids, weights = route_softmax(x, router, top_k=top_k, norm=True)
  ref_ids, ref_weights = _reference(x, router, top_k, True)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=1e-5)


@pytest.mark.parametrize("slices", [1, 2, 8])
def test_any_slicing_of_the_router_rows_gives_the_same_logits(slices):
  rng = np.random.default_rng(slices)
  x, router = _exact_inputs(rng, 2, 1024, 128, jnp.float32)
  ids, weights = route_softmax(x, router, top_k=8, norm=True, slices=slices)
  ref_ids, ref_weights = _reference(x, router, 8, True)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=2e-6)


def test_slices_are_powers_of_two_of_whole_loop_steps():
  assert router_topk.num_slices(2048) == 16 and router_topk.num_slices(64) == 1
  assert router_topk.num_slices(7168) == 16  # DeepSeek-V3's width: 448 rows a slice
  for hidden in (64, 192, 2048, 4096, 5120, 7168):
    s = router_topk.num_slices(hidden)
    assert s & (s - 1) == 0 and hidden % (s * router_topk.ROW_CHUNK) == 0


@pytest.mark.parametrize("bad", [dict(tokens=65), dict(experts=96), dict(hidden=100),
                                 dict(top_k=0)])
def test_shapes_off_the_kernel_are_refused(bad):
  shape = dict(tokens=1, hidden=128, experts=64, top_k=2) | bad
  x = jnp.zeros((shape["tokens"], shape["hidden"]), jnp.float32)
  router = jnp.zeros((shape["hidden"], shape["experts"]), jnp.float32)
  with pytest.raises(ValueError, match="route_softmax takes"):
    route_softmax(x, router, top_k=shape["top_k"], norm=True)


@pytest.mark.gpu
def test_compiled_kernels_match_xla_routing_on_the_gpu():
  for shape in SHAPES:
    tokens, hidden, experts, top_k = shape
    rng = np.random.default_rng(0)
    x, router = _exact_inputs(rng, tokens, hidden, experts, jnp.bfloat16)
    ids, weights = jax.block_until_ready(route_softmax(x, router, top_k=top_k, norm=True))
    ref_ids, ref_weights = _reference(x, router, top_k, True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids), err_msg=str(shape))
    np.testing.assert_allclose(np.asarray(weights, np.float32),
                               np.asarray(ref_weights, np.float32), rtol=1e-2)
