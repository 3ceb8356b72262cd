"""The FP8 experts as whole-K Triton programs (jspec.pallas_kernels.fp8_experts_triton) at
decode sizes, against float64 NumPy on the dequantized weights and against the Mosaic GPU
decode path bit for bit where both round the same values; interpret mode here, the GPU runs
marked `gpu`."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jspec.pallas_kernels import decode_routing, platform
from jspec.pallas_kernels.fp8_experts import BLOCK, Fp8Experts
from jspec.pallas_kernels.fp8_experts_triton import (ROWS, TritonExpertsTiling, down_weighted,
                                                     experts_fp8_triton, fits, gate_up_act)

RUN_SEED = 20261203


def _fp8(rng, num_experts, out, inner):
  w8 = np.clip(rng.standard_normal((num_experts, out, inner)) * 60, -448, 448)
  scale = rng.uniform(1e-4, 3e-3, (num_experts, out // BLOCK, inner // BLOCK))
  return Fp8Experts(jnp.asarray(w8.astype(ml_dtypes.float8_e4m3fn)),
                    jnp.asarray(scale, jnp.float32))


def _dequantized64(w: Fp8Experts):
  """[E, out, in] float64."""
  scale = np.repeat(np.repeat(np.asarray(w.scale, np.float64), BLOCK, 1), BLOCK, 2)
  return np.asarray(w.w8).astype(np.float64) * scale


def _problem(seed, num_tokens, num_experts=6, top_k=2, dim=256, ffn=128):
  rng = np.random.default_rng([RUN_SEED, seed, num_tokens])
  w_gate, w_up = _fp8(rng, num_experts, ffn, dim), _fp8(rng, num_experts, ffn, dim)
  w_down = _fp8(rng, num_experts, dim, ffn)
  x = jnp.asarray(rng.standard_normal((num_tokens, dim)), jnp.bfloat16)
  ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)])
  if num_tokens > 1:
    ids[1, 0] = -1            # another shard's expert (expert parallelism passes -1)
    ids[-1] = ids[0]          # two tokens with the same experts: one slot each, read once
  weights = rng.uniform(0.1, 1.0, (num_tokens, top_k))
  return x, jnp.asarray(ids, jnp.int32), jnp.asarray(weights, jnp.float32), w_gate, w_up, w_down


def _reference64(x, ids, weights, w_gate, w_up, w_down, round_act=True):
  """float64 y; act rounded to bfloat16 as the kernels (and the model's MLP) round it."""
  x, weights, ids = np.asarray(x, np.float64), np.asarray(weights, np.float64), np.asarray(ids)
  gate, up, down = (_dequantized64(w) for w in (w_gate, w_up, w_down))
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for k in range(ids.shape[1]):
      e = ids[t, k]
      if 0 <= e < gate.shape[0]:
        g, u = gate[e] @ x[t], up[e] @ x[t]
        act = g / (1 + np.exp(-g)) * u
        if round_act:
          act = act.astype(ml_dtypes.bfloat16).astype(np.float64)
        y[t] += weights[t, k] * (down[e] @ act)
  return y


def _assert_close(y, exact, bound=2.0 ** -7):
  y = np.asarray(y, np.float64)
  scale = np.maximum(np.abs(exact).max(axis=1, keepdims=True), 1e-6)
  assert np.isfinite(y).all()
  assert (np.abs(y - exact) <= bound * scale).all(), np.abs(y - exact).max()


TILINGS = [TritonExpertsTiling(),
           TritonExpertsTiling(gate_up_columns=16, gate_up_blocks=1, down_columns=64,
                               down_blocks=1),
           TritonExpertsTiling(gate_up_columns=128, gate_up_blocks=3, down_columns=16,
                               down_blocks=4)]


@pytest.mark.parametrize("tiling", range(len(TILINGS)))
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16])
def test_triton_fp8_experts_equal_the_dequantized_layer(num_tokens, tiling):
  problem = _problem(tiling, num_tokens)
  y = experts_fp8_triton(*problem, tiling=TILINGS[tiling])
  assert y.shape == problem[0].shape and y.dtype == jnp.bfloat16
  _assert_close(y, _reference64(*problem))


