"""A decode step's q / k norms, RoPE, KV write and attention in one kernel
(jspec.pallas_kernels.rope_attention): bit for bit the two kernels it replaces
(row_norms.qkv_partials_norm_rope writing the caches, then short_attention), against a float64
NumPy reference of the whole step, and whole models' tokens and logprobs with it on and off.
Interpret mode here; the compiled kernel on a GPU (marked gpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import backends
from jspec.models import fused_attention, row_kernels
from jspec.pallas_kernels import platform
from jspec.pallas_kernels import rope_attention as rope_lib
from jspec.pallas_kernels.rope_attention import rope_attention
from jspec.pallas_kernels.row_norms import qkv_partials_norm_rope
from jspec.pallas_kernels.short_attention import short_attention
from tests.helpers import fixture_dir, greedy_token_ids

RUN_SEED = 20261205
EPS, THETA = 1e-6, 1e6


def _case(rng, b, kv_heads, group, head_dim, slots, splits, dtype, idle: bool):
  q_heads = kv_heads * group
  padded = b + int(rng.integers(0, 3))  # rows past B are never read
  parts = jnp.asarray(rng.standard_normal((splits, (q_heads + 2 * kv_heads) * head_dim,
                                           padded)) * 2, jnp.float32)
  start = rng.integers(0, slots, b)
  start[0] = slots - 1  # the last slot
  if b > 1:
    start[1] = slots + 3 if idle else 0  # past the cache (an idle sequence), or the first
  caches = [jnp.asarray(rng.standard_normal((b, kv_heads, slots, head_dim)), dtype)
            for _ in "kv"]
  return parts, jnp.asarray(start, jnp.int32), caches


def _two_kernels(parts, start, caches, row_scale, scales, *, q_heads, kv_heads, dtype,
                 fused_layout, quantize, splits, block_slots):
  q, keys, values = qkv_partials_norm_rope(
      parts, start, row_scale, *scales, q_heads=q_heads, kv_heads=kv_heads, dtype=dtype,
      eps=EPS, theta=THETA, group=q_heads // kv_heads if fused_layout else None, caches=caches)
  out = short_attention(q, keys, values, start, group=q_heads // kv_heads,
                        scale=q.shape[-1] ** -0.5, splits=splits, block_slots=block_slots,
                        quantize=quantize)
  return out, keys, values


def _draw(seed):
  rng = np.random.default_rng(RUN_SEED + seed)
  b, kv_heads, group = int(rng.integers(1, 5)), int(rng.choice([1, 2, 4])), int(
      rng.choice([1, 2, 4, 8]))
  head_dim = int(rng.choice([32, 64, 128]))
  slots = int(rng.choice([32, 48, 64, 128]))
  settings = dict(
      dtype=[jnp.float32, jnp.bfloat16][seed % 2], fused_layout=bool(seed % 3 == 0),
      quantize=head_dim == 128 and seed % 4 < 2,
      splits=int(rng.integers(2, slots // 16 + 1)) if seed % 3 else 1)
  settings["block_slots"] = 16 if settings["splits"] > 1 else None
  parts, start, caches = _case(rng, b, kv_heads, group, head_dim, slots,
                               int(rng.choice([1, 2, 4, 8])), settings["dtype"],
                               idle=seed % 5 == 0)
  row_scale = (None if seed % 2 else jnp.asarray(2.0 ** rng.integers(-3, 4, b), jnp.float32))
  scales = ((None, None) if seed % 7 == 3 else
            tuple(jnp.asarray(1 + 0.2 * rng.standard_normal(head_dim), settings["dtype"])
                  for _ in "qk"))
  return parts, start, caches, row_scale, scales, kv_heads * group, kv_heads, settings


@pytest.mark.parametrize("seed", range(24))
def test_rope_attention_is_the_two_kernels_bit_for_bit(seed):
  """1-4 sequences (one at the cache's last slot, one at slot 0 or idle past the cache), 1-4
  KV heads of 1-8 query heads, heads 32-128 wide, 1-8 K slices, float32 and bf16, q / k / v
  apart or in the fused layout, norms or none, row scales or none, slots split over programs
  (merged) or not, the output quantized to e4m3 rows or not: the caches written and every
  output equal the q / k kernel's then short_attention's, bit for bit."""
  parts, start, caches, row_scale, scales, q_heads, kv_heads, settings = _draw(seed)
  want = _two_kernels(parts, start, caches, row_scale, scales, q_heads=q_heads,
                      kv_heads=kv_heads, **settings)
  got = rope_attention(parts, start, *caches, row_scale, *scales, q_heads=q_heads,
                       kv_heads=kv_heads, eps=EPS, theta=THETA,
                       scale=caches[0].shape[-1] ** -0.5, **settings)
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves) == (5 if settings["quantize"] else 3)
  for g, w in zip(got_leaves, want_leaves):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                  np.asarray(w.astype(jnp.float32)))


def _numpy_step(parts, start, caches, row_scale, scales, q_heads, kv_heads):
  """float64: the summed products, q and k RMSNormed and rotated (rotate-half RoPE), the cache
  written at start, each query head's softmax attention over slots 0 .. start."""
  parts = np.asarray(parts, np.float64)
  b, h = start.shape[0], caches[0].shape[-1]
  x = parts.sum(axis=0)[:, :b].T.reshape(b, -1, h)
  if row_scale is not None:
    x = x * np.asarray(row_scale, np.float64)[:, None, None]
  q, k, v = x[:, :q_heads], x[:, q_heads:q_heads + kv_heads], x[:, q_heads + kv_heads:]
  half = h // 2
  freq = 1.0 / THETA ** (np.arange(0, h, 2) / h)

  def norm_rope(y, scale):
    if scale is not None:
      y = y / np.sqrt((y * y).mean(-1, keepdims=True) + EPS) * np.asarray(scale, np.float64)
    angle = np.asarray(start, np.float64)[:, None, None] * freq
    a, c = y[..., :half], y[..., half:]
    return np.concatenate([a * np.cos(angle) - c * np.sin(angle),
                           c * np.cos(angle) + a * np.sin(angle)], -1)

  q, k = norm_rope(q, scales[0]), norm_rope(k, scales[1])
  keys, values = (np.asarray(c, np.float64).copy() for c in caches)
  out = np.zeros((b, q_heads, h))
  for i in range(b):
    keys[i, :, start[i]], values[i, :, start[i]] = k[i], v[i]
    for n in range(q_heads):
      kv = n // (q_heads // kv_heads)
      scores = keys[i, kv, :start[i] + 1] @ q[i, n] * h ** -0.5
      probs = np.exp(scores - scores.max())
      out[i, n] = probs / probs.sum() @ values[i, kv, :start[i] + 1]
  return out, keys, values


@pytest.mark.parametrize("seed", [1, 3, 5, 7])
def test_rope_attention_matches_a_float64_reference_in_float32(seed):
  rng = np.random.default_rng(RUN_SEED + 100 + seed)
  b, kv_heads, group, h, slots = 3, 2, int(rng.choice([1, 4])), 64, 48
  parts, start, caches = _case(rng, b, kv_heads, group, h, slots, 4, jnp.float32, idle=False)
  row_scale = jnp.asarray(2.0 ** rng.integers(-2, 3, b), jnp.float32) if seed > 3 else None
  scales = tuple(jnp.asarray(1 + 0.2 * rng.standard_normal(h), jnp.float32) for _ in "qk")
  out, keys, values = rope_attention(parts, start, *caches, row_scale, *scales,
                                     q_heads=kv_heads * group, kv_heads=kv_heads,
                                     dtype=jnp.float32, eps=EPS, theta=THETA, scale=h ** -0.5,
                                     splits=1 + seed % 3, block_slots=16)
  want = _numpy_step(parts, np.asarray(start), caches, row_scale, scales, kv_heads * group,
                     kv_heads)
  for got, ref in zip((out, keys, values), want):
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)


