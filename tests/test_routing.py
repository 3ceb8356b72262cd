"""DeepSeek-V3 / GLM-4.5 routing against a NumPy transcription of transformers'
`DeepseekV3TopkRouter` / `Glm4MoeTopkRouter`: sigmoid scores, the correction bias used only to
choose, group-limited top-k, renormalisation and scaling; shared experts; refusals."""

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jspec
from jspec.config import MoEConfig
from jspec.models.moe import MoE, read_sigmoid_moe, route_sigmoid
from jspec.models.moe_backends import experts_reference


def _sigmoid(x):
  return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def reference_route(logits, bias, top_k, n_group, topk_group, norm, scale):
  """One token at a time, ties to the lower index (a stable sort of the negated scores)."""
  scores = _sigmoid(logits)
  choice = scores + bias.astype(np.float32)
  ids, weights = [], []
  for s, c in zip(scores, choice):
    groups = c.reshape(n_group, -1)
    group_scores = np.sort(groups, axis=1)[:, -2:].sum(axis=1, dtype=np.float32)
    kept = np.argsort(-group_scores, kind="stable")[:topk_group]
    masked = np.where(np.isin(np.arange(n_group), kept)[:, None], groups, -np.inf).reshape(-1)
    chosen = np.argsort(-masked, kind="stable")[:top_k]
    w = s[chosen]
    if norm:
      w = w / (w.sum(dtype=np.float32) + np.float32(1e-20))
    ids.append(chosen)
    weights.append(w * np.float32(scale))
  return np.array(ids), np.array(weights, np.float32)


def _route(logits, bias, top_k, n_group, topk_group, norm, scale):
  ids, weights = route_sigmoid(jnp.asarray(logits), None if bias is None else jnp.asarray(bias),
                               top_k, n_group, topk_group, norm, scale, jnp.float32)
  return np.asarray(ids), np.asarray(weights)


# (experts, n_group, topk_group, top_k): plain top-k, DeepSeek-V3's 256/8/4/8 shape scaled
# down, groups of two, every group kept, one group kept.
SHAPES = [(8, 1, 1, 2), (16, 4, 2, 4), (32, 8, 4, 8), (12, 6, 3, 5), (16, 4, 4, 3),
          (16, 4, 1, 4), (64, 8, 4, 8)]


@pytest.mark.parametrize("experts, n_group, topk_group, top_k", SHAPES)
def test_sigmoid_routing_matches_the_numpy_reference(experts, n_group, topk_group, top_k):
  """40 seeded cases per shape, 64 tokens each: ids in the same order, weights to 1e-6."""
  for seed in range(40):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (64, experts)).astype(np.float32)
    bias = rng.normal(0, 0.3, experts).astype(np.float32)
    norm, scale = bool(seed % 2), (1.0, 2.5, 1.8)[seed % 3]
    want_ids, want_w = reference_route(logits, bias, top_k, n_group, topk_group, norm, scale)
    ids, weights = _route(logits, bias, top_k, n_group, topk_group, norm, scale)
    np.testing.assert_array_equal(ids, want_ids, err_msg=f"seed {seed}")
    np.testing.assert_allclose(weights, want_w, rtol=1e-6, atol=1e-7, err_msg=f"seed {seed}")


