"""A batch-1 step's one row taken by o_proj as two equal rows without a copy kernel
(jspec.models.doubled_row): the short-context attention kernel writes its output `copies`
times, the norm kernels after the residual add read the first rows of a longer delta, and the
models' greedy tokens stay those of the row doubled by a concatenate. Interpret mode here; on
GPUs (`gpu` marker) the compiled kernel's copies and the tp = 2 K-slice path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.models import layers
from jspec.models.doubled_row import DoubledRow
from jspec.pallas_kernels import norm_router, platform, row_norms, skinny_gemm
from jspec.pallas_kernels import short_attention as short_lib
from tests.helpers import fixture_dir, greedy_token_ids

RUN_SEED = 20261130

# (batch, tokens, kv heads, group, slots, head_dim, copies)
ATTENTION_CASES = [(1, 1, 4, 2, 64, 32, 2), (1, 1, 2, 4, 128, 64, 3), (3, 2, 2, 2, 64, 32, 2),
                   (2, 1, 1, 8, 32, 16, 2), (1, 3, 4, 1, 48, 32, 2), (4, 1, 2, 2, 64, 16, 1)]


@pytest.mark.parametrize("seed", range(len(ATTENTION_CASES)))
def test_the_attention_kernel_writes_its_output_copies_times(seed):
  """Output rows c x B + b are row b's output, bit for bit, for every copy c."""
  b, t, kv_heads, group, slots, h, copies = ATTENTION_CASES[seed]
  rng = np.random.default_rng(RUN_SEED + seed)
  q = jnp.asarray(rng.standard_normal((b, kv_heads * t * group, h)), jnp.float32)
  keys, values = (jnp.asarray(rng.standard_normal((b, kv_heads, slots, h)), jnp.float32)
                  for _ in range(2))
  start = jnp.asarray(rng.integers(0, slots - t + 1, b), jnp.int32)
  once = short_lib.short_attention(q, keys, values, start, group=group, scale=h ** -0.5,
                                   interpret=True)
  twice = short_lib.short_attention(q, keys, values, start, group=group, scale=h ** -0.5,
                                    copies=copies, interpret=True)
  assert twice.shape == (copies * b, *q.shape[1:])
  for c in range(copies):
    np.testing.assert_array_equal(np.asarray(twice[c * b:(c + 1) * b]), np.asarray(once))
  with pytest.raises(ValueError, match="copies"):
    short_lib.short_attention(q, keys, values, start, group=group, scale=1.0, copies=0,
                              interpret=True)


# (rows, extra rows, width, dtype, zero_centered)
NORM_CASES = [(1, 1, 2048, jnp.bfloat16, False), (1, 1, 512, jnp.float32, True),
              (2, 3, 256, jnp.bfloat16, True), (3, 1, 1024, jnp.float32, False)]