def test_an_idle_sequence_writes_nothing():
  """A start past the cache (an idle sequence's): its caches stay as they were."""
  rng = np.random.default_rng(RUN_SEED + 200)
  parts, _, caches = _case(rng, 2, 2, 2, 32, 32, 2, jnp.float32, idle=False)
  start = jnp.asarray([40, 5], jnp.int32)
  _, keys, values = rope_attention(parts, start, *caches, q_heads=4, kv_heads=2,
                                   dtype=jnp.float32, theta=THETA, scale=1.0)
  for new, old in zip((keys, values), caches):
    np.testing.assert_array_equal(np.asarray(new[0]), np.asarray(old[0]))
    assert not np.array_equal(np.asarray(new[1, :, 5]), np.asarray(old[1, :, 5]))


def test_rope_attention_refuses_what_it_cannot_take():
  parts = jnp.zeros((2, 6 * 32, 2), jnp.float32)
  start = jnp.zeros(2, jnp.int32)
  cache = jnp.zeros((2, 1, 32, 32), jnp.float32)
  kw = dict(q_heads=4, kv_heads=1, dtype=jnp.float32, theta=THETA, scale=1.0)
  rope_attention(parts, start, cache, cache, **kw)  # the shapes it takes
  with pytest.raises(ValueError, match="float32 partials"):
    rope_attention(parts.astype(jnp.bfloat16), start, cache, cache, **kw)
  with pytest.raises(ValueError, match="caches"):  # caches not in the model's dtype
    rope_attention(parts, start, cache.astype(jnp.bfloat16), cache, **kw)
  with pytest.raises(ValueError, match="R >= B"):  # more sequences than partial rows
    rope_attention(parts, jnp.zeros(3, jnp.int32), *(jnp.zeros((3, 1, 32, 32)),) * 2, **kw)
  with pytest.raises(ValueError, match="both norm scales"):
    rope_attention(parts, start, cache, cache, None, jnp.ones(32), None, **kw)
  with pytest.raises(ValueError, match="multiple of 16 slots"):
    rope_attention(parts, start, *(jnp.zeros((2, 1, 40, 32)),) * 2, **kw)
  with pytest.raises(ValueError, match="quantizes 128-wide heads"):
    rope_attention(parts, start, cache, cache, quantize=True, **kw)
  with pytest.raises(ValueError, match="splits"):
    rope_attention(parts, start, cache, cache, splits=3, block_slots=16, **kw)


