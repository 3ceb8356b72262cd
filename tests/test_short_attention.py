"""GQA attention of decode and verify steps over short caches in one kernel
(jspec.pallas_kernels.short_attention): against a float64 NumPy reference of causal softmax
attention over each row's visible slots, and whole models' tokens against XLA's attention.
Interpret mode here; the compiled kernel on a GPU (marked gpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jspec
from jspec.models.layers import Attention
from jspec.pallas_kernels import platform
from jspec.pallas_kernels import short_attention as short_lib
from jspec.pallas_kernels.short_attention import fits_heads, fits_kernel, short_attention
from tests.helpers import fixture_dir, greedy_token_ids

RUN_SEED = 20261127


def _reference(q_BTNH, keys_BKSH, values_BKSH, start_B, scale):
  """float64: row (b, t, n) attends to slots 0 .. start_b + t of its KV head n // G."""
  b, t, n, h = q_BTNH.shape
  group = n // keys_BKSH.shape[1]
  out = np.zeros((b, t, n, h))
  for i, j, head in np.ndindex(b, t, n):
    last = start_B[i] + j
    keys = keys_BKSH[i, head // group, :last + 1].astype(np.float64)
    scores = keys @ q_BTNH[i, j, head].astype(np.float64) * scale
    probs = np.exp(scores - scores.max())
    out[i, j, head] = probs / probs.sum() @ values_BKSH[i, head // group, :last + 1]
  return out


def _by_kv_head(q_BTNH, kv_heads):
  b, t, n, h = q_BTNH.shape
  g = n // kv_heads
  return q_BTNH.reshape(b, t, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, -1, h)


def _case(rng, b, t, kv_heads, group, slots, h):
  q = rng.standard_normal((b, t, kv_heads * group, h)).astype(np.float32)
  keys, values = (rng.standard_normal((b, kv_heads, slots, h)).astype(np.float32)
                  for _ in range(2))
  start = rng.integers(0, slots - t + 1, b)
  return q, keys, values, start


@pytest.mark.parametrize("seed", range(8))
def test_short_attention_matches_the_reference_in_float32(seed):
  """Decode (T = 1) and verify windows (T <= 5), groups of 1-8 heads, starts anywhere in the
  cache (mid-block, at 0, at the last slots)."""
  rng = np.random.default_rng(RUN_SEED + seed)
  b, t = int(rng.integers(1, 4)), int(rng.integers(1, 6))
  kv_heads, group = int(rng.choice([1, 2, 8])), int(rng.choice([1, 4, 8]))
  slots, h = int(rng.choice([16, 48, 80, 128])), int(rng.choice([16, 32, 128]))
  if group * t > 64:
    t = 64 // group
  q, keys, values, start = _case(rng, b, t, kv_heads, group, max(slots, t), h)
  scale = h ** -0.5
  got = short_attention(jnp.asarray(_by_kv_head(q, kv_heads)), jnp.asarray(keys),
                        jnp.asarray(values), jnp.asarray(start), group=group, scale=scale)
  got = np.asarray(got).reshape(b, kv_heads, t, group, h).transpose(0, 2, 1, 3, 4)
  want = _reference(q, keys, values, start, scale)
  np.testing.assert_allclose(got.reshape(want.shape), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("seed", range(6))
def test_token_major_q_and_output_are_the_grouped_rows_regrouped_bit_for_bit(seed):
  """token_major=True takes q [B, T x N, H] as a step has it and writes [B, T x N, H] (the
  layout o_proj reads): bit for bit the grouped call's rows, regrouped, for verify windows of
  2 to 5 tokens, one program per (sequence, KV head) or the slots split over 2 to 4 (the
  merge writing token by token), with 1 or 2 copies."""
  rng = np.random.default_rng(RUN_SEED + 50 + seed)
  b, t = int(rng.integers(1, 4)), int(rng.integers(2, 6))
  kv_heads, group = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 8]))
  slots, h = int(rng.choice([48, 64, 128])), int(rng.choice([16, 32]))
  q, keys, values, start = _case(rng, b, t, kv_heads, group, slots, h)
  splits, copies = [1, int(rng.integers(2, 5))][seed % 2], 1 + seed // 3
  kw = dict(group=group, splits=splits, block_slots=16, copies=copies)
  args = (jnp.asarray(keys), jnp.asarray(values), jnp.asarray(start))
  want = _attend(q, keys, values, start, **kw)  # [copies x B, T, N, H]
  got = short_attention(jnp.asarray(q.reshape(b, -1, h)), *args, scale=h ** -0.5,
                        token_major=True, **kw)
  assert got.shape == (copies * b, t * kv_heads * group, h)
  np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)


