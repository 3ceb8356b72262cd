"""Multi-head latent attention and its RoPE: YaRN frequencies and scales against a NumPy
transcription of transformers' formulas, interleaved rope, the absorbed form against the
expanded one and against transformers' attention, the latent cache's rollback by length,
its layout over a mesh, and refusals."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jspec
from jspec.config import MLAConfig, ModelConfig
from jspec.models import rope as rope_lib
from jspec.models.caches import MLACache
from jspec.models.mla import MLAttention, mla_cache
from jspec.sharding.rules import ShardingRules

YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707}


def _yarn_reference(dim, base, params, max_position_embeddings):
  """transformers `_compute_yarn_parameters`, transcribed in float64."""
  factor = params.get("factor") or max_position_embeddings / params[
      "original_max_position_embeddings"]
  original = params["original_max_position_embeddings"]
  mscale = lambda s, m=1.0: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
  attention = params.get("attention_factor")
  if attention is None:
    if params.get("mscale") and params.get("mscale_all_dim"):
      attention = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    else:
      attention = mscale(factor)
  fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
  bound = lambda rot: dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))
  low, high = bound(fast), bound(slow)
  if params.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  high = high + 0.001 if low == high else high
  ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
  freqs = base ** (np.arange(0, dim, 2) / dim)
  keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
  return (1 / (factor * freqs)) * (1 - keep) + (1 / freqs) * keep, attention


@pytest.mark.parametrize("params", [
    YARN,
    {**YARN, "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128},
    {**YARN, "attention_factor": 1.3},
    {"rope_type": "yarn", "original_max_position_embeddings": 64},  # factor from the lengths
])
def test_yarn_frequencies_and_attention_factor_follow_transformers(params):
  items = rope_lib.rope_scaling_items(params, max_position_embeddings=2048)
  for dim, base in ((64, 10000.0), (16, 500.0)):
    inv_freq, factor = rope_lib.inv_frequencies(dim, base, items)
    want_freq, want_factor = _yarn_reference(dim, base, params, 2048)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == (dim // 2,)
    np.testing.assert_allclose(inv_freq, want_freq, rtol=2e-6)
    assert factor == pytest.approx(want_factor, rel=1e-12)
  # The range is real: some frequencies kept, some divided by the factor, some blended.
  inv_freq, _ = rope_lib.inv_frequencies(64, 10000.0, items)
  plain, _ = rope_lib.inv_frequencies(64, 10000.0)
  ratio = plain / inv_freq
  assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(dict(items)["factor"])
  assert np.any((ratio > 1.01) & (ratio < dict(items)["factor"] - 0.01))


def test_softmax_scale_has_mscale_all_dim_squared():
  items = rope_lib.rope_scaling_items(YARN, 2048)
  mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
  assert rope_lib.softmax_scale(192, items) == pytest.approx(192 ** -0.5 * mscale ** 2)
  assert rope_lib.softmax_scale(192, ()) == 192 ** -0.5
  no_all_dim = rope_lib.rope_scaling_items({**YARN, "mscale_all_dim": 0}, 2048)
  assert rope_lib.softmax_scale(192, no_all_dim) == 192 ** -0.5


def test_interleaved_rope_rotates_adjacent_pairs_and_returns_them_as_halves():
  """transformers `apply_rotary_pos_emb_interleave`: pair j = (x_2j, x_2j+1) turns by angle
  p * inv_freq_j (times the attention factor); the output holds the firsts, then the seconds."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 3, 4, 16)).astype(np.float32)
  positions = np.array([[0, 5, 9], [3, 4, 100]], np.int32)
  inv_freq, _ = rope_lib.inv_frequencies(16, 1000.0)
  out = np.asarray(rope_lib.apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq, 1.5,
                                       interleave=True))
  angle = positions[:, :, None, None] * inv_freq.astype(np.float64)
  first, second = x[..., 0::2], x[..., 1::2]
  want_first = 1.5 * (first * np.cos(angle) - second * np.sin(angle))
  want_second = 1.5 * (second * np.cos(angle) + first * np.sin(angle))
  np.testing.assert_allclose(out, np.concatenate([want_first, want_second], -1), atol=2e-5)
  # Not interleaved: the same rotation of (x_j, x_j+8), as jspec's plain rope does.
  from jspec.models.layers import rope
  np.testing.assert_allclose(
      np.asarray(rope_lib.apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq)),
      np.asarray(rope(jnp.asarray(x), jnp.asarray(positions), 1000.0)), atol=1e-6)


# ---- the attention ----------------------------------------------------------------------------

