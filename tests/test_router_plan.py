"""Batch-1 decode's plan written by the router's top-k kernel
(jspec.pallas_kernels.router_topk.route_softmax_plan): the plan decode_routing.plan_decode makes
of route_softmax's ids and weights, bit for bit; a MoE layer's one-token step through it gives
the output it gave through plan_decode; and no XLA operation stands between the top-k kernel
and the expert kernels any more (the check sees the ones plan_decode put there). The kernels
run interpreted here; `-m gpu` compiles them."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jex_core

import jspec
from jspec.config import MoEConfig
from jspec.models.moe import MoE
from jspec.models.row_kernels import sharded_router
from jspec.pallas_kernels import decode_routing
from jspec.pallas_kernels.decode_routing import plan_decode
from jspec.pallas_kernels.experts import experts_pallas
from jspec.pallas_kernels.fp8_experts import BLOCK, Fp8Experts
from jspec.pallas_kernels.router_topk import route_softmax, route_softmax_plan
from jspec.sharding.rules import MeshConfig, ShardingRules

EXPERTS = (8, 16, 64, 128, 512)
HIDDEN = (64, 128, 192, 256, 1024, 2048)


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _assert_same_bits(got, want):
  for name in ("slot_expert_S", "num_slots_1", "weight_SR", "slot_TK"):
    g, w = getattr(got, name), getattr(want, name)
    assert (g.shape, g.dtype) == (w.shape, w.dtype), name
    np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)


def _inputs(rng, hidden, experts, dtype, exact):
  """Random normal inputs, or small integers whose logits tie often (exact in any order)."""
  if exact:
    x = rng.integers(-2, 3, (1, hidden)).astype(np.float32)
    router = rng.integers(-8, 9, (hidden, experts)).astype(np.float32) / 64
  else:
    x = rng.standard_normal((1, hidden)) * rng.uniform(0.5, 4)
    router = rng.standard_normal((hidden, experts)) * hidden ** -0.5
  return jnp.asarray(x, dtype), jnp.asarray(router, dtype)


def _case(seed):
  """(hidden, experts, top_k, dtype, norm, exact) drawn from the seed."""
  rng = np.random.default_rng([20261201, seed])
  experts = int(rng.choice(EXPERTS))
  top_k = int(rng.integers(1, min(experts, 16) + 1))  # powers of two and not
  return (int(rng.choice(HIDDEN)), experts, top_k,
          (jnp.bfloat16, jnp.float32)[seed % 2], bool(seed // 2 % 2), bool(seed // 4 % 2))


# Qwen3-30B-A3B's router (2048 x 128, top 8), then random shapes.
CASES = ([(2048, 128, 8, dtype, norm, False) for dtype in (jnp.bfloat16, jnp.float32)
          for norm in (True, False)] + [_case(seed) for seed in range(24)])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_plan_equals_plan_decode_of_route_softmax_bit_for_bit(case):
  hidden, experts, top_k, dtype, norm, exact = CASES[case]
  x, router = _inputs(np.random.default_rng([case, 7]), hidden, experts, dtype, exact)
  ids, weights = route_softmax(x, router, top_k=top_k, norm=norm)
  got_ids, got_weights, plan = route_softmax_plan(x, router, top_k=top_k, norm=norm)
  np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids))
  assert got_weights.dtype == weights.dtype == dtype
  np.testing.assert_array_equal(_bits(got_weights), _bits(weights))
  _assert_same_bits(plan, plan_decode(ids, weights, experts))
  assert plan.weight_SR.shape == (top_k, decode_routing.weight_columns(1))


def test_plan_kernel_takes_one_token_only():
  x, router = _inputs(np.random.default_rng(0), 64, 8, jnp.float32, True)
  with pytest.raises(ValueError, match="routes one token"):
    route_softmax_plan(jnp.concatenate([x, x]), router, top_k=2, norm=True)


def test_a_plan_of_other_ids_is_refused():
  x, router = _inputs(np.random.default_rng(1), 64, 8, jnp.float32, False)
  ids, weights, plan = route_softmax_plan(x, router, top_k=2, norm=True)
  with pytest.raises(ValueError, match="does not plan ids"):
    decode_routing.plan_unless_given(plan, jnp.concatenate([ids, ids]), weights, 8)


# ---- the MoE layer at batch-1 decode -----------------------------------------------------------

def _moe(experts, top_k, dtype, seed=0):
  """A Qwen3-MoE block for the Pallas experts (D, F whole 64-tiles) with the router kernels."""
  moe_cfg = MoEConfig(num_experts=experts, num_experts_per_tok=top_k, intermediate_size=64,
                      norm_topk_prob=True, router_scoring="softmax",
                      router_correction_bias=False, num_shared_experts=0)
  cfg = jspec.ModelConfig(
      architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=128, intermediate_size=64,
      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
      rope_theta=1e4, tie_word_embeddings=False, max_position_embeddings=64, moe=moe_cfg,
      expert_tile=64)
  moe = MoE(cfg, dtype, nnx.Rngs(seed))
  moe.router_kernel = sharded_router(MeshConfig().make_mesh(), ShardingRules(), top_k, True,
                                     interpret=True)
  return moe


def _through_plan_decode(*args):
  """experts_pallas behind a wrapper: the layer hands it no plan (the path before the fused
  plan), so it makes its own with plan_decode."""
  return experts_pallas(*args)


@pytest.mark.parametrize("experts, top_k", [(16, 4), (32, 6)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_one_token_layer_output_is_unchanged_by_the_kernel_plan(experts, top_k, dtype):
  moe = _moe(experts, top_k, dtype)
  step = nnx.jit(lambda m, x, fn: m(x, fn), static_argnums=2)
  for seed in range(3):
    x = jax.random.normal(jax.random.key(seed), (1, 1, 128), jnp.float32).astype(dtype)
    fused, before = step(moe, x, experts_pallas), step(moe, x, _through_plan_decode)
    assert fused.dtype == dtype and np.isfinite(np.asarray(fused, np.float32)).all()
    np.testing.assert_array_equal(_bits(fused), _bits(before))


class _Flow(NamedTuple):
  """What a value of a traced program is: the output of kernel `kernel`, passed on through
  calls only (None where an operation computed it), and the kernels it depends on."""
  kernel: str | None
  kernels: frozenset


def _kernel_name(eqn) -> str | None:
  """A Triton kernel's (pallas_call) or a Mosaic GPU kernel's (mpmd_map) name."""
  if eqn.primitive.name in ("pallas_call", "mpmd_map"):
    return str(eqn.params["name"])
  return None


def _inner(eqn):
  """The jaxpr a call-like operation (jit, shard_map, a kernel's vmap rule) runs on its
  operands as they are, or None."""
  for value in eqn.params.values():
    inner = getattr(value, "jaxpr", value)  # a closed jaxpr's own
    if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
      return inner
  return None


def _flow(jaxpr, flows_in, calls) -> list:
  """Each output's _Flow; `calls` gets (kernel name, its operands' _Flows) of every kernel."""
  none = _Flow(None, frozenset())
  env = {**dict.fromkeys(jaxpr.constvars, none), **dict(zip(jaxpr.invars, flows_in))}
  read = lambda v: none if isinstance(v, jex_core.Literal) else env[v]
  for eqn in jaxpr.eqns:
    args = [read(v) for v in eqn.invars]
    name, inner = _kernel_name(eqn), _inner(eqn)
    deps = frozenset().union(*(a.kernels for a in args))
    if name is not None:
      calls.append((name, args))
      outs = [_Flow(name, deps | {name})] * len(eqn.outvars)
    elif inner is not None:
      outs = _flow(inner, args, calls)
    else:
      outs = [_Flow(None, deps)] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _expert_kernel_operands(moe, x, experts_fn):
  """[(expert kernel, operand index, _Flow)] of the layer's traced step."""
  closed = jax.make_jaxpr(lambda x: moe(x, experts_fn))(x)
  calls = []
  _flow(closed.jaxpr, [_Flow(None, frozenset())] * len(closed.jaxpr.invars), calls)
  assert any(name.startswith("router_select") for name, _ in calls)
  return [(name, i, arg) for name, args in calls if name.startswith("moe_decode")
          for i, arg in enumerate(args)]