def test_group_limit_chooses_differently_from_plain_top_k():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 2, (256, 32)).astype(np.float32)
  bias = rng.normal(0, 0.3, 32).astype(np.float32)
  grouped, _ = _route(logits, bias, 8, 8, 4, True, 1.0)
  plain, _ = _route(logits, bias, 8, 1, 1, True, 1.0)
  differs = [set(a) != set(b) for a, b in zip(grouped, plain)]
  assert 0 < sum(differs) < len(differs)
  # Every chosen expert lies in one of the token's 4 kept groups.
  assert all(len(set(row // 4)) <= 4 for row in grouped)


def test_correction_bias_chooses_experts_but_does_not_weight_them():
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 1, (32, 8)).astype(np.float32)
  bias = np.zeros(8, np.float32)
  bias[7] = 10.0  # expert 7 is chosen for every token, whatever its score
  ids, weights = _route(logits, bias, 2, 1, 1, False, 1.0)
  assert (ids[:, 0] == 7).all()
  np.testing.assert_allclose(weights, np.take_along_axis(_sigmoid(logits), ids, axis=1),
                             rtol=1e-6)
  unbiased_ids, _ = _route(logits, None, 2, 1, 1, False, 1.0)
  assert (unbiased_ids != 7).any(axis=1).any()  # without it, 7 is not always chosen
  np.testing.assert_array_equal(unbiased_ids, np.argsort(-logits, axis=1, kind="stable")[:, :2])


def test_weights_are_renormalised_then_scaled():
  rng = np.random.default_rng(2)
  logits = rng.normal(0, 1, (16, 16)).astype(np.float32)
  bias = rng.normal(0, 0.3, 16).astype(np.float32)
  _, normed = _route(logits, bias, 4, 4, 2, True, 1.0)
  np.testing.assert_allclose(normed.sum(axis=1), 1.0, rtol=1e-6)
  _, scaled = _route(logits, bias, 4, 4, 2, True, 2.5)
  np.testing.assert_allclose(scaled, 2.5 * normed, rtol=1e-6)
  _, raw = _route(logits, bias, 4, 4, 2, False, 2.5)
  assert not np.allclose(raw.sum(axis=1), 2.5)


def test_ties_go_to_the_lower_index():
  """Scores from three logit values and two bias values: ties among experts and among groups
  on every token, broken as the reference does."""
  rng = np.random.default_rng(3)
  for experts, n_group, topk_group, top_k in SHAPES:
    logits = rng.choice(np.float32([-1.0, 0.0, 1.0]), (64, experts))
    bias = rng.choice(np.float32([0.0, 0.5]), experts)
    want_ids, want_w = reference_route(logits, bias, top_k, n_group, topk_group, True, 1.0)
    ids, weights = _route(logits, bias, top_k, n_group, topk_group, True, 1.0)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=1e-6)


def _cfg(num_layers=1, **moe_changes):
  moe = MoEConfig(num_experts=16, num_experts_per_tok=4, intermediate_size=8,
                  norm_topk_prob=True, router_scoring="sigmoid", router_correction_bias=True,
                  n_group=4, topk_group=2, routed_scaling_factor=2.5, num_shared_experts=2)
  return jspec.ModelConfig(
      architecture="Glm4MoeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
      num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
      rope_theta=1e4, tie_word_embeddings=False, max_position_embeddings=64,
      moe=dataclasses.replace(moe, **moe_changes))


def _swiglu(x, gate, up, down):
  g, u = x @ gate, x @ up
  return (g / (1 + np.exp(-g)) * u) @ down


def test_moe_block_adds_ungated_shared_experts_to_the_routed_sum():
  cfg = _cfg()
  moe = MoE(cfg, jnp.float32, nnx.Rngs(0))
  x = np.random.default_rng(4).normal(0, 1, (2, 5, cfg.hidden_size)).astype(np.float32)
  got = np.asarray(nnx.jit(lambda m, x: m(x, experts_reference))(moe, jnp.asarray(x)))
  p = {".".join(map(str, path)): np.asarray(v.get_value())
       for path, v in nnx.to_flat_state(nnx.state(moe))}
  x_td = x.reshape(-1, cfg.hidden_size).astype(np.float64)
  ids, weights = reference_route((x_td @ p["router"]).astype(np.float32), p["correction_bias"],
                                 4, 4, 2, True, 2.5)
  want = np.zeros_like(x_td)
  for t in range(len(x_td)):
    for e, w in zip(ids[t], weights[t]):
      want[t] += w * _swiglu(x_td[t], p["w_gate"][e], p["w_up"][e], p["w_down"][e])
  gate_up = p["shared_experts.gate_up_proj"]
  assert gate_up.shape == (cfg.hidden_size, 2, 2 * cfg.moe.intermediate_size)
  want += _swiglu(x_td, gate_up[:, 0], gate_up[:, 1], p["shared_experts.down_proj"])
  np.testing.assert_allclose(got.reshape(-1, cfg.hidden_size), want, atol=1e-5, rtol=1e-5)


def test_softmax_router_is_unchanged_by_the_sigmoid_fields():
  """A Qwen block: softmax top-k, no correction bias, no shared experts."""
  moe = MoE(_cfg(router_scoring="softmax", router_correction_bias=False, num_shared_experts=0),
            jnp.float32, nnx.Rngs(0))
  assert not hasattr(moe, "correction_bias") and not hasattr(moe, "shared_experts")
  x = jnp.asarray(np.random.default_rng(5).normal(0, 1, (1, 3, 32)), jnp.float32)
  logits = np.asarray(x[0] @ moe.router[...])
  probs = np.exp(logits - logits.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)
  captured = {}
  moe(x, lambda x_td, ids, weights, *w: (captured.update(ids=ids, weights=weights), x_td)[1])
  want_ids = np.argsort(-probs, axis=1, kind="stable")[:, :4]
  np.testing.assert_array_equal(np.asarray(captured["ids"]), want_ids)
  want = np.take_along_axis(probs, want_ids, 1)
  np.testing.assert_allclose(np.asarray(captured["weights"]), want / want.sum(1, keepdims=True),
                             rtol=1e-5)


# ---- the config keys, read and refused ---------------------------------------------------------

def _hf(**overrides):
  fields = dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=8,
                norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                n_shared_experts=1, first_k_dense_replace=3)
  return types.SimpleNamespace(**{**fields, **overrides})


def test_sigmoid_moe_fields_are_read():
  moe = read_sigmoid_moe(_hf(scoring_func="sigmoid", topk_method="noaux_tc"))
  assert moe == MoEConfig(num_experts=16, num_experts_per_tok=4, intermediate_size=8,
                          norm_topk_prob=True, router_scoring="sigmoid",
                          router_correction_bias=True, n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, num_shared_experts=1,
                          first_k_dense_replace=3)
  assert read_sigmoid_moe(_hf()) == moe  # GLM's configs name neither key
  cfg = _cfg(first_k_dense_replace=3, num_layers=5)
  assert [cfg.layer_is_moe(i) for i in range(5)] == [False] * 3 + [True] * 2


@pytest.mark.parametrize("overrides, match", [
    (dict(scoring_func="softmax"), r"scoring_func='softmax' is not supported; jspec supports "
                                   r"\['sigmoid'\]"),
    (dict(topk_method="greedy"), r"topk_method='greedy' is not supported; jspec supports "
                                 r"\['noaux_tc'\]"),
    (dict(topk_method="group_limited_greedy"), r"topk_method='group_limited_greedy'"),
    (dict(moe_layer_freq=2), r"moe_layer_freq=2 is not supported"),
    (dict(n_group=3), r"n_group=3 must divide n_routed_experts=16"),
    (dict(topk_group=5), r"topk_group=5 must be in \[1, n_group=4\]"),
    (dict(n_group=16, topk_group=4), r"scores each group by its top-2 experts"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be in \[1, .* = 8\]"),
])
def test_unsupported_routing_is_refused(overrides, match):
  with pytest.raises(ValueError, match=match):
    read_sigmoid_moe(_hf(**overrides))
