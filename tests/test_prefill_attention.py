"""Prefill chunks' attention through the fused call (`jspec.models.prefill_attention`; XLA's
implementation of it on CPU, cuDNN's on a GPU) against a NumPy reference, and a model's
prefill through it against XLA's attention: the same logits and tokens, on one device and
sharded."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import jspec
from helpers import fixture_dir, greedy
from jspec.models import prefill_attention as prefill_lib
from jspec.models.prefill_attention import fits_cudnn, prefill_attention


def _reference(q_BTNH, keys_BKSH, values_BKSH, positions_BT):
  """Query t of sequence b, at position p, sees cache slots 0 .. p (float64)."""
  b, t, n, h = q_BTNH.shape
  group = n // keys_BKSH.shape[1]
  visible_BTS = np.arange(keys_BKSH.shape[2])[None, None, :] <= positions_BT[:, :, None]
  out = np.zeros((b, t, n, h))
  for i, head in np.ndindex(b, n):
    keys = keys_BKSH[i, head // group].astype(np.float64)
    scores_TS = q_BTNH[i, :, head].astype(np.float64) @ keys.T / np.sqrt(h)
    scores_TS = np.where(visible_BTS[i], scores_TS, -np.inf)
    p_TS = np.exp(scores_TS - scores_TS.max(axis=1, keepdims=True))
    out[i, :, head] = p_TS @ values_BKSH[i, head // group] / p_TS.sum(axis=1, keepdims=True)
  return out


def _chunk_case(rng, b, k, g, t, s, h, start=None, dtype=np.float32):
  """A chunk of t queries per sequence starting anywhere in a cache of s slots (at `start`
  [B] where given), whose slots past the chunk hold garbage (stale drafts, padding) that must
  not be read; the values rounded to `dtype` (float32 or bfloat16), returned in float32."""
  rounded = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))
  q = rounded(rng.standard_normal((b, t, k * g, h)))
  keys = rounded(rng.standard_normal((b, k, s, h)))
  values = rounded(rng.standard_normal((b, k, s, h)))
  if start is None:
    start = rng.integers(0, s - t + 1, b)  # 0: a prompt's first chunk
  positions = (start[:, None] + np.arange(t)).astype(np.int32)
  past = np.arange(s)[None, None, :, None] >= (start + t)[:, None, None, None]
  garbage_keys, garbage_values = np.where(past, 1e3, keys), np.where(past, -1e3, values)
  return q, keys, values, garbage_keys, garbage_values, positions


@pytest.mark.parametrize("seed", range(8))
def test_a_chunk_attends_to_every_slot_up_to_its_position(seed):
  rng = np.random.default_rng(seed)
  b, k, g = rng.integers(1, 4), rng.choice([1, 2]), rng.choice([1, 2, 4])
  t, s, h = rng.choice([16, 32, 64]), rng.choice([64, 96, 256]), rng.choice([16, 32])
  q, keys, values, garbage_keys, garbage_values, positions = _chunk_case(rng, b, k, g, t, s, h)
  want = _reference(q, keys, values, positions)
  got = prefill_attention(*(jnp.asarray(a) for a in (q, garbage_keys, garbage_values,
                                                     positions)), implementation="xla")
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


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


PROMPTS = [list(range(3, 150)), [5, 6, 7] * 30, list(range(200, 270)), [9, 8]]


@pytest.mark.parametrize("mesh, spec", [
    ((1, 1, 1), None),
    # dp = 2, and tp = 4 over 2 KV heads: each shard holds a copy of its KV head.
    ((2, 4, 1), {"method": "mtp", "num_speculative_tokens": 2}),
])
def test_prefill_chunks_through_the_fused_call_match_xla_attention(mesh, spec, monkeypatch):
  """Prompts of 2-147 tokens in chunks of 128 (128-256 query rows per KV head: wider than
  the decode kernel takes), so that a prompt's second chunk starts mid-cache; the logits of
  every position, and the greedy tokens and steps, equal XLA's attention's."""
  rows = []
  fused = prefill_lib.prefill_attention

  def counted(q_BTNH, *args, **kwargs):
    rows.append(q_BTNH.shape[1])
    return fused(q_BTNH, *args, **kwargs)

  monkeypatch.setattr(prefill_lib, "prefill_attention", counted)
  dp, tp, ep = mesh
  logits, tokens = [], []
  for backend in ("xla", "pallas"):
    llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=256,
                    mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep, num_devices=dp * tp * ep),
                    speculative_config=spec, attention_backend=backend, prefill_chunk_size=128)
    logits.append(llm.compute_logits(PROMPTS))
    tokens.append([(o.token_ids, o.metrics.num_steps)
                   for o in llm.generate(PROMPTS, greedy(8, ignore_eos=True))])
  assert 128 in rows, "no prefill chunk went through the fused call"
  for want, got in zip(*logits):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert tokens[0] == tokens[1]


@pytest.mark.gpu
@pytest.mark.parametrize("t, s", [(256, 4096), (512, 4224), (128, 640)])
def test_cudnn_on_gpu_matches_the_reference(t, s):
  """cuDNN's kernel on bf16 inputs, chunks starting at 0, mid-cache and at the cache's end,
  Qwen3-8B's heads (32 over 8 KV heads of 128)."""
  assert jax.devices()[0].platform == "gpu"
  rng = np.random.default_rng(t)
  start = np.array([0, rng.integers(1, s - t), s - t])
  q, keys, values, garbage_keys, garbage_values, positions = _chunk_case(
      rng, 3, 8, 4, t, s, 128, start, jnp.bfloat16)
  want = _reference(q, keys, values, positions)
  got = jax.jit(prefill_attention, static_argnames="implementation")(
      *(jnp.asarray(a, jnp.bfloat16) for a in (q, garbage_keys, garbage_values)),
      jnp.asarray(positions), implementation="cudnn")
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=0.03, atol=0.03)
