"""On a GPU: the Gated DeltaNet layer's chunked (prefill) and recurrent (decode / verify)
paths in bfloat16 against the same layer in float32, and the float32 paths against the NumPy
recurrence; a hybrid fixture generates the same greedy tokens with and without MTP."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jspec
from helpers import fixture_dir, greedy
from jspec.bench.presets import PRESETS
from jspec.models import caches as cache_lib
from jspec.models.gated_deltanet import GatedDeltaNet, chunked_delta_rule
from test_gated_deltanet import numpy_delta_rule, random_inputs

pytestmark = pytest.mark.gpu


def _layer(dtype):
  cfg = PRESETS["qwen3.5-9b"]  # real head counts and dims: 16 key heads, 32 value heads, 128
  return GatedDeltaNet(cfg, dtype, nnx.Rngs(0)), cfg


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_chunked_delta_rule_float32_matches_numpy_on_gpu():
  rng = np.random.default_rng(0)
  state, q, k, v, g, beta = random_inputs(rng, 2, 200, 4, 2, 128, 128)
  want_state, want_out = numpy_delta_rule(state, q * 128 ** -0.5, k, v, g, beta)
  with jax.default_matmul_precision("highest"):
    got_state, got_out = jax.jit(chunked_delta_rule)(
        *(jnp.asarray(a) for a in (state, q, k, v, g, beta)))
  assert _rel(got_out, want_out) < 1e-4 and _rel(got_state, want_state) < 1e-4


@pytest.mark.parametrize("prompt_len", [1, 64, 200])
def test_layer_in_bfloat16_tracks_float32(prompt_len):
  """Prefill `prompt_len` tokens (chunked), then 3 verify windows of 4 tokens (recurrent),
  committing 1, 4 and 2 of them: the bf16 layer's outputs stay within 2e-2 (relative) of the
  float32 layer with the same weights."""
  layer32, cfg = _layer(jnp.float32)
  graphdef, state32 = nnx.split(layer32)
  layer16 = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.bfloat16), state32))
  batch = 2
  x = jax.random.normal(jax.random.key(1), (batch, prompt_len + 12, cfg.hidden_size))

  def run(layer, dtype):
    cache = layer.empty_cache(batch, dtype)
    valid = jnp.ones((batch, prompt_len), bool)
    outs = []
    prefill = nnx.jit(lambda m, c, xs: m(xs, c, valid))
    window_step = nnx.jit(lambda m, c, xs: m(xs, c))
    out, cache = prefill(layer, cache, x[:, :prompt_len].astype(dtype))
    outs.append(out)
    start = prompt_len
    for keep in (1, 4, 2):
      out, window = window_step(layer, cache, x[:, start:start + 4].astype(dtype))
      outs.append(out[:, :keep])
      cache = cache_lib.commit((window,), jnp.full((batch,), keep, jnp.int32))[0]
      start += keep
    return jnp.concatenate(outs, axis=1).astype(jnp.float32)

  with jax.default_matmul_precision("highest"):
    want = run(layer32, jnp.float32)
  got = run(layer16, jnp.bfloat16)
  assert np.all(np.isfinite(got))
  assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_fixture_speculates_exactly_on_gpu(name):
  """MTP with replayed commits and n-gram with stored states both give vanilla decoding's
  greedy tokens."""
  prompts = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8] * 12]
  make = lambda spec, mode="store": jspec.LLM(
      model=fixture_dir(name), dtype="float32", max_model_len=128, speculative_config=spec,
      recurrent_commit=mode)
  want = [o.token_ids for o in make(None).generate(prompts, greedy(20, ignore_eos=True))]
  for spec, mode in (({"method": "mtp", "num_speculative_tokens": 3}, "replay"),
                     ({"method": "ngram", "num_speculative_tokens": 4}, "store")):
    got = [o.token_ids for o in make(spec, mode).generate(prompts, greedy(20, ignore_eos=True))]
    assert got == want, (spec, mode)