@pytest.mark.parametrize("seed", range(4))
def test_the_activation_is_the_rounded_swiglu_of_each_slot(seed):
  """gate_up_act alone: row t of slot s is bf16(silu(g) * u) of token t and the slot's expert,
  rows past T zero (every slot used here: the plan of two tokens' distinct picks)."""
  x, ids, weights, w_gate, w_up, _ = _problem(10 + seed, 2, num_experts=5, dim=384, ffn=256)
  plan = decode_routing.plan_decode(ids, weights, 5)
  act = np.asarray(gate_up_act(x, w_gate, w_up, plan.slot_expert_S, plan.num_slots_1),
                   np.float64)
  gate, up = _dequantized64(w_gate), _dequantized64(w_up)
  xs = np.asarray(x, np.float64)
  for s in range(int(plan.num_slots_1[0])):
    e = int(plan.slot_expert_S[s])
    g, u = xs @ gate[e].T, xs @ up[e].T
    exact = g / (1 + np.exp(-g)) * u
    scale = np.abs(exact).max()
    assert np.abs(act[s, :2] - exact).max() <= 2.0 ** -7 * scale
    assert (act[s, 2:] == 0).all()


def test_the_down_product_weights_each_row():
  rng = np.random.default_rng([RUN_SEED, 99])
  w_down = _fp8(rng, 3, 256, 384)
  act = jnp.asarray(rng.standard_normal((2, ROWS, 384)), jnp.bfloat16)
  slot_expert = jnp.asarray([2, 0], jnp.int32)
  weight = jnp.asarray(rng.uniform(0, 1, (2, 32)), jnp.float32)
  out = np.asarray(down_weighted(act, w_down, slot_expert, jnp.asarray([2], jnp.int32), weight),
                   np.float64)
  down = _dequantized64(w_down)
  for s, e in enumerate([2, 0]):
    exact = np.asarray(weight[s, :ROWS], np.float64)[:, None] * (
        np.asarray(act[s], np.float64) @ down[e].T)
    assert np.abs(out[s] - exact).max() <= 2.0 ** -16 * np.abs(exact).max()


def test_a_single_tokens_invalid_pick_adds_nothing():
  x, ids, weights, w_gate, w_up, w_down = _problem(20, 1, num_experts=4, top_k=3)
  ids = ids.at[0, 1].set(4)  # past the 4 experts (another shard's, under ep)
  y = experts_fp8_triton(x, ids, weights, w_gate, w_up, w_down)
  _assert_close(y, _reference64(x, ids, weights, w_gate, w_up, w_down))


def test_what_the_kernels_refuse():
  x, ids, weights, w_gate, w_up, w_down = _problem(30, 2)
  assert fits(x, w_gate, w_up, w_down)
  assert not fits(x.astype(jnp.float32), w_gate, w_up, w_down)
  assert not fits(jnp.zeros((ROWS + 1, x.shape[1]), jnp.bfloat16), w_gate, w_up, w_down)
  with pytest.raises(ValueError, match="bfloat16 x of at most"):
    experts_fp8_triton(x.astype(jnp.float32), ids, weights, w_gate, w_up, w_down)
  with pytest.raises(ValueError, match="columns a program"):
    experts_fp8_triton(x, ids, weights, w_gate, w_up, w_down,
                       tiling=TritonExpertsTiling(gate_up_columns=48))


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_on_the_gpu_at_qwen3_30b_a3b_shapes(num_tokens):
  problem = _problem(40, num_tokens, num_experts=16, top_k=8, dim=2048, ffn=768)
  y = jax.jit(experts_fp8_triton)(*problem)
  _assert_close(y, _reference64(*problem))
