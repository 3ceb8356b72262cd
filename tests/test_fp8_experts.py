"""FP8 experts at decode sizes (jspec.pallas_kernels.fp8_experts): the Pallas expert backend,
handed e4m3 expert weights [E, out, in] with their 128 x 128 block scales as checkpoints store
them, against float64 NumPy on the dequantized weights (e4m3 value x its block's scale). In
interpret mode here; the GPU run is marked `gpu`."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jspec.models.moe_backends import experts_reference
from jspec.pallas_kernels import platform
from jspec.pallas_kernels.experts import experts_pallas
from jspec.pallas_kernels.fp8_experts import (BLOCK, CHUNK_TOKENS, CHUNKED_MAX_TOKENS,
                                              Fp8Experts, fits_kernel)

RUN_SEED = 20261125


def _fp8(rng, num_experts, out, inner):
  w8 = np.clip(rng.standard_normal((num_experts, out, inner)) * 60, -448, 448)
  scale = rng.uniform(1e-4, 3e-3, (num_experts, out // BLOCK, inner // BLOCK))
  return Fp8Experts(jnp.asarray(w8.astype(ml_dtypes.float8_e4m3fn)),
                    jnp.asarray(scale, jnp.float32))


def _dequantized64(w: Fp8Experts):
  """[E, in, out] float64."""
  scale = np.repeat(np.repeat(np.asarray(w.scale, np.float64), BLOCK, 1), BLOCK, 2)
  return np.swapaxes(np.asarray(w.w8).astype(np.float64) * scale, 1, 2)


def _reference64(x, ids, weights, w_gate, w_up, w_down):
  x, ids, weights = (np.asarray(a, np.float64) for a in (x, ids, weights))
  gate, up, down = (_dequantized64(w) for w in (w_gate, w_up, w_down))
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for k in range(ids.shape[1]):
      e = int(ids[t, k])
      if 0 <= e < gate.shape[0]:
        g, u = x[t] @ gate[e], x[t] @ up[e]
        y[t] += weights[t, k] * ((g / (1 + np.exp(-g)) * u) @ down[e])
  return y


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


def _assert_close(y, exact):
  y = np.asarray(y, np.float64)
  # e4m3 -> float16 is exact, x (bf16) in float16 after a power-of-two row scale is exact,
  # products sum in float32; act goes to float16 (2^-11) and the output to bf16 (2^-9): 2^-7
  # of the output's magnitude bounds both with room.
  scale = np.maximum(np.abs(exact).max(axis=1, keepdims=True), 1e-6)
  assert np.isfinite(y).all()
  assert (np.abs(y - exact) <= 2.0 ** -7 * scale).all(), np.abs(y - exact).max()


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 16])
def test_fp8_experts_equal_the_dequantized_layer(num_tokens):
  problem = _problem(0, num_tokens)
  y = experts_pallas(*problem)
  assert y.shape == problem[0].shape and y.dtype == jnp.bfloat16
  _assert_close(y, _reference64(*problem))


def test_an_odd_number_of_k_blocks_and_several_column_blocks():
  problem = _problem(1, 4, num_experts=4, top_k=3, dim=384, ffn=256)
  _assert_close(experts_pallas(*problem), _reference64(*problem))


def test_a_single_token_with_an_invalid_pick_adds_nothing_for_it():
  x, ids, weights, *fp8 = _problem(2, 1)
  only_first = ids.at[0, 1].set(-1)
  expected = _reference64(x, only_first, weights, *fp8)
  _assert_close(experts_pallas(x, only_first, weights, *fp8), expected)


@pytest.mark.parametrize("num_tokens", [40, 2 * CHUNK_TOKENS + 5])
def test_verify_sized_steps_run_in_chunks_of_the_kernel(num_tokens):
  """40 tokens x 3 picks: more copies than the bf16 decode path takes, one sum per kernel
  (N = 64); 133 tokens: three chunks, the last of 5."""
  problem = _problem(7, num_tokens, top_k=3)
  _assert_close(experts_pallas(*problem), _reference64(*problem))


def test_prefill_sized_steps_take_scaled_copies():
  """Above CHUNKED_MAX_TOKENS the grouped path runs on the dequantized experts in bf16: x @ W
  in bf16 products, act rounded to bf16 (2^-9) before the down product, so the bound is
  looser than the kernel's."""
  problem = _problem(3, CHUNKED_MAX_TOKENS + 8)
  y = np.asarray(experts_pallas(*problem), np.float64)
  exact = _reference64(*problem)
  scale = np.abs(exact).max(axis=1, keepdims=True)
  assert np.isfinite(y).all() and (np.abs(y - exact) <= 2.0 ** -5 * scale).all()


def test_fits_kernel_needs_whole_blocks():
  rng = np.random.default_rng(RUN_SEED)
  assert fits_kernel(_fp8(rng, 2, 128, 256))
  partial = Fp8Experts(jnp.zeros((2, 192, 256), jnp.float8_e4m3fn), jnp.ones((2, 2, 2)))
  assert not fits_kernel(partial)


def test_dequantized_is_the_stored_weight_times_its_block_scale():
  w = _fp8(np.random.default_rng([RUN_SEED, 4]), 3, 256, 128)
  assert w.shape == (3, 128, 256)
  np.testing.assert_allclose(np.asarray(w.dequantized(jnp.float32)), _dequantized64(w),
                             rtol=1e-6)


def test_expert_parallel_shards_give_the_one_device_layer(interpreted_on_every_device):
  """ep = 2 x tp = 2 on the CPU devices: each shard's experts and intermediate blocks in FP8,
  the sums reduced over the mesh, as the model's sharded expert backend runs them."""
  from jspec.sharding.moe import sharded_experts
  from jspec.sharding.rules import MeshConfig, ShardingRules

  problem = _problem(5, 4, num_experts=4, top_k=2, dim=256, ffn=256)
  mesh = MeshConfig(dp=1, tp=2, ep=2).make_mesh()
  fn = sharded_experts(experts_pallas, mesh, ShardingRules())
  y = fn(*problem)
  _assert_close(y, _reference64(*problem))


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("num_tokens", [1, 8, 32, 64, 128])
def test_fp8_experts_on_the_gpu_at_deepseek_shard_shapes(num_tokens):
  """DeepSeek-V3's expert shapes with F split over tp = 8 (256 per shard), 32 experts."""
  problem = _problem(6, num_tokens, num_experts=32, top_k=8, dim=7168, ffn=256)
  _assert_close(experts_pallas(*problem), _reference64(*problem))