def _computed_from_the_router(operands) -> list:
  """Expert kernel operands that an XLA operation computed from a router kernel's output."""
  return [(name, i) for name, i, arg in operands
          if arg.kernel is None and any(k.startswith("router_") for k in arg.kernels)]


def test_no_xla_operation_between_the_top_k_kernel_and_the_expert_kernels():
  moe = _moe(16, 4, jnp.bfloat16)
  x = jnp.ones((1, 1, 128), jnp.bfloat16)
  operands = _expert_kernel_operands(moe, x, experts_pallas)
  assert {name for name, _, _ in operands} == {"moe_decode_gate_up", "moe_decode_down"}
  assert _computed_from_the_router(operands) == []
  # The slot experts (both kernels) and the weight columns (down) come from the kernel as such.
  from_select = [name for name, _, arg in operands if arg.kernel == "router_select_plan"]
  assert sorted(from_select) == ["moe_decode_down", "moe_decode_down", "moe_decode_gate_up"]
  # Through plan_decode (the layer not wired to the kernel's plan) the check sees its kernels.
  assert _computed_from_the_router(_expert_kernel_operands(moe, x, _through_plan_decode))


@pytest.mark.parametrize("change", ["two_tokens", "wrapped_experts", "no_router_kernel"])
def test_other_steps_keep_plan_decode(change):
  """A verify step's tokens, experts behind a wrapper (the expert shard_map, the live-token
  mask: they change the ids) and XLA's router make their plan as before."""
  moe = _moe(16, 4, jnp.float32)
  tokens, experts_fn = 1, experts_pallas
  if change == "two_tokens":
    tokens = 2
  elif change == "wrapped_experts":
    experts_fn = _through_plan_decode
  else:
    moe.router_kernel = None
  x = jnp.ones((1, tokens, 128), jnp.float32)
  trace = str(jax.make_jaxpr(lambda x: moe(x, experts_fn))(x))
  assert "router_select_plan" not in trace and "moe_decode_gate_up" in trace