# ---- whole models ----------------------------------------------------------------------------

PROMPTS = [[5, 9, 2, 7, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 9, 1, 0]]


def _decode_logprobs(llm, prompts):
  params = jspec.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=5)
  return [[(token, sorted((t, e.logprob) for t, e in step.items()))
           for token, step in zip(out.token_ids, out.logprobs)]
          for out in llm.generate(prompts, params, use_tqdm=False)]


def _calls(monkeypatch):
  calls = []
  kernel = rope_lib.rope_attention
  monkeypatch.setattr(rope_lib, "rope_attention",
                      lambda *a, **kw: calls.append(kw["quantize"]) or kernel(*a, **kw))
  return calls


@pytest.mark.usefixtures("fresh_traces")
@pytest.mark.parametrize("model, mesh", [("bf16", None), ("bf16", "dp2"), ("fp8", None)])
def test_models_decode_through_it_as_through_the_two_kernels(monkeypatch, model, mesh):
  """A model as a Hopper GPU runs it (interpreted): the q / k / v K-slice partials (bf16, 4
  slices as on a GPU) or one FP8 call's, the short-context attention. Its decode steps take
  rope_attention (FP8: quantizing o_proj's rows), and every token and the logprobs of the 5
  likeliest at every step equal, bit for bit, those with fused_attention.ROPE_ATTENTION off
  (the two kernels), on one device and at dp = 2."""
  monkeypatch.setattr(row_kernels, "qkv_k_slices", lambda: 4)
  monkeypatch.setattr(row_kernels, "QKV_SLICE_K", 16)
  calls = _calls(monkeypatch)

  def build():
    with monkeypatch.context() as patch:
      patch.setattr(platform, "on_hopper", lambda: True)
      patch.setattr(backends, "FP8_E4M3_ROWS", True)
      kw = dict(dtype="float32", max_model_len=64, max_num_seqs=4, attention_backend="auto",
                norm_backend="pallas", mesh=mesh and jspec.MeshConfig(dp=2))
      if model == "fp8":
        from tests.test_fp8_gpu_configuration import _tiny_fp8_qwen3
        return jspec.LLM.from_random(_tiny_fp8_qwen3(), seed=8, **kw)
      return jspec.LLM(model=fixture_dir("qwen3_dense"), **kw)

  got = _decode_logprobs(build(), PROMPTS)
  assert calls and all(calls) == (model == "fp8")
  calls.clear()
  monkeypatch.setattr(fused_attention, "ROPE_ATTENTION", False)
  assert _decode_logprobs(build(), PROMPTS) == got
  assert not calls


