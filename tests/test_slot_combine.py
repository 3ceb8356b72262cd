"""The FP8 expert path's combine kernel (jspec.pallas_kernels.slot_combine): the down kernel's
K-slice partials [P, S, D, N] summed, scaled per (slot, token) and added over each token's
picks in order, against a float32 NumPy form of the same operations (bit for bit), and the
FP8 expert layer through it against the layer through XLA's combine. In interpret mode here;
the GPU run is marked `gpu`."""

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.pallas_kernels import fp8_experts, platform, slot_combine
from test_fp8_experts import _problem as fp8_problem

RUN_SEED = 20261201


def _problem(rng, splits, slots, dim, rows, tokens, top_k):
  down = rng.standard_normal((splits, slots, dim, rows)).astype(np.float32)
  scale = rng.uniform(0.0, 1.0, (slots, rows)).astype(np.float32)
  slot_TK = rng.integers(0, slots, (tokens, top_k)).astype(np.int32)
  slot_TK[rng.random((tokens, top_k)) < 0.25] = -1   # repeated or out-of-range picks
  return down, scale, slot_TK


def _combined32(down, scale, slot_TK):
  """y [T, D] float32: the partials summed first to last, times the scale, picks in order."""
  tokens, top_k = slot_TK.shape
  y = np.zeros((tokens, down.shape[2]), np.float32)
  for t in range(tokens):
    for k in range(top_k):
      s = slot_TK[t, k]
      if s < 0:
        continue
      total = down[0, s, :, t]
      for p in range(1, down.shape[0]):
        total = total + down[p, s, :, t]
      y[t] = y[t] + total * scale[s, t]
  return y


@pytest.mark.parametrize("case", range(6))
def test_combine_is_the_scaled_sum_of_each_tokens_slots_in_pick_order(case):
  """P of 1 to 3, D of 128 to 7168 (7 x 1024), N of 8 or 16, 1 to N tokens, 1 to 8 picks."""
  rng = np.random.default_rng([RUN_SEED, case])
  splits, dim, rows, top_k = [(1, 128, 8, 8), (2, 256, 8, 2), (3, 384, 16, 4),
                              (1, 7168, 8, 8), (2, 640, 16, 1), (1, 192, 8, 3)][case]
  tokens = int(rng.integers(1, rows + 1))
  down, scale, slot_TK = _problem(rng, splits, int(rng.integers(2, 10)), dim, rows, tokens,
                                  top_k)
  got = slot_combine.combine_down_partials(jnp.asarray(down), jnp.asarray(scale),
                                           jnp.asarray(slot_TK), jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), _combined32(down, scale, slot_TK))
  got16 = slot_combine.combine_down_partials(jnp.asarray(down), jnp.asarray(scale),
                                             jnp.asarray(slot_TK), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got16, np.float32),
                                np.asarray(jnp.asarray(_combined32(down, scale, slot_TK))
                                           .astype(jnp.bfloat16), np.float32))


def test_shapes_it_does_not_take_are_refused():
  with pytest.raises(ValueError, match="float32 partials"):
    slot_combine.combine_down_partials(jnp.zeros((1, 2, 96, 8), jnp.float32),
                                       jnp.ones((2, 8)), jnp.zeros((1, 2), jnp.int32),
                                       jnp.float32)   # D = 96: no power-of-two block >= 64
  with pytest.raises(ValueError, match="float32 partials"):
    slot_combine.combine_down_partials(jnp.zeros((1, 2, 128, 8), jnp.float32),
                                       jnp.ones((2, 8)), jnp.zeros((9, 2), jnp.int32),
                                       jnp.float32)   # more tokens than N


@pytest.mark.parametrize("num_tokens,down_splits", [(1, 1), (3, 1), (5, 3)])
def test_the_fp8_expert_layer_through_the_kernel_equals_it_through_xla(monkeypatch,
                                                                      num_tokens,
                                                                      down_splits):
  """Bit for bit with one K slice of the down product; with three, within float32's
  rounding of the slices' sum (XLA may add them in another order)."""
  problem = fp8_problem(40 + num_tokens, num_tokens, dim=256, ffn=384)
  tiling = fp8_experts.Fp8ExpertsTiling(down_splits=down_splits)
  want = fp8_experts.experts_fp8_decode(*problem, tiling=tiling)
  monkeypatch.setattr(fp8_experts, "COMBINE_KERNEL", True)
  got = fp8_experts.experts_fp8_decode(*problem, tiling=tiling)
  if down_splits == 1:
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  else:  # one bfloat16 rounding apart at most
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2.0 ** -7, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_gpu(), reason="needs a GPU")
def test_combine_on_the_gpu_at_deepseek_v3_shapes():
  """8 slots of D = 7168, N = 8, one token of 8 picks, one K slice."""
  rng = np.random.default_rng([RUN_SEED, 99])
  down, scale, slot_TK = _problem(rng, 1, 8, 7168, 8, 1, 8)
  got = slot_combine.combine_down_partials(jnp.asarray(down), jnp.asarray(scale),
                                           jnp.asarray(slot_TK), jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), _combined32(down, scale, slot_TK))
