"""Prefill chunks' attention through the fused call (`jspec.models.prefill_attention`; XLA's
implementation of it on CPU, cuDNN's on a GPU) against a NumPy reference, and a model's
prefill through it against XLA's attention: the same logits and tokens, on one device and
sharded."""

import functools
import json
import shutil

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import jspec
from flax import nnx
from jspec.config import MLAConfig, ModelConfig
from jspec.models.caches import MLACache
from jspec.models.mla import MLAttention
from drafter_checkpoints import eagle3_head, truncated_draft_model
from helpers import fixture_dir, greedy
from jspec.models import prefill_attention as prefill_lib
from jspec.models.prefill_attention import fits_cudnn, prefill_attention


def _reference(q_BTNH, keys_BKSH, values_BKSV, positions_BT, scale=None):
  """Query t of sequence b, at position p, sees cache slots 0 .. p (float64); values of any
  width V."""
  b, t, n, h = q_BTNH.shape
  group = n // keys_BKSH.shape[1]
  scale = h ** -0.5 if scale is None else scale
  visible_BTS = np.arange(keys_BKSH.shape[2])[None, None, :] <= positions_BT[:, :, None]
  out = np.zeros((b, t, n, values_BKSV.shape[-1]))
  for i, head in np.ndindex(b, n):
    keys = keys_BKSH[i, head // group].astype(np.float64)
    scores_TS = q_BTNH[i, :, head].astype(np.float64) @ keys.T * scale
    scores_TS = np.where(visible_BTS[i], scores_TS, -np.inf)
    p_TS = np.exp(scores_TS - scores_TS.max(axis=1, keepdims=True))
    out[i, :, head] = p_TS @ values_BKSV[i, head // group] / p_TS.sum(axis=1, keepdims=True)
  return out


def _chunk_case(rng, b, k, g, t, s, h, start=None, dtype=np.float32, v=None):
  """A chunk of t queries per sequence starting anywhere in a cache of s slots (at `start`
  [B] where given), whose slots past the chunk hold garbage (stale drafts, padding) that must
  not be read; the values rounded to `dtype` (float32 or bfloat16), returned in float32;
  values of width v (default h), keys and values [B, K, S, *]."""
  rounded = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))
  q = rounded(rng.standard_normal((b, t, k * g, h)))
  keys = rounded(rng.standard_normal((b, k, s, h)))
  values = rounded(rng.standard_normal((b, k, s, v or h)))
  if start is None:
    start = rng.integers(0, s - t + 1, b)  # 0: a prompt's first chunk
  positions = (start[:, None] + np.arange(t)).astype(np.int32)
  past = np.arange(s)[None, None, :, None] >= (start + t)[:, None, None, None]
  garbage_keys, garbage_values = np.where(past, 1e3, keys), np.where(past, -1e3, values)
  return q, keys, values, garbage_keys, garbage_values, positions


def _in_layout(keys_BKSH, kv_layout):
  return keys_BKSH if kv_layout == "BKSH" else np.swapaxes(keys_BKSH, 1, 2)


@pytest.mark.parametrize("kv_layout", ["BKSH", "BSKH"])
@pytest.mark.parametrize("seed", range(8))
def test_a_chunk_attends_to_every_slot_up_to_its_position(seed, kv_layout):
  """GQA caches as they are [B, K, S, H], and MLA's per-head keys [B, S, N, H] with values
  narrower than the queries and its own softmax scale."""
  rng = np.random.default_rng(seed)
  b, k, g = rng.integers(1, 4), rng.choice([1, 2]), rng.choice([1, 2, 4])
  t, s, h = rng.choice([16, 32, 64]), rng.choice([64, 96, 256]), rng.choice([16, 32])
  v, scale = (h, None) if kv_layout == "BKSH" else (rng.choice([8, h]), rng.uniform(0.1, 0.3))
  q, keys, values, garbage_keys, garbage_values, positions = _chunk_case(rng, b, k, g, t, s, h,
                                                                         v=v)
  want = _reference(q, keys, values, positions, scale)
  got = prefill_attention(
      jnp.asarray(q), *(jnp.asarray(_in_layout(a, kv_layout)) for a in (garbage_keys,
                                                                         garbage_values)),
      jnp.asarray(positions), implementation="xla", kv_layout=kv_layout, scale=scale)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_unknown_layout_and_implementation_are_refused_by_name():
  rng = np.random.default_rng(0)
  q, keys, values, _, _, positions = (jnp.asarray(a) for a in _chunk_case(rng, 1, 1, 1, 4, 8, 8))
  with pytest.raises(ValueError, match="kv_layout must be one of"):
    prefill_attention(q, keys, values, positions, implementation="xla", kv_layout="BHSK")
  with pytest.raises(ValueError, match="implementation must be 'cudnn' or 'xla'"):
    prefill_attention(q, keys, values, positions, implementation="triton")