@pytest.mark.parametrize("seed", range(len(NORM_CASES)))
def test_the_norm_kernels_add_the_first_rows_of_a_longer_delta(seed):
  """rms_norm's residual and add_norm_router_partials' delta of R > M rows give the results
  of their first M rows, bit for bit; the rows after them are never read (NaN there)."""
  rows, extra, width, dtype, zero_centered = NORM_CASES[seed]
  rng = np.random.default_rng(RUN_SEED + 10 + seed)
  x = jnp.asarray(rng.standard_normal((rows, width)) * 2, dtype)
  delta = jnp.asarray(rng.standard_normal((rows, width)), dtype)
  longer = jnp.concatenate([delta, jnp.full((extra, width), jnp.nan, dtype)])
  scale = jnp.asarray(1 + rng.standard_normal(width) / 4, dtype)
  form = dict(eps=1e-6, zero_centered=zero_centered, interpret=True)
  for got, want in zip(row_norms.rms_norm(x, scale, longer, **form),
                       row_norms.rms_norm(x, scale, delta, **form)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  router = jnp.asarray(rng.standard_normal((width, 16)) / np.sqrt(width), dtype)
  for got, want in zip(norm_router.add_norm_router_partials(x, longer, scale, router, **form),
                       norm_router.add_norm_router_partials(x, delta, scale, router, **form)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_deltas_with_fewer_rows_or_another_width_are_refused():
  x = jnp.zeros((2, 256), jnp.float32)
  scale = jnp.ones(256, jnp.float32)
  for delta in (jnp.zeros((1, 256), jnp.float32), jnp.zeros((2, 128), jnp.float32),
                jnp.zeros((2, 1, 256), jnp.float32)):
    with pytest.raises(ValueError, match="residual"):
      row_norms.rms_norm(x, scale, delta, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="and delta"):
      norm_router.add_norm_router_partials(x, delta, scale, jnp.zeros((256, 8), jnp.float32),
                                           eps=1e-6, interpret=True)


def test_a_doubled_row_is_its_first_row():
  rows = jnp.arange(8, dtype=jnp.float32).reshape(1, 2, 4)
  doubled = DoubledRow(rows)
  assert doubled.shape == (1, 1, 4) and doubled.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(doubled.array()), np.asarray(rows[:, :1]))
  np.testing.assert_array_equal(np.asarray(doubled + 1.0), np.asarray(rows[:, :1] + 1.0))
  np.testing.assert_array_equal(np.asarray(1.0 + doubled), np.asarray(rows[:, :1] + 1.0))
  for shape in ((2, 2, 4), (1, 3, 4), (1, 2)):
    with pytest.raises(ValueError, match="doubled row"):
      DoubledRow(jnp.zeros(shape))


def _model_tokens(monkeypatch, fixture, doubled: bool, spec=None):
  """Batch-1 greedy tokens with the row kernels, short-context attention (as on Hopper) and
  one-row o_proj products as two-row GEMMs (as for sizes XLA would rewrite); with the row
  written twice by the attention kernel (`doubled`) or concatenated (the path before)."""
  with monkeypatch.context() as patch:
    patch.setattr(skinny_gemm, "takes_two_rows", lambda rows, k, n, dtype: rows == 1)
    if not doubled:
      patch.setattr(layers.Attention, "_doubles_row", lambda self, q: False)
    with monkeypatch.context() as build:
      build.setattr(platform, "on_hopper", lambda: True)
      llm = jspec.LLM(model=fixture_dir(fixture), dtype="float32", max_model_len=64,
                      max_num_seqs=1, norm_backend="pallas", moe_backend="pallas",
                      attention_backend="auto", speculative_config=spec)
    return greedy_token_ids(llm, [[5, 9, 2, 7, 7, 1]], 5)


@pytest.mark.parametrize("fixture, spec", [
    ("qwen3_moe", None), ("qwen3_dense", {"method": "mtp", "num_speculative_tokens": 2}),
    ("qwen3_next", None)])
def test_models_take_the_doubled_row_and_keep_their_tokens(monkeypatch, fixture, spec):
  """Qwen3-MoE (the norm + router kernel reads the two rows), Qwen3 with an MTP head (plain
  norms; the head's draft steps are batch-1 rows too) and Qwen3-Next (gated attention, (1 + w)
  norms): the attention kernel writes each decode step's row twice, the norm after o_proj
  reads a two-row delta, and the tokens are those of the concatenated row."""
  copies, norm_rows = [], []
  kernel, norm, fused = (short_lib.short_attention, row_norms.rms_norm,
                         norm_router.add_norm_route_softmax)
  monkeypatch.setattr(short_lib, "short_attention",
                      lambda *a, **k: (copies.append(k.get("copies", 1)), kernel(*a, **k))[1])
  monkeypatch.setattr(row_norms, "rms_norm", lambda x, s, r=None, **k: (
      norm_rows.append((x.shape[0], None if r is None else r.shape[0])), norm(x, s, r, **k))[1])
  monkeypatch.setattr(norm_router, "add_norm_route_softmax", lambda x, d, *a, **k: (
      norm_rows.append((x.shape[0], d.shape[0])), fused(x, d, *a, **k))[1])
  want = _model_tokens(monkeypatch, fixture, doubled=False, spec=spec)
  assert 2 not in copies and all(r in (None, m) for m, r in norm_rows)
  copies.clear()
  norm_rows.clear()
  assert _model_tokens(monkeypatch, fixture, doubled=True, spec=spec) == want
  assert 2 in copies, "no step's attention wrote its row twice"
  assert (1, 2) in norm_rows, "no norm read a doubled row"


def test_without_the_short_kernel_or_with_a_batch_the_row_is_not_doubled(monkeypatch):
  """A step of two sequences, or attention through XLA, concatenates as before (no copies
  asked): the choice is the layer's, from the step's rows and its kernels."""
  with monkeypatch.context() as patch:
    patch.setattr(skinny_gemm, "takes_two_rows", lambda rows, k, n, dtype: rows == 1)
    llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                    max_num_seqs=2, attention_backend="xla")
  layer = llm.target.layers[0].attn
  one_row = jnp.zeros((1, 1, layer.o_proj.shape[0], layer.o_proj.shape[1]), jnp.float32)
  assert layer.short_attention is None and not layer._doubles_row(one_row)
  layer.short_attention = lambda *a, **k: None  # as "auto" on Hopper sets it
  layer.projection = lambda x, w: x @ w
  with monkeypatch.context() as patch:
    patch.setattr(skinny_gemm, "takes_two_rows", lambda rows, k, n, dtype: rows == 1)
    assert layer._doubles_row(one_row)
    assert not layer._doubles_row(jnp.zeros((2, 1, *one_row.shape[2:]), jnp.float32))
    assert not layer._doubles_row(jnp.zeros((1, 2, *one_row.shape[2:]), jnp.float32))
    patch.setattr(skinny_gemm, "takes_two_rows", lambda rows, k, n, dtype: False)
    assert not layer._doubles_row(one_row)