def test_a_sequence_that_sees_no_slot_gives_zeros_and_reads_nothing_outside():
  """An idle sequence's position may be anything: before the cache (no slot seen) gives
  zeros, past its end reads the whole cache and no more."""
  rng = np.random.default_rng(RUN_SEED)
  q, keys, values, _ = _case(rng, 2, 1, 2, 4, 32, 16)
  start = np.array([-5, 1000])
  got = np.asarray(short_attention(jnp.asarray(_by_kv_head(q, 2)), jnp.asarray(keys),
                                   jnp.asarray(values), jnp.asarray(start), group=4,
                                   scale=0.25))
  np.testing.assert_array_equal(got[0], 0.0)
  whole = _reference(q[1:], keys[1:], values[1:], np.array([31]), 0.25)
  np.testing.assert_allclose(got[1].reshape(2, 4, 16), whole[0, 0].reshape(2, 4, 16),
                             rtol=2e-5, atol=2e-5)


def _attend(q, keys, values, start, group, **kw):
  b, t, n, h = q.shape
  kv_heads = keys.shape[1]
  got = short_attention(jnp.asarray(_by_kv_head(q, kv_heads)), jnp.asarray(keys),
                        jnp.asarray(values), jnp.asarray(start), group=group,
                        scale=h ** -0.5, **kw)
  return np.asarray(got).reshape(-1, kv_heads, t, group, h).transpose(0, 2, 1, 3, 4).reshape(
      -1, t, n, h)