def test_float32_asked_of_cudnn_runs_through_xla():
  """cuDNN takes 16-bit inputs only: a float32 model keeps exact attention, on any device."""
  rng = np.random.default_rng(0)
  q, keys, values, _, _, positions = _chunk_case(rng, 1, 2, 2, 16, 64, 16)
  got = prefill_attention(*(jnp.asarray(a) for a in (q, keys, values, positions)),
                          implementation="cudnn")
  np.testing.assert_allclose(np.asarray(got), _reference(q, keys, values, positions),
                             rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("head_dim, hopper, fits", [
    (128, True, True), (256, True, True), (256, False, False), (128, False, True),
    (192, True, True), (100, True, False), (512, True, False)])
def test_cudnn_takes_heads_of_a_multiple_of_8_up_to_its_limit(head_dim, hopper, fits):
  assert fits_cudnn(head_dim, hopper) == fits


@pytest.mark.parametrize("head_dim, value_dim, hopper, version, fits", [
    (192, 128, True, 91000, True), (192, 128, False, 91000, False), (24, 16, True, 91000, True),
    (192, 100, True, 91000, False), (128, 128, False, 90100, True),
    (192, 128, True, 90800, False), (128, 192, True, 91000, False)])
def test_cudnn_takes_narrower_values_on_hopper_from_9_10_only(head_dim, value_dim, hopper,
                                                              version, fits):
  assert fits_cudnn(head_dim, hopper, value_dim, version) == fits


@pytest.fixture
def fused_calls(monkeypatch):
  """Every call of the fused prefill attention from here on (at tracing), as (query rows,
  keyword arguments): proof that a model's chunks went through it."""
  calls = []
  fused = prefill_lib.prefill_attention

  def counted(q_BTNH, *args, **kwargs):
    calls.append((q_BTNH.shape[1], kwargs))
    return fused(q_BTNH, *args, **kwargs)

  monkeypatch.setattr(prefill_lib, "prefill_attention", counted)
  return calls


PROMPTS = [list(range(3, 150)), [5, 6, 7] * 30, list(range(200, 270)), [9, 8]]


@pytest.mark.parametrize("mesh, spec", [
    ((1, 1, 1), None),
    # dp = 2, and tp = 4 over 2 KV heads: each shard holds a copy of its KV head.
    ((2, 4, 1), {"method": "mtp", "num_speculative_tokens": 2}),
])
def test_prefill_chunks_through_the_fused_call_match_xla_attention(mesh, spec, fused_calls):
  """Prompts of 2-147 tokens in chunks of 128 (128-256 query rows per KV head: wider than
  the decode kernel takes), so that a prompt's second chunk starts mid-cache; the logits of
  every position, and the greedy tokens and steps, equal XLA's attention's."""
  dp, tp, ep = mesh
  logits, tokens = [], []
  for backend in ("xla", "pallas"):
    llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=256,
                    mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep, num_devices=dp * tp * ep),
                    speculative_config=spec, attention_backend=backend, prefill_chunk_size=128)
    logits.append(llm.compute_logits(PROMPTS))
    tokens.append([(o.token_ids, o.metrics.num_steps)
                   for o in llm.generate(PROMPTS, greedy(8, ignore_eos=True))])
  assert 128 in [rows for rows, _ in fused_calls], "no prefill chunk went through the fused call"
  for want, got in zip(*logits):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert tokens[0] == tokens[1]