def test_fp8_experts_take_the_kernel_plan_with_the_same_output():
  """The FP8 decode path (Qwen3-30B-A3B-FP8's experts as stored) reads the plan it is given."""
  rng = np.random.default_rng(3)

  def fp8(out, inner):  # e4m3 [E, out, in] and a scale per 128 x 128 block
    w8 = np.clip(rng.standard_normal((8, out, inner)) * 60, -448, 448)
    scale = rng.uniform(1e-4, 3e-3, (8, out // BLOCK, inner // BLOCK))
    return Fp8Experts(jnp.asarray(w8, jnp.float8_e4m3fn), jnp.asarray(scale, jnp.float32))

  fp8 = (fp8(128, 256), fp8(128, 256), fp8(256, 128))
  x = jnp.asarray(rng.standard_normal((1, 256)), jnp.bfloat16)
  router = jnp.asarray(rng.standard_normal((256, 8)) * 0.1, jnp.bfloat16)
  ids, weights, plan = route_softmax_plan(x, router, top_k=2, norm=True)
  fused = experts_pallas(x, ids, weights, *fp8, plan=plan)
  np.testing.assert_array_equal(_bits(fused), _bits(experts_pallas(x, ids, weights, *fp8)))


def test_batch_1_decode_of_a_model_routes_through_the_kernel_plan(monkeypatch):
  """Qwen3-MoE at batch 1 with the router kernels and the Pallas experts: every MoE layer's
  decode step takes the kernel's plan, and the greedy tokens are those without it."""
  from helpers import fixture_dir, greedy_token_ids
  from jspec.models import moe as moe_module
  from jspec.pallas_kernels import router_topk
  traced = []
  # The norm before each MoE layer apart from its router (tests/test_norm_router.py covers
  # the two in one kernel, which writes the plan through router_topk.select as well).
  monkeypatch.setattr(moe_module, "NORM_ROUTER", False)
  plan_kernel = router_topk.route_softmax_plan
  monkeypatch.setattr(router_topk, "route_softmax_plan",
                      lambda x, *a, **k: (traced.append(x.shape), plan_kernel(x, *a, **k))[1])

  def tokens():
    llm = jspec.LLM(model=fixture_dir("qwen3_moe"), dtype="float32", max_model_len=64,
                    max_num_seqs=1, norm_backend="pallas", moe_backend="pallas")
    return greedy_token_ids(llm, [[5, 9, 2, 7, 7, 1]], 4)

  fused = tokens()
  # the fixture's two MoE layers (layer 0 is dense), one token each
  assert len(traced) >= 2 and set(traced) == {(1, 64)}
  planned = len(traced)
  monkeypatch.setattr(moe_module, "takes_decode_plan", lambda experts_fn: False)
  assert tokens() == fused and len(traced) == planned


@pytest.mark.gpu
def test_compiled_kernel_plan_equals_plan_decode_on_the_gpu():
  for hidden, experts, top_k, dtype, norm, exact in CASES:
    x, router = _inputs(np.random.default_rng(hidden + experts), hidden, experts, dtype, exact)
    ids, weights = route_softmax(x, router, top_k=top_k, norm=norm)
    got_ids, _, plan = jax.block_until_ready(
        route_softmax_plan(x, router, top_k=top_k, norm=norm))
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids))
    _assert_same_bits(plan, plan_decode(ids, weights, experts))