@pytest.mark.gpu
def test_gpu_the_compiled_kernel_writes_its_copies():
  """Qwen3-30B-A3B's heads (32 query heads over 4 KV heads of 128), bf16, a 640-slot cache:
  both copies of the compiled kernel's output equal its one-copy output."""
  assert jax.devices()[0].platform == "gpu"
  rng = np.random.default_rng(RUN_SEED)
  q = jnp.asarray(rng.standard_normal((1, 32, 128)), jnp.bfloat16)
  keys, values = (jnp.asarray(rng.standard_normal((1, 4, 640, 128)), jnp.bfloat16)
                  for _ in range(2))
  start = jnp.asarray([517], jnp.int32)
  once = short_lib.short_attention(q, keys, values, start, group=8, scale=128 ** -0.5)
  twice = short_lib.short_attention(q, keys, values, start, group=8, scale=128 ** -0.5,
                                    copies=2)
  for c in range(2):
    np.testing.assert_array_equal(np.asarray(twice[c:c + 1], np.float32),
                                  np.asarray(once, np.float32))


@pytest.mark.gpu
def test_gpu_tp2_k_slices_take_the_doubled_row(monkeypatch):
  """tp = 2 on 2 GPUs with the workspace kernel, batch 1: o_proj's K-slice partials take the
  attention kernel's two rows (no concatenate), with the tokens of the concatenated row."""
  if len([d for d in jax.devices() if d.platform == "gpu"]) < 2:
    pytest.skip("needs 2 GPUs")
  copies = []
  kernel = short_lib.short_attention
  monkeypatch.setattr(short_lib, "short_attention",
                      lambda *a, **k: (copies.append(k.get("copies", 1)), kernel(*a, **k))[1])

  def tokens():
    llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="bfloat16", max_model_len=64,
                    max_num_seqs=1, mesh=jspec.MeshConfig(tp=2), all_reduce_backend="kernel")
    return greedy_token_ids(llm, [[5, 9, 2, 7, 7, 1]], 8)

  with monkeypatch.context() as patch:
    patch.setattr(layers.Attention, "_doubles_row", lambda self, q: False)
    want = tokens()
  assert 2 not in copies
  assert tokens() == want
  assert 2 in copies, "no tp step's attention wrote its row twice"