MLA_PROMPTS = [list(range(3, 150)), [5, 6, 7] * 30, list(range(10, 80)), [9, 8]]


@pytest.mark.parametrize("mesh", [(1, 1, 1), (2, 2, 1)])
def test_mla_prefill_chunks_through_the_fused_call_match_xla_attention(mesh, fused_calls,
                                                                      tmp_path):
  """DeepSeek-V3's expanded prefill form (chunks of 128 rows: more than the absorbed form
  takes; a prompt's second chunk starts mid-cache) through the fused call with its per-head
  keys, the shared roped key repeated over the heads: the logits of every position, and the
  greedy tokens and steps with MTP, equal XLA's attention's, on one device and on dp = 2 x
  tp = 2 (two heads a shard). The fixture is given 256 positions (its yarn rope extends any
  length) for prompts of two chunks."""
  model = tmp_path / "deepseek_v3"
  shutil.copytree(fixture_dir("deepseek_v3"), model)
  config = json.loads((model / "config.json").read_text())
  (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
  dp, tp, ep = mesh
  logits, tokens = [], []
  for backend in ("xla", "pallas"):
    llm = jspec.LLM(model=str(model), dtype="float32", max_model_len=256,
                    mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep, num_devices=dp * tp * ep),
                    speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                    attention_backend=backend, prefill_chunk_size=128)
    logits.append(llm.compute_logits(MLA_PROMPTS))
    tokens.append([(o.token_ids, o.metrics.num_steps)
                   for o in llm.generate(MLA_PROMPTS, greedy(6, ignore_eos=True))])
  assert (128, "BSKH") in [(rows, kw["kv_layout"]) for rows, kw in fused_calls], \
      "no MLA prefill chunk went through the fused call"
  for want, got in zip(*logits):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert tokens[0] == tokens[1]


@pytest.mark.gpu
@pytest.mark.parametrize("t, s, kv_layout, heads, kv_heads, h, v", [
    # Qwen3-8B's heads (32 over 8 KV heads of 128) in the cache's own order.
    (256, 4096, "BKSH", 32, 8, 128, 128), (512, 4224, "BKSH", 32, 8, 128, 128),
    (128, 640, "BKSH", 32, 8, 128, 128),
    # DeepSeek-V3's expanded MLA heads at tp = 8 (16 of 192, values of 128).
    (256, 4096, "BSKH", 16, 16, 192, 128), (128, 640, "BSKH", 16, 16, 192, 128)])
def test_cudnn_on_gpu_matches_the_reference(t, s, kv_layout, heads, kv_heads, h, v):
  """cuDNN's kernel on bf16 inputs, chunks starting at 0, mid-cache and at the cache's end."""
  assert jax.devices()[0].platform == "gpu"
  rng = np.random.default_rng(t + h)
  start = np.array([0, rng.integers(1, s - t), s - t])
  scale = None if v == h else 0.1
  q, keys, values, garbage_keys, garbage_values, positions = _chunk_case(
      rng, 3, kv_heads, heads // kv_heads, t, s, h, start, jnp.bfloat16, v)
  want = _reference(q, keys, values, positions, scale)
  got = jax.jit(prefill_attention, static_argnames=("implementation", "kv_layout", "scale"))(
      jnp.asarray(q, jnp.bfloat16),
      *(jnp.asarray(_in_layout(a, kv_layout), jnp.bfloat16) for a in (garbage_keys,
                                                                      garbage_values)),
      jnp.asarray(positions), implementation="cudnn", kv_layout=kv_layout, scale=scale)
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=0.03, atol=0.03)


