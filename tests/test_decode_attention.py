"""Split-S decode/verify attention (the Pallas kernel, interpreted on CPU) against a NumPy
reference, and `LLM(attention_backend="pallas")` against XLA's attention: the same greedy
tokens and steps, on one device and sharded."""

import numpy as np
import pytest

import jax.numpy as jnp
import jspec
from helpers import fixture_dir, greedy
from jspec.models.decode_attention import split_plan, window_attention

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8], [100, 3, 44, 9]]


def _reference(q_BTNH, keys_BKSH, values_BKSH, start_B):
  """Token t of sequence b sees cache slots 0 .. start_b + t (its window already written)."""
  b, t, n, h = q_BTNH.shape
  group = n // keys_BKSH.shape[1]
  out = np.zeros((b, t, n, h))
  for i, j, head in np.ndindex(b, t, n):
    visible = start_B[i] + j + 1
    keys = keys_BKSH[i, head // group, :visible].astype(np.float64)
    scores = keys @ q_BTNH[i, j, head] / np.sqrt(h)
    p = np.exp(scores - scores.max())
    out[i, j, head] = p @ values_BKSH[i, head // group, :visible] / p.sum()
  return out


@pytest.mark.parametrize("seed", range(8))
def test_kernel_matches_the_reference_and_reads_only_valid_slots(seed):
  rng = np.random.default_rng(seed)
  b, k, g = rng.integers(1, 4), rng.choice([1, 2]), rng.choice([1, 2, 4])
  t = rng.choice([1, 2, 4])  # decode, and verify windows
  s, h = rng.choice([16, 48, 80, 128, 272, 384]), rng.choice([16, 32])
  q = rng.standard_normal((b, t, k * g, h)).astype(np.float32)
  keys = rng.standard_normal((b, k, s, h)).astype(np.float32)
  values = rng.standard_normal((b, k, s, h)).astype(np.float32)
  start = rng.integers(0, s - t + 1, b)  # 0: a window with no cached prefix
  window = start[:, None] + np.arange(t)  # the step's slots, already written
  new_keys = np.stack([keys[i, :, window[i]] for i in range(b)])  # [B, T, K, H]
  new_values = np.stack([values[i, :, window[i]] for i in range(b)])
  want = _reference(q, keys, values, start)
  # Slots past the window hold garbage (stale drafts, padding): they must be ignored.
  past = np.arange(s)[None, None, :, None] >= (start + t)[:, None, None, None]
  keys, values = np.where(past, 1e3, keys), np.where(past, -1e3, values)
  got = window_attention(*(jnp.asarray(a) for a in (q, new_keys, new_values, keys, values)),
                         jnp.asarray(start), interpret=True)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("slots, plan", [
    (16, (1, 16)), (80, (5, 16)), (128, (1, 128)), (1024, (8, 128)), (8192, (16, 128)),
    (8208, (19, 16)), (8320, (65, 128)),  # capped buckets: 16 or more splits, not 1
    (16768, (131, 128))])  # 131 blocks, a prime: one block per split
def test_split_plan_tiles_the_cache(slots, plan):
  assert split_plan(slots) == plan
  k_splits, block_k = plan
  assert slots % k_splits == 0 and (slots // k_splits) % block_k == 0


def test_split_plan_refuses_an_untileable_cache():
  with pytest.raises(ValueError, match="multiple of 16 slots, got 65"):
    split_plan(65)


@pytest.mark.parametrize("name, mesh, spec", [
    ("qwen3_dense", (1, 1, 1), None),
    ("qwen3_moe", (1, 1, 1), {"method": "mtp", "num_speculative_tokens": 2}),
    ("qwen3_moe", (2, 2, 2), {"method": "mtp", "num_speculative_tokens": 2}),
    ("qwen3_dense", (1, 4, 1), {"method": "ngram", "num_speculative_tokens": 2}),  # KV copies
    ("demo", (1, 1, 1), {"method": "mtp", "num_speculative_tokens": 3}),  # a trained head
])
def test_pallas_attention_gives_the_same_greedy_tokens(name, mesh, spec):
  dp, tp, ep = mesh
  model = jspec.demo_model_path() if name == "demo" else fixture_dir(name)
  outputs = []
  for backend in ("xla", "pallas"):
    llm = jspec.LLM(model=model, dtype="float32", max_model_len=64,
                    mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep, num_devices=dp * tp * ep),
                    speculative_config=spec, attention_backend=backend)
    # Steps per request too: a draft's one-token forwards use the kernel, and a wrong draft
    # would change the steps even though verification keeps the tokens right.
    outputs.append([(o.token_ids, o.metrics.num_steps)
                    for o in llm.generate(PROMPTS, greedy(12, ignore_eos=True))])
  assert outputs[0] == outputs[1]


def test_unknown_attention_backend_is_refused():
  with pytest.raises(ValueError, match=r"attention_backend='flash' is not supported"):
    jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", attention_backend="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("t, s", [(1, 8192), (4, 8192), (1, 8320), (4, 8320)])
def test_compiled_kernel_on_gpu_matches_the_reference(t, s):
  """The same check with Triton compiling the kernel (bf16 cache, as served), at a cache of
  8192 slots split 16 ways and a capped bucket of 8320 split 65 ways."""
  rng = np.random.default_rng(t)
  b, k, g, h = 4, 8, 4, 128
  q = rng.standard_normal((b, t, k * g, h)).astype(np.float32)
  keys = rng.standard_normal((b, k, s, h)).astype(np.float32)
  values = rng.standard_normal((b, k, s, h)).astype(np.float32)
  start = np.array([0, 100, 4000, s - t])
  window = start[:, None] + np.arange(t)
  as_bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  q, keys, values = as_bf16(q), as_bf16(keys), as_bf16(values)
  want = _reference(q, keys, values, start)
  new_keys = np.stack([keys[i, :, window[i]] for i in range(b)])
  new_values = np.stack([values[i, :, window[i]] for i in range(b)])
  got = window_attention(*(jnp.asarray(a, jnp.bfloat16)
                           for a in (q, new_keys, new_values, keys, values)), jnp.asarray(start))
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=0.03, atol=0.03)