def _config(q_lora_rank=24, interleave=True, scaling=YARN, heads=4):
  return ModelConfig(
      architecture="DeepseekV3ForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=64,
      num_layers=1, num_heads=heads, num_kv_heads=heads, head_dim=8, rms_norm_eps=1e-6,
      rope_theta=1000.0, tie_word_embeddings=False, max_position_embeddings=2048,
      rope_scaling=rope_lib.rope_scaling_items(scaling, 2048), rope_interleave=interleave,
      mla=MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=20, qk_nope_head_dim=12,
                    qk_rope_head_dim=8, v_head_dim=10))


def _attention(cfg, seed):
  """An MLAttention with random weights, its norms' scales off 1 so that they matter."""
  attn = MLAttention(cfg, jnp.float32, nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for norm in ("q_a_norm", "kv_a_norm"):
    if hasattr(attn, norm):
      scale = getattr(attn, norm).scale
      scale.set_value(jnp.asarray(1 + 0.2 * rng.normal(size=scale.shape), jnp.float32))
  return attn


@nnx.jit(static_argnames=("kv_window", "absorbed"))
def _run(attn, x, positions, cache, kv_window, absorbed=None):
  """One jitted MLAttention call (a program per shape rather than an eager op at a time)."""
  return attn(x, positions, cache, kv_window, absorbed=absorbed)


def _random_cache(cfg, batch, slots, seed):
  rng = np.random.default_rng(seed)
  width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
  return MLACache(jnp.asarray(rng.normal(size=(batch, slots, width)), jnp.float32))


@pytest.mark.parametrize("q_lora_rank, interleave, scaling, seed", [
    (24, True, YARN, 0), (0, True, YARN, 1), (24, False, {"rope_type": "default"}, 2),
    (0, False, YARN, 3)])
def test_absorbed_and_expanded_forms_agree(q_lora_rank, interleave, scaling, seed):
  """Windows of 1, 4 and 9 tokens at ragged positions over a cache of random latent rows:
  the same outputs and the same cache either way (float32)."""
  cfg = _config(q_lora_rank, interleave, scaling)
  attn = _attention(cfg, seed)
  rng = np.random.default_rng(seed + 10)
  for t in (1, 4, 9):
    x = jnp.asarray(rng.normal(size=(3, t, cfg.hidden_size)), jnp.float32)
    positions = jnp.asarray(np.array([0, 7, 20])[:, None] + np.arange(t), jnp.int32)
    cache = _random_cache(cfg, 3, 32, seed + t)
    absorbed, cache_a = _run(attn, x, positions, cache, 32, absorbed=True)
    expanded, cache_e = _run(attn, x, positions, cache, 32, absorbed=False)
    np.testing.assert_allclose(np.asarray(absorbed), np.asarray(expanded), atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache_a.latent), np.asarray(cache_e.latent))
    assert float(jnp.max(jnp.abs(absorbed))) > 0.1


