"""The residual add + RMSNorm before a MoE layer and its router product in one kernel
(jspec.pallas_kernels.norm_router), against the two kernels it replaces (residual_norm.rms_norm,
then router_topk's partials of its output), in interpret mode: h and norm(h) bit for bit, the
partial logits within float32 rounding (the sums' order is the same; only where the compiler
fuses a multiply and an add may differ), the routing equal. A Qwen3-MoE model takes it at
every MoE layer of a decode step and keeps its greedy tokens. On a GPU (`gpu` marker): the
compiled kernel against the compiled pair."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import fixture_dir, greedy_token_ids
from jspec.models import moe as moe_module
from jspec.pallas_kernels import norm_router, residual_norm, router_topk

# (rows, hidden, experts, top_k, dtype, zero_centered)
CASES = [(1, 2048, 128, 8, jnp.bfloat16, False), (1, 512, 64, 4, jnp.float32, True),
         (3, 256, 8, 2, jnp.bfloat16, True), (8, 1024, 32, 6, jnp.float32, False),
         (5, 128, 16, 3, jnp.bfloat16, False), (2, 2048, 128, 8, jnp.float32, False)]


def _inputs(rng, rows, hidden, experts, dtype):
  x = jnp.asarray(rng.standard_normal((rows, hidden)) * 2, dtype)
  delta = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
  scale = jnp.asarray(1 + rng.standard_normal(hidden) / 4, dtype)
  router = jnp.asarray(rng.standard_normal((hidden, experts)) / np.sqrt(hidden), dtype)
  return x, delta, scale, router


def _unfused(x, delta, scale, router, zero_centered):
  h, normed = residual_norm.rms_norm(x, scale, delta, eps=1e-6, zero_centered=zero_centered,
                                     interpret=True)
  parts = router_topk._router_partials(normed, router, 1, None, True)
  return h, normed, parts


@pytest.mark.parametrize("seed", range(len(CASES)))
def test_the_fused_kernel_equals_the_norm_then_the_router_partials(seed):
  rows, hidden, experts, _, dtype, zero_centered = CASES[seed]
  x, delta, scale, router = _inputs(np.random.default_rng(seed), rows, hidden, experts, dtype)
  h, normed, parts = norm_router.add_norm_router_partials(
      x, delta, scale, router, eps=1e-6, zero_centered=zero_centered, interpret=True)
  want_h, want_normed, want_parts = _unfused(x, delta, scale, router, zero_centered)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(want_h))
  np.testing.assert_array_equal(np.asarray(normed), np.asarray(want_normed))
  assert parts.shape == (rows, router_topk.num_slices(hidden), experts)
  np.testing.assert_allclose(np.asarray(parts), np.asarray(want_parts), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(len(CASES)))
def test_its_routing_is_route_softmax_of_the_normed_rows(seed):
  """ids equal, weights within a rounding of x's dtype; one token with its decode plan as
  route_softmax_plan's."""
  rows, hidden, experts, top_k, dtype, zero_centered = CASES[seed]
  x, delta, scale, router = _inputs(np.random.default_rng(100 + seed), rows, hidden, experts,
                                    dtype)
  for norm in (True, False):
    plan = rows == 1
    h, normed, routing = norm_router.add_norm_route_softmax(
        x, delta, scale, router, eps=1e-6, zero_centered=zero_centered, top_k=top_k,
        norm=norm, plan=plan, interpret=True)
    route = router_topk.route_softmax_plan if plan else router_topk.route_softmax
    want = route(normed, router, top_k=top_k, norm=norm, interpret=True)
    np.testing.assert_array_equal(np.asarray(routing[0]), np.asarray(want[0]))
    tolerance = float(jnp.finfo(dtype).eps) * 2
    np.testing.assert_allclose(np.asarray(routing[1], np.float32),
                               np.asarray(want[1], np.float32), rtol=tolerance, atol=1e-7)
    if plan:
      got_plan, want_plan = routing[2], want[2]
      np.testing.assert_array_equal(np.asarray(got_plan.slot_expert_S),
                                    np.asarray(want_plan.slot_expert_S))
      np.testing.assert_array_equal(np.asarray(got_plan.slot_TK), np.asarray(want_plan.slot_TK))
      np.testing.assert_allclose(np.asarray(got_plan.weight_SR),
                                 np.asarray(want_plan.weight_SR), rtol=tolerance, atol=1e-7)