@pytest.mark.parametrize("drafter", ["draft_model", "eagle3"])
def test_separate_drafters_prefill_through_the_fused_call(drafter, tmp_path, fused_calls):
  """A draft model (the target's first layer) and an EAGLE-3 head prefill the prompt in the
  target's chunks (of 64: 128 query rows per KV head): every attention layer of theirs is
  given the fused call and makes calls of its own (more than the target alone makes), and
  the greedy tokens and steps equal XLA's attention's."""
  llama = fixture_dir("llama3")
  model = (truncated_draft_model(llama, str(tmp_path / "draft"), 1) if drafter == "draft_model"
           else eagle3_head(llama, str(tmp_path / "eagle3"), 96, aux_layer_ids=(0, 1, 1)))
  prompts = [list(range(3, 140)), [5, 6, 7] * 30, [9, 8]]
  spec = {"method": drafter, "model": model, "num_speculative_tokens": 2}
  results, counts = [], {}
  for backend, speculative_config in (("xla", spec), ("pallas", None), ("pallas", spec)):
    fused_calls.clear()
    llm = jspec.LLM(model=llama, dtype="float32", max_model_len=256, prefill_chunk_size=64,
                    speculative_config=speculative_config, attention_backend=backend)
    outs = llm.generate(prompts, greedy(6, ignore_eos=True))
    with_drafter = speculative_config is not None
    counts[backend, with_drafter] = [rows for rows, _ in fused_calls].count(64)
    if with_drafter:
      attentions = [n for _, n in nnx.iter_graph(llm.draft_module) if hasattr(n, "_attend")]
      assert attentions and all((n.prefill_attention is None) == (backend == "xla")
                                for n in attentions)
      results.append([(o.token_ids, o.metrics.num_steps) for o in outs])
  assert counts["xla", True] == 0
  assert counts["pallas", True] > counts["pallas", False] > 0
  assert results[0] == results[1]


@pytest.mark.gpu
def test_gpu_model_prefill_through_cudnn_matches_xla_attention(fused_calls):
  """A bf16 GQA model's prompt chunks through cuDNN (the default "auto" backend on Hopper; a
  prompt's second chunk starts mid-cache): every position's logits within bf16 rounding of
  XLA's attention's (the fixture's heads, 32 wide, fit cuDNN's)."""
  assert jax.devices()[0].platform == "gpu"
  logits = []
  for backend in ("xla", "auto"):
    llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="bfloat16", max_model_len=128,
                    attention_backend=backend, prefill_chunk_size=64)
    logits.append(llm.compute_logits([list(range(3, 120)), [5, 6, 7] * 30]))
  assert "cudnn" in [kw["implementation"] for _, kw in fused_calls], \
      "no prefill chunk went through cuDNN"
  for want, got in zip(*logits):
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_gpu_mla_expanded_form_through_cudnn_matches_xla(seed):
  """A bf16 MLAttention layer (DeepSeek-V3's form at small widths: queries and keys 24 wide,
  values 16) over a cache of random latent rows, a 96-token chunk mid-cache: its expanded form
  through cuDNN within bf16 rounding of the same form's XLA products."""
  assert jax.devices()[0].platform == "gpu"
  cfg = ModelConfig(
      architecture="DeepseekV3ForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=64,
      num_layers=1, num_heads=8, num_kv_heads=8, head_dim=8, rms_norm_eps=1e-6,
      rope_theta=1000.0, tie_word_embeddings=False, max_position_embeddings=2048,
      mla=MLAConfig(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16))
  attn = MLAttention(cfg, jnp.bfloat16, nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(2, 96, cfg.hidden_size)), jnp.bfloat16)
  positions = jnp.asarray(np.array([0, 150])[:, None] + np.arange(96), jnp.int32)
  cache = MLACache(jnp.asarray(rng.normal(size=(2, 256, 40)), jnp.bfloat16))
  run = nnx.jit(lambda a, x, p, c: a(x, p, c, 256, absorbed=False)[0])
  want = np.asarray(run(attn, x, positions, cache).astype(jnp.float32))
  attn.prefill_attention = functools.partial(prefill_attention, implementation="cudnn",
                                             kv_layout="BSKH", scale=attn.scale)
  got = np.asarray(run(attn, x, positions, cache).astype(jnp.float32))
  np.testing.assert_allclose(got, want, rtol=0.03, atol=0.03 * np.abs(want).max())