def test_mtp_verify_windows_keep_the_two_kernels_and_its_tokens(monkeypatch):
  """MTP decoding (verify windows of 3 tokens, the head's one-token draft steps through
  rope_attention) gives the plain greedy tokens of the XLA path."""
  monkeypatch.setattr(row_kernels, "qkv_k_slices", lambda: 4)
  monkeypatch.setattr(row_kernels, "QKV_SLICE_K", 16)
  want = greedy_token_ids(jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32",
                                    max_model_len=64, max_num_seqs=4,
                                    attention_backend="xla", norm_backend="xla"), PROMPTS, 6)
  calls = _calls(monkeypatch)
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)
    llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                    max_num_seqs=4, attention_backend="auto", norm_backend="pallas",
                    speculative_config={"method": "mtp", "num_speculative_tokens": 2})
  assert greedy_token_ids(llm, PROMPTS, 6) == want
  assert calls


# ---- the compiled kernel ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("b, kv_heads, group, quantize", [
    (1, 8, 4, True), (8, 8, 4, True), (1, 4, 8, False), (8, 4, 8, True), (3, 8, 4, False)])
def test_gpu_rope_attention_at_model_shapes(b, kv_heads, group, quantize):
  """Qwen3-8B's (8 KV heads of 4) and Qwen3-30B-A3B's (4 of 8) 128-wide bf16 heads over 640
  slots, compiled: the caches within a bf16 ulp of the two kernels' (Triton may order the
  norm's float32 sums otherwise in the two programs: one value in 2 M differed so), the step's
  slot written and no other, and the output within a bf16 ulp of theirs."""
  if not platform.on_gpu():
    pytest.skip("needs a CUDA GPU")
  rng = np.random.default_rng(RUN_SEED + 300 + b)
  parts, start, caches = _case(rng, b, kv_heads, group, 128, 640, 4, jnp.bfloat16, idle=False)
  scales = tuple(jnp.asarray(1 + 0.2 * rng.standard_normal(128), jnp.bfloat16) for _ in "qk")
  settings = dict(dtype=jnp.bfloat16, fused_layout=True, quantize=quantize, splits=None,
                  block_slots=None)
  want = _two_kernels(parts, start, caches, None, scales, q_heads=kv_heads * group,
                      kv_heads=kv_heads, **settings)
  got = rope_attention(parts, start, *caches, None, *scales, q_heads=kv_heads * group,
                       kv_heads=kv_heads, eps=EPS, theta=THETA, scale=128 ** -0.5, **settings)
  for new, old, before in zip(got[1:], want[1:], caches):
    new, old = np.asarray(new, np.float32), np.asarray(old, np.float32)
    np.testing.assert_allclose(new, old, rtol=2 ** -7, atol=1e-6)
    changed = np.any(new != np.asarray(before, np.float32), axis=-1)  # [B, K, S]
    assert changed.sum() <= b * kv_heads and changed[np.arange(b), :, np.asarray(start)].all()
  out, ref = (x[0] if quantize else x for x in (got[0], want[0]))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             rtol=1.6e-2, atol=1e-2)