def _kernel_primitives(jaxpr) -> list[str]:
  """The primitive names of the first pallas_call's kernel body found in `jaxpr`."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      return [e.primitive.name for e in eqn.params["jaxpr"].eqns]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      if names := _kernel_primitives(sub):
        return names
  return []


@pytest.mark.parametrize("hidden", [2048, 7168])
def test_every_load_comes_before_the_rows_sum_of_squares(hidden):
  """The kernel reads everything (the row's pieces, its slice's h, router rows and scale)
  before its first reduction: on a GPU a block reduction is a barrier, and a load written
  after it starts only once it is done, one memory latency later (BENCHMARKS.md, "The norm +
  router kernel's loads before its row's reduction"). 7168 is read in 7 pieces, each of
  which once waited for the sum of the piece before; its outputs are checked as well."""
  x, delta, scale, router = _inputs(np.random.default_rng(hidden), 1, hidden, 128, jnp.bfloat16)
  call = lambda *a: norm_router.add_norm_router_partials(*a, eps=1e-6, interpret=True)
  names = _kernel_primitives(jax.make_jaxpr(call)(x, delta, scale, router).jaxpr)
  loads = [i for i, name in enumerate(names) if name == "get"]
  stores = [i for i, name in enumerate(names) if name == "swap"]
  assert loads and stores and "reduce_sum" in names
  assert max(loads) < names.index("reduce_sum") < min(stores)
  h, normed, parts = call(x, delta, scale, router)
  want_h, want_normed, want_parts = _unfused(x, delta, scale, router, False)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(want_h))
  np.testing.assert_array_equal(np.asarray(normed), np.asarray(want_normed))
  np.testing.assert_allclose(np.asarray(parts), np.asarray(want_parts), rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_refused():
  x, delta, scale, router = _inputs(np.random.default_rng(0), 2, 256, 16, jnp.bfloat16)
  call = lambda *a, **k: norm_router.add_norm_router_partials(*a, eps=1e-6, interpret=True, **k)
  with pytest.raises(ValueError, match="x and delta"):
    call(x, delta.astype(jnp.float32), scale, router)
  with pytest.raises(ValueError, match="x and delta"):
    call(x, delta, scale, router[:128])
  with pytest.raises(ValueError, match="x and delta"):  # experts not a power of two
    call(x, delta, scale, router[:, :12])
  with pytest.raises(ValueError, match="slices"):
    call(x, delta, scale, router, slices=3)
  with pytest.raises(ValueError, match="top_k"):
    norm_router.add_norm_route_softmax(x, delta, scale, router, eps=1e-6, zero_centered=False,
                                       top_k=17, norm=True, interpret=True)


@pytest.mark.parametrize("fixture, batch", [("qwen3_moe", 1), ("qwen3_moe", 3),
                                            ("qwen3_next", 1)])
def test_a_moe_model_routes_through_the_fused_kernel_with_its_tokens(monkeypatch, fixture,
                                                                     batch):
  """Qwen3-MoE and Qwen3-Next (its (1 + w) norms, hybrid layers, a shared expert) with the
  row and router kernels and the Pallas experts: each MoE layer's norm and router product
  run as the fused kernel (with the decode plan at batch 1), and the greedy tokens are those
  of the norm and the router apart."""
  calls = []
  fused_call = norm_router.add_norm_route_softmax
  monkeypatch.setattr(norm_router, "add_norm_route_softmax",
                      lambda x, *a, **k: (calls.append((x.shape, k["plan"])),
                                          fused_call(x, *a, **k))[1])
  prompts = [[5, 9, 2, 7, 7, 1], [3, 3, 8], [1, 2, 3, 4]][:batch]

  def tokens():
    llm = jspec.LLM(model=fixture_dir(fixture), dtype="float32", max_model_len=64,
                    max_num_seqs=batch, norm_backend="pallas", moe_backend="pallas")
    return greedy_token_ids(llm, prompts, 4)

  fused = tokens()
  assert calls and all(plan == (shape[0] == 1) for shape, plan in calls)
  # decode steps (their bucket's rows) as well as the prompt's chunk
  assert any(batch <= shape[0] <= 2 * batch for shape, _ in calls)
  made = len(calls)
  monkeypatch.setattr(moe_module, "NORM_ROUTER", False)
  assert tokens() == fused and len(calls) == made


@pytest.mark.gpu
def test_gpu_the_compiled_kernel_equals_the_compiled_pair():
  for seed, (rows, hidden, experts, _, dtype, zero_centered) in enumerate(CASES):
    x, delta, scale, router = _inputs(np.random.default_rng(seed), rows, hidden, experts,
                                      dtype)
    h, normed, parts = jax.block_until_ready(norm_router.add_norm_router_partials(
        x, delta, scale, router, eps=1e-6, zero_centered=zero_centered))
    want_h, want_normed = residual_norm.rms_norm(x, scale, delta, eps=1e-6,
                                                 zero_centered=zero_centered)
    want_parts = router_topk._router_partials(want_normed, router, 1, None, False)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(want_h))
    # The sum of squares may be ordered otherwise by the compiler: one rounding at most.
    ulp = np.abs(np.asarray(want_normed, np.float32)) * float(jnp.finfo(dtype).eps) + 1e-6
    assert np.all(np.abs(np.asarray(normed, np.float32) - np.asarray(want_normed, np.float32))
                  <= ulp)
    np.testing.assert_allclose(np.asarray(parts), np.asarray(want_parts), rtol=2e-2,
                               atol=2e-3)