@pytest.mark.parametrize("seed", range(8))
def test_slots_split_over_programs_match_the_reference_in_float32(seed):
  """Each (sequence, KV head)'s slots split over 2 to all of the cache's blocks, the splits'
  partial outputs merged by their log-sum-exps: the same attention, for decode and verify
  windows, starts anywhere (splits past a sequence's last block, or past a row's last slot,
  see nothing)."""
  rng = np.random.default_rng(RUN_SEED + 100 + seed)
  b, t = int(rng.integers(1, 4)), int(rng.integers(1, 6))
  kv_heads, group = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 4]))
  block = int(rng.choice([16, 32]))
  slots = block * int(rng.integers(2, 7))
  splits = int(rng.integers(2, slots // block + 1))
  q, keys, values, start = _case(rng, b, t, kv_heads, group, slots, 32)
  got = _attend(q, keys, values, start, group, splits=splits, block_slots=block)
  want = _reference(q, keys, values, start, 32 ** -0.5)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_a_split_past_a_rows_last_slot_adds_nothing_to_that_row():
  """A verify window's first row sees slots 0..47; the last of 4 splits of 16-slot blocks
  holds slots 48..63, which only the later rows see: the first row's output is its own."""
  rng = np.random.default_rng(RUN_SEED + 7)
  q, keys, values, _ = _case(rng, 1, 4, 2, 2, 64, 32)
  start = np.array([47])
  got = _attend(q, keys, values, start, 2, splits=4, block_slots=16)
  np.testing.assert_allclose(got, _reference(q, keys, values, start, 32 ** -0.5),
                             rtol=2e-5, atol=2e-5)


def test_split_slots_of_an_idle_sequence_and_copies():
  """Split, a sequence before the cache gives zeros and one past its end the whole cache;
  `copies` writes the merged output that many times."""
  rng = np.random.default_rng(RUN_SEED + 8)
  q, keys, values, _ = _case(rng, 2, 1, 2, 4, 64, 16)
  start = np.array([-5, 1000])
  got = _attend(q, keys, values, start, 4, splits=3, block_slots=16, copies=2)
  assert got.shape == (4, 1, 8, 16)
  np.testing.assert_array_equal(got[:2], got[2:])
  np.testing.assert_array_equal(got[0], 0.0)
  whole = _reference(q[1:], keys[1:], values[1:], np.array([63]), 0.25)
  np.testing.assert_allclose(got[1], whole[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("batch, kv_heads, slots, chosen", [
    (1, 8, 640, (10, 64)),    # Qwen3-8B at batch 1: one split per 64-slot block
    (1, 4, 1024, (16, 64)),   # a tp = 2 shard at batch 1: at most MAX_SPLITS
    (8, 4, 640, (8, 64)),     # a tp = 2 shard at batch 8: 32 pairs x 8 = 2 programs an SM
    (33, 1, 640, (8, 64)),    # pairs a quarter of the SMs
    (34, 1, 640, (1, None)),  # past a quarter: not split
    (8, 8, 640, (1, None)),   # one GPU at batch 8: 64 pairs, measured no faster split
    (1, 8, 384, (1, None)),   # a window under SPLIT_MIN_SLOTS
])
def test_splits_bring_the_programs_to_twice_the_sms(batch, kv_heads, slots, chosen):
  assert short_lib.choose_splits(batch, kv_heads, slots, 132) == chosen


def test_splits_off(monkeypatch):
  monkeypatch.setattr(short_lib, "SPLITS", False)
  assert short_lib.choose_splits(1, 8, 640, 132) == (1, None)


def test_split_max_pairs_moves_the_bound_on_pairs(monkeypatch):
  """SPLIT_MAX_PAIRS replaces the quarter of the SMs: 64 pairs split, 2 programs an SM at most
  (4 splits), MAX_SPLITS below that; one past the bound, not split; nor pairs so many that
  fewer than 2 splits would bring the programs to twice the SMs."""
  monkeypatch.setattr(short_lib, "SPLIT_MAX_PAIRS", 64)
  assert short_lib.choose_splits(8, 8, 640, 132) == (4, 64)
  assert short_lib.choose_splits(65, 1, 640, 132) == (1, None)
  monkeypatch.setattr(short_lib, "SPLIT_MAX_PAIRS", 300)
  assert short_lib.choose_splits(300, 1, 640, 132) == (1, None)  # 2 x 132 // 300 = 0
  monkeypatch.setattr(short_lib, "SPLIT_MAX_PAIRS", 64)
  monkeypatch.setattr(short_lib, "MAX_SPLITS", 2)
  assert short_lib.choose_splits(8, 8, 640, 132) == (2, 64)


def test_the_chosen_split_keeps_the_blocks_in_the_shared_memory(monkeypatch):
  """256-wide float32 heads fit 32-slot blocks only: the split of a 384-slot window (6, one
  per 64 slots) takes those, and gives the reference's output."""
  monkeypatch.setattr(short_lib, "SPLIT_MIN_SLOTS", 128)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  seen = []
  call = short_lib.pl.pallas_call

  def spy(kernel, **kw):
    seen.append(kernel.keywords)
    return call(kernel, **kw)
  monkeypatch.setattr(short_lib.pl, "pallas_call", spy)
  rng = np.random.default_rng(RUN_SEED + 9)
  q, keys, values, start = _case(rng, 1, 1, 1, 2, 384, 256)
  got = _attend(q, keys, values, start, 2, interpret=True)
  assert seen[0]["block_slots"] == 32 and seen[0]["splits"] == 6
  np.testing.assert_allclose(got, _reference(q, keys, values, start, 256 ** -0.5),
                             rtol=2e-5, atol=2e-5)


def test_short_attention_refuses_what_it_cannot_take():
  assert fits_heads(128) and not fits_heads(96) and not fits_heads(8)
  assert fits_kernel(640, 128, 64) and not fits_kernel(648, 128, 4)
  assert not fits_kernel(640, 128, 65)
  with pytest.raises(ValueError, match="short_attention takes caches"):
    short_attention(jnp.zeros((1, 8, 96)), jnp.zeros((1, 2, 32, 96)), jnp.zeros((1, 2, 32, 96)),
                    jnp.zeros(1, jnp.int32), group=4, scale=1.0)
  with pytest.raises(ValueError, match="splits must be 1 to the cache's 2 blocks"):
    short_attention(jnp.zeros((1, 4, 32)), jnp.zeros((1, 1, 32, 32)), jnp.zeros((1, 1, 32, 32)),
                    jnp.zeros(1, jnp.int32), group=4, scale=1.0, splits=3, block_slots=16)
  with pytest.raises(ValueError, match="block_slots 24"):
    short_attention(jnp.zeros((1, 4, 32)), jnp.zeros((1, 1, 48, 32)), jnp.zeros((1, 1, 48, 32)),
                    jnp.zeros(1, jnp.int32), group=4, scale=1.0, block_slots=24)
  with pytest.raises(ValueError, match="short_attention takes q"):
    short_attention(jnp.zeros((1, 6, 32)), jnp.zeros((1, 4, 32, 32)), jnp.zeros((1, 4, 32, 32)),
                    jnp.zeros(1, jnp.int32), group=4, scale=1.0)


# ---- whole models ----------------------------------------------------------------------------

PROMPTS = [[5, 9, 2, 7, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 9, 1, 0]]


@pytest.mark.parametrize("mesh, spec", [
    (None, None),
    (None, {"method": "mtp", "num_speculative_tokens": 3}),
    # dp = 2 splits the sequences, tp = 4 the query heads (2 KV heads: copies per shard).
    (jspec.MeshConfig(dp=2, tp=4), {"method": "mtp", "num_speculative_tokens": 2}),
])
def test_greedy_tokens_through_the_kernel_equal_xla_attention(monkeypatch, mesh, spec):
  """attention_backend="auto" as on a Hopper GPU (the kernel interpreted here) puts every
  attention layer of the target and the MTP head on the kernel, whose decode and verify steps
  (windows of 3-4 tokens) give XLA's attention's tokens."""
  kwargs = dict(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=128,
                max_num_seqs=4, speculative_config=spec, projection_backend="xla")
  want = greedy_token_ids(jspec.LLM(attention_backend="xla", **kwargs), PROMPTS, 6)
  calls = []
  kernel = short_lib.short_attention

  def counted(q_BRH, *args, **kw):
    calls.append(q_BRH.shape)
    return kernel(q_BRH, *args, **kw)

  monkeypatch.setattr(short_lib, "short_attention", counted)
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)
    llm = jspec.LLM(mesh=mesh, attention_backend="auto", **kwargs)
  layers = [n for module in (llm.target, llm.mtp) if module is not None
            for _, n in nnx.iter_graph(module) if isinstance(n, Attention)]
  assert layers and all(n.short_attention is not None for n in layers)
  assert greedy_token_ids(llm, PROMPTS, 6) == want
  assert calls, "no step went through the kernel"


def test_windows_longer_than_the_limit_keep_xla_attention(monkeypatch):
  """A step attending more than MAX_SLOTS slots (here lowered to 8, under the smallest cache
  bucket of 16) takes XLA's attention: the kernel is never called."""
  calls = []
  kernel = short_lib.short_attention
  monkeypatch.setattr(short_lib, "short_attention",
                      lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
  monkeypatch.setattr(short_lib, "MAX_SLOTS", 8)
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)
    llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=128,
                    max_num_seqs=4, projection_backend="xla", attention_backend="auto")
  greedy_token_ids(llm, [list(range(3, 40))], 3)
  assert calls == []


@pytest.mark.parametrize("slots, head_dim, itemsize, block", [
    (640, 128, 2, 128),   # Qwen3-8B's bf16 heads: the measured tiling
    (640, 256, 2, 64),    # Qwen3.5 / Qwen3-Next's 256-wide bf16 heads
    (640, 128, 4, 64),    # float32 caches
    (640, 256, 4, 32),
    (48, 128, 2, 16),     # a cache of 48 slots: the largest dividing block
    (1024, 1024, 4, 16),  # nothing fits: 16 slots, the smallest Triton block
])
def test_blocks_in_flight_fit_the_shared_memory(slots, head_dim, itemsize, block):
  assert short_lib.choose_block_slots(slots, head_dim, itemsize) == block
  staged = 2 * (short_lib.NUM_STAGES - 1) * block * head_dim * itemsize
  assert staged <= short_lib.STAGED_BYTES or block == short_lib.MIN_ROWS


@pytest.mark.gpu
@pytest.mark.parametrize("b, t, kv_heads, group, h, dtype", [
    (1, 1, 8, 4, 128, jnp.bfloat16), (8, 1, 8, 4, 128, jnp.bfloat16),
    (3, 4, 8, 4, 128, jnp.bfloat16), (32, 1, 8, 4, 128, jnp.bfloat16),
    (2, 3, 4, 4, 256, jnp.bfloat16),   # Qwen3.5-9B's gated attention: 16 heads of 256 over 4
    (2, 3, 2, 2, 128, jnp.float32),    # float32 caches
])
def test_gpu_short_attention_at_model_shapes(b, t, kv_heads, group, h, dtype):
  """Qwen3-8B's heads (32 query heads over 8 KV heads of 128) and Qwen3.5's (256 wide) over a
  640-slot cache, compiled, against float64 NumPy on the same values."""
  assert jax.devices()[0].platform == "gpu"
  rng = np.random.default_rng(RUN_SEED + b + t)
  q, keys, values, start = _case(rng, b, t, kv_heads, group, 640, h)
  q, keys, values = (np.asarray(jnp.asarray(a, dtype), np.float32) for a in (q, keys, values))
  got = short_attention(*(jnp.asarray(a, dtype) for a in (_by_kv_head(q, kv_heads), keys,
                                                          values)),
                        jnp.asarray(start), group=group, scale=h ** -0.5)
  got = np.asarray(got, np.float32).reshape(b, kv_heads, t, group, h).transpose(0, 2, 1, 3, 4)
  want = _reference(q, keys, values, start, h ** -0.5)
  np.testing.assert_allclose(got.reshape(want.shape), want, rtol=0.02, atol=0.02)
  # token by token (as the models call it): the same rows, bit for bit
  token_major = short_attention(*(jnp.asarray(a, dtype) for a in (q.reshape(b, -1, h), keys,
                                                                  values)),
                                jnp.asarray(start), group=group, scale=h ** -0.5,
                                token_major=True)
  np.testing.assert_array_equal(np.asarray(token_major, np.float32).reshape(want.shape),
                                got.reshape(want.shape))
