"""An FP8 MLA layer's latent projections as a Hopper GPU runs them (interpreted on the CPU):
q_a_proj and kv_a_proj_with_mqa in one call of the few-row FP8 kernel
(jspec.pallas_kernels.fp8_gemm.fp8_matmul_many), kv_a's rows padded at build to whole 128-row
blocks, against the same layer with its weights scaled before XLA's products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jspec
from jspec.config import MLAConfig, ModelConfig
from jspec.models import mla, projections
from jspec.models.mla import MLAttention, kv_a_width, mla_cache
from jspec.pallas_kernels import fp8_gemm
from jspec.pallas_kernels.fp8_block_kernel import BLOCK
from jspec.sharding.rules import ShardingRules

RUN_SEED = 20261201


def _config(fp8_block=(BLOCK, BLOCK)):
  # kv_a: 128 latent + 64 rope rows, a partial second block.
  return ModelConfig(
      architecture="DeepseekV3ForCausalLM", vocab_size=64, hidden_size=128,
      intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
      rms_norm_eps=1e-6, rope_theta=1000.0, tie_word_embeddings=False,
      max_position_embeddings=256, fp8_block=fp8_block,
      mla=MLAConfig(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                    qk_rope_head_dim=64, v_head_dim=128))


def test_kv_a_is_padded_to_its_block_in_fp8_only():
  assert kv_a_width(_config()) == 256
  assert kv_a_width(_config(fp8_block=None)) == 192
  # DeepSeek-V3's 512 + 64 rows.
  v3 = _config().replace(mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                       qk_rope_head_dim=64, v_head_dim=128))
  assert kv_a_width(v3) == 640


def _deepseek_v3_shapes():
  """DeepSeek-V3's latent projections (hidden 7168, q_a 1536 rows, kv_a 512 + 64 padded to
  640: one call of 17 column blocks over K = 56 blocks, 7 K slices on an H200), 2 heads."""
  return _config().replace(hidden_size=7168, mla=MLAConfig(
      q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
      v_head_dim=128))


def _fp8_mla_layer(seed, cfg):
  """The layer with random block scales (the padded rows' weights stay zero only as loaded
  from a checkpoint; random ones here must not reach the output either)."""
  attn = MLAttention(cfg, jnp.float32, nnx.Rngs(seed))
  rng = np.random.default_rng([RUN_SEED, seed])
  for _, node in nnx.iter_graph(attn):
    if isinstance(node, nnx.Param) and node.get_metadata().get("fp8_in_axes"):
      node.set_value(jnp.asarray(rng.uniform(0.5, 2.0, node.shape), jnp.float32))
  return attn


@pytest.mark.parametrize("tokens", [1, 3])
def test_q_a_and_kv_a_go_through_one_kernel_call_and_equal_xla(monkeypatch, tokens):
  """A decode step (1 token) or verify window (3) after a 5-token prefill, with the model's
  FP8 product set as a Hopper GPU sets it: q_a and kv_a (256 rows as stored) are one call a
  window, and the output equals the scaled XLA products' (the fused call's off too)."""
  _check_fused_layer(monkeypatch, _config(), tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4])
def test_on_the_gpu_at_deepseek_v3_shapes(monkeypatch, tokens):
  """The compiled kernel where the test above interprets it (Hopper: a GPU without wgmma fails
  here rather than skipping)."""
  _check_fused_layer(monkeypatch, _deepseek_v3_shapes(), tokens)


def _check_fused_layer(monkeypatch, cfg, tokens):
  attn = _fp8_mla_layer(tokens, cfg)
  width = kv_a_width(cfg)
  assert attn.kv_a_proj.shape == (width, cfg.hidden_size)
  assert attn.kv_a_proj_scale.shape == (width // BLOCK, cfg.hidden_size // BLOCK)
  rng = np.random.default_rng([RUN_SEED, 11, tokens])
  x = jnp.asarray(rng.standard_normal((2, 5 + tokens, cfg.hidden_size)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(5 + tokens, dtype=jnp.int32), (2, 5 + tokens))

  def run():
    _, cache = attn(x[:, :5], positions[:, :5], mla_cache(cfg, 2, 16, jnp.float32), 16)
    out, cache = attn(x[:, 5:], positions[:, 5:], cache, 16)
    return np.asarray(out), np.asarray(cache.latent)

  want, want_cache = run()
  fused = []
  many = fp8_gemm.fp8_matmul_many
  monkeypatch.setattr(fp8_gemm, "fp8_matmul_many", lambda x, ws, *args, **kwargs: fused.append(
      [w.shape for w in ws]) or many(x, ws, *args, **kwargs))
  mesh = jspec.MeshConfig().make_mesh(jax.devices()[:1])
  attn.fp8_projection = projections.sharded_fp8_projection(mesh, ShardingRules(),
                                                           (BLOCK, BLOCK))
  got, got_cache = run()
  # q_a and kv_a, one call a window
  assert fused == [[(cfg.mla.q_lora_rank, cfg.hidden_size), (width, cfg.hidden_size)]] * 2
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
  np.testing.assert_allclose(got_cache, want_cache, rtol=0, atol=1e-3 * np.abs(want_cache).max())
  monkeypatch.setattr(mla, "FUSED_LATENT_PROJECTIONS", False)
  fused.clear()
  apart, _ = run()
  assert not fused  # kv_a through the one-weight call
  np.testing.assert_allclose(apart, want, rtol=0, atol=1e-3 * np.abs(want).max())