def _transformers_mla(attn: MLAttention, cfg, x):
  """transformers' DeepseekV3Attention over a whole sequence (no cache), in NumPy: queries,
  latent and rope key, kv_b expansion, eager causal attention with its scaling, o_proj."""
  w = {k: np.asarray(v[...], np.float64) for k, v in nnx.to_flat_state(nnx.state(attn))
       for k in ["/".join(map(str, k))]}
  norm = lambda a, scale: scale * a / np.sqrt(np.mean(a * a, -1, keepdims=True) + 1e-6)
  n, p, r, c = (cfg.num_heads, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim,
                cfg.mla.kv_lora_rank)
  t = x.shape[0]
  if cfg.mla.q_lora_rank:
    q_b = w["q_b_proj"].reshape(cfg.mla.q_lora_rank, -1)
    q = norm(x @ w["q_a_proj"], w["q_a_norm/scale"]) @ q_b
  else:
    q = x @ w["q_proj"].reshape(cfg.hidden_size, -1)
  q = q.reshape(t, n, p + r)
  kv = x @ w["kv_a_proj"]
  latent, k_rot = norm(kv[:, :c], w["kv_a_norm/scale"]), kv[:, c:]
  inv_freq, factor = rope_lib.inv_frequencies(r, cfg.rope_theta, cfg.rope_scaling)
  angle = np.arange(t)[:, None] * inv_freq.astype(np.float64)
  cos, sin = factor * np.cos(angle), factor * np.sin(angle)

  def rotate(a):  # apply_rotary_pos_emb_interleave / apply_rotary_pos_emb
    a1, a2 = (a[..., 0::2], a[..., 1::2]) if cfg.rope_interleave else (a[..., :r // 2],
                                                                        a[..., r // 2:])
    cs = cos if a.ndim == 2 else cos[:, None]
    sn = sin if a.ndim == 2 else sin[:, None]
    return np.concatenate([a1 * cs - a2 * sn, a2 * cs + a1 * sn], -1)

  q = np.concatenate([q[..., :p], rotate(q[..., p:])], -1)
  kv_b = np.concatenate([w["w_uk"], w["w_uv"]], 1)  # [N, P + V, C]: kv_b_proj per head
  kv_heads = np.einsum("sc,nhc->snh", latent, kv_b)
  keys = np.concatenate([kv_heads[..., :p], np.broadcast_to(rotate(k_rot)[:, None],
                                                            (t, n, r))], -1)
  values = kv_heads[..., p:]
  scores = np.einsum("tnh,snh->nts", q, keys) * rope_lib.softmax_scale(p + r, cfg.rope_scaling)
  scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("nts,snv->tnv", probs, values)
  return np.einsum("tnv,nvd->td", out, w["o_proj"])


@pytest.mark.parametrize("q_lora_rank, interleave", [(24, True), (0, False)])
def test_prefill_then_decode_matches_transformers_attention(q_lora_rank, interleave):
  """A 7-token prefill (expanded) then three single-token steps (absorbed) over the cache
  reproduce transformers' full-sequence attention at every position."""
  cfg = _config(q_lora_rank, interleave)
  attn = _attention(cfg, 5)
  x = np.random.default_rng(6).normal(size=(10, cfg.hidden_size))
  want = _transformers_mla(attn, cfg, x)
  cache = mla_cache(cfg, 1, 16, jnp.float32)
  x32 = jnp.asarray(x, jnp.float32)[None]
  out, cache = _run(attn, x32[:, :7], jnp.arange(7, dtype=jnp.int32)[None], cache, 16,
                    absorbed=False)
  outs = [np.asarray(out)[0]]
  for i in range(7, 10):
    out, cache = _run(attn, x32[:, i:i + 1], jnp.full((1, 1), i, jnp.int32), cache, 16)
    outs.append(np.asarray(out)[0])
  np.testing.assert_allclose(np.concatenate(outs), want, atol=2e-5, rtol=1e-5)


def test_latent_cache_rolls_back_by_length():
  """A verify window of 4 writes rows at L..L+3; if 1 token is kept, the next step at L+1
  overwrites the rest in turn and never reads past its own position: its output equals that
  of a cache which never saw the rejected rows. Commit changes nothing."""
  cfg = _config()
  attn = _attention(cfg, 7)
  rng = np.random.default_rng(8)
  prefix = jnp.asarray(rng.normal(size=(2, 6, cfg.hidden_size)), jnp.float32)
  window = jnp.asarray(rng.normal(size=(2, 4, cfg.hidden_size)), jnp.float32)
  step = jnp.asarray(rng.normal(size=(2, 1, cfg.hidden_size)), jnp.float32)
  positions = lambda start, t: jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32),
                                                (2, t))
  _, cache = _run(attn, prefix, positions(0, 6), mla_cache(cfg, 2, 16, jnp.float32), 16)
  _, verified = _run(attn, window, positions(6, 4), cache, 16)
  assert verified.commit(jnp.array([1, 1])) is verified
  _, kept_only = _run(attn, window[:, :1], positions(6, 1), cache, 16)
  after_rollback, _ = _run(attn, step, positions(7, 1), verified, 16)
  clean, _ = _run(attn, step, positions(7, 1), kept_only, 16)
  np.testing.assert_array_equal(np.asarray(after_rollback), np.asarray(clean))


def test_latent_cache_is_replicated_over_tp_and_split_over_batch():
  mesh = jspec.MeshConfig(dp=2, ep=2, tp=2).make_mesh()
  cache = jax.eval_shape(lambda: mla_cache(_config(), 8, 32, jnp.bfloat16))
  spec = cache.shardings(ShardingRules(), mesh).latent.spec
  assert tuple(spec) == (("dp", "ep"), None, None)


def test_tp_must_divide_the_query_heads():
  cfg = _config(heads=6)
  with pytest.raises(ValueError, match="tp=4 must divide num_attention_heads=6"):
    jspec.LLM.from_random(cfg, dtype="float32", mesh=jspec.MeshConfig(tp=4, num_devices=4))


@pytest.mark.parametrize("params, message", [
    ({"rope_type": "longrope", "rope_theta": 1e4}, r"rope_type='longrope' is not supported; "
     r"jspec supports \['default', 'yarn'\]"),
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_type='dynamic'"),
    ({**YARN, "low_freq_factor": 1.0}, r"keys \['low_freq_factor'\]"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
])
def test_unsupported_rope_is_refused_by_name(params, message):
  with pytest.raises(ValueError, match=message):
    rope_lib.rope_scaling_items(params, 2048)
