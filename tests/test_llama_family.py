"""Llama-3, Mistral, Mixtral and Qwen2 against transformers (fixtures from scripts/make_fixtures.py,
scripts/fixture_llama.py): logits and greedy tokens per fixture; Llama-3's "llama3" RoPE against
the published formula; tied embeddings with Llama's q/k/v/o biases; Mixtral's top-2 routing
through every MoE backend and on the 8-device meshes; sliding windows accepted only where they
change nothing."""

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import jspec
from helpers import cached_llm, fixture_dir, greedy, reference
from jspec.config import ModelConfig, MoEConfig
from jspec.models import rope as rope_lib
from jspec.models.hf_config import config_from_dir, config_from_hf
from jspec.models.layers import Attention

TOL = 1e-4
MAX_TOKENS = 24
NAMES = ("llama3", "llama3_tied", "mistral", "mixtral", "qwen2")
# Mistral's fixture declares sliding_window 80: a longer max_model_len is refused.
MAX_MODEL_LEN = {"mistral": 80}


def _llm(name):
  return cached_llm(name, max_model_len=MAX_MODEL_LEN.get(name, 128))


# ---- against transformers ----------------------------------------------------------------------

def test_configs_follow_the_checkpoints():
  llama = _llm("llama3").config
  assert llama.architecture == "LlamaForCausalLM" and not llama.use_qk_norm
  assert dict(llama.rope_scaling) == {
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}
  assert (llama.rope_theta, llama.head_dim, llama.tie_word_embeddings) == (500000.0, 32, False)
  assert not (llama.attention_bias or llama.o_proj_bias or llama.sliding_window)
  tied = _llm("llama3_tied").config
  assert tied.tie_word_embeddings and tied.attention_bias and tied.o_proj_bias
  assert tied.vocab_size == 381 and dict(tied.rope_scaling)["factor"] == 32.0
  mistral = _llm("mistral").config
  assert (mistral.sliding_window, mistral.head_dim, mistral.attention_bias) == (80, 32, False)
  mixtral = _llm("mixtral").config
  assert (mixtral.moe.num_experts, mixtral.moe.num_experts_per_tok, mixtral.moe.intermediate_size,
          mixtral.moe.norm_topk_prob, mixtral.moe.router_scoring) == (4, 2, 32, True, "softmax")
  assert mixtral.vocab_size == 255 and mixtral.sliding_window == 0
  assert all(layer.is_moe for layer in _llm("mixtral").target.layers)
  qwen2 = _llm("qwen2").config
  assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.use_qk_norm
  # use_sliding_window false: the config's sliding_window 32 is not applied (the references
  # attend over 64 positions).
  assert qwen2.sliding_window == 0
  assert dict(qwen2.rope_scaling)["rope_type"] == "yarn"


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
  ref = reference(name)
  seqs = [ref[f"seq_{i}"].tolist() for i in range(3)]
  for i, logits in enumerate(_llm(name).compute_logits(seqs)):
    assert logits.shape == ref[f"logits_{i}"].shape
    np.testing.assert_allclose(logits, ref[f"logits_{i}"], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_matches_transformers(name):
  ref = reference(name)
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
  llm = _llm(name)
  for i, out in enumerate(llm.generate(prompts, greedy(MAX_TOKENS))):
    assert out.token_ids == ref[f"gen_{i}"].tolist()
    assert out.finish_reason == ("stop" if bool(ref[f"gen_stopped_on_eos_{i}"]) else "length")
  for i, out in enumerate(llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))):
    assert out.token_ids == ref[f"gen_noeos_{i}"].tolist()


@pytest.mark.parametrize("name", ["llama3", "mixtral"])
def test_ngram_speculation_equals_vanilla_greedy(name):
  """The loop runs these families through the surface alone: n-gram drafts verified by the
  target change no token."""
  ref = reference(name)
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)] + [[7, 8, 9] * 4]
  want = [o.token_ids for o in _llm(name).generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))]
  outs = cached_llm(name, "ngram", 3).generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
  assert [o.token_ids for o in outs] == want
  assert outs.metrics.num_accepted_tokens > 0


def test_tied_embedding_is_the_head():
  """No lm_head parameter: logits come from the embedding table (Llama-3.2-1B ties them)."""
  llm = _llm("llama3_tied")
  paths = {path for path, _ in nnx.to_flat_state(nnx.state(llm.target))}
  assert ("embed",) in paths and ("lm_head",) not in paths
  assert ("layers", 0, "attn", "o_bias") in paths


# ---- Mixtral: MoE backends and meshes ----------------------------------------------------------

def _mixtral_tokens(llm, max_tokens=MAX_TOKENS):
  ref = reference("mixtral")
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
  return [o.token_ids for o in llm.generate(prompts, greedy(max_tokens, ignore_eos=True))]


@pytest.mark.parametrize("backend", ["ragged_dot", "pallas"])
def test_mixtral_through_each_moe_backend(backend):
  """XLA's ragged_dot and the Pallas kernels (interpreted on CPU; experts padded 32 -> 64)."""
  ref = reference("mixtral")
  llm = jspec.LLM(model=fixture_dir("mixtral"), dtype="float32", max_model_len=128,
                  moe_backend=backend)
  logits = llm.compute_logits([ref["seq_1"].tolist()])[0]
  np.testing.assert_allclose(logits, ref["logits_1"], atol=TOL, rtol=0)
  assert _mixtral_tokens(llm) == [ref[f"gen_noeos_{i}"].tolist() for i in range(3)]


@pytest.mark.parametrize("dp, tp, ep", [(2, 1, 2), (1, 2, 1)])
def test_mixtral_greedy_tokens_on_meshes(dp, tp, ep):
  """Experts over ep (2 of the 4 per shard), or each expert's columns, the heads and the odd
  vocabulary (255, padded to 256) over tp."""
  llm = jspec.LLM(model=fixture_dir("mixtral"), dtype="float32", max_model_len=64,
                  mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep))
  ref = reference("mixtral")
  assert _mixtral_tokens(llm, 16) == [ref[f"gen_noeos_{i}"][:16].tolist() for i in range(3)]
  experts = llm.target.layers[0].mlp.w_gate.get_value()
  assert experts.addressable_shards[0].data.shape == (4 // ep, 64, 32 // tp)


def test_mixtral_loads_transformers_module_names(tmp_path):
  """The same weights under transformers' in-memory names (`mlp.gate`, fused
  `mlp.experts.gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F]) load to the same model."""
  src = fixture_dir("mixtral")
  for f in os.listdir(src):
    if f != "model.safetensors":
      shutil.copy(os.path.join(src, f), tmp_path / f)
  tensors = load_file(os.path.join(src, "model.safetensors"))
  for layer in range(2):
    p = f"model.layers.{layer}."
    experts = [[tensors.pop(f"{p}block_sparse_moe.experts.{e}.{w}.weight") for e in range(4)]
               for w in ("w1", "w3", "w2")]
    tensors[f"{p}mlp.experts.gate_up_proj"] = np.stack(
        [np.concatenate([gate, up]) for gate, up in zip(experts[0], experts[1])])
    tensors[f"{p}mlp.experts.down_proj"] = np.stack(experts[2])
    tensors[f"{p}mlp.gate.weight"] = tensors.pop(f"{p}block_sparse_moe.gate.weight")
  save_file(tensors, str(tmp_path / "model.safetensors"))
  ref = reference("mixtral")
  llm = jspec.LLM(model=str(tmp_path), dtype="float32", max_model_len=128)
  np.testing.assert_allclose(llm.compute_logits([ref["seq_2"].tolist()])[0], ref["logits_2"],
                             atol=TOL, rtol=0)


# ---- sliding windows ---------------------------------------------------------------------------

def test_sliding_window_caps_the_default_context():
  """Mistral v0.1 style: inside the window (every reference position < 80) full attention is
  sliding-window attention, so the default max_model_len is the window."""
  llm = jspec.LLM(model=fixture_dir("mistral"), dtype="float32")
  assert llm.max_model_len == 80


def test_max_model_len_past_the_sliding_window_is_refused():
  with pytest.raises(ValueError, match=r"max_model_len=81 exceeds the sliding attention window "
                                       r"of 80 tokens .* lower max_model_len to at most 80"):
    jspec.LLM(model=fixture_dir("mistral"), dtype="float32", max_model_len=81)


@pytest.mark.parametrize("max_window_layers, window", [(1, 32), (2, 0)])
def test_qwen2_window_applies_only_with_use_sliding_window(tmp_path, max_window_layers, window):
  """use_sliding_window true: layers from max_window_layers on slide (transformers
  Qwen2Config.layer_types), so the window counts only if some layer is past it."""
  cfg = config_from_dir(_edited_config(tmp_path, "qwen2", use_sliding_window=True,
                                            max_window_layers=max_window_layers))
  assert cfg.sliding_window == window


def test_mixtral_sliding_window_is_read(tmp_path):
  cfg = config_from_dir(_edited_config(tmp_path, "mixtral", sliding_window=4096))
  assert cfg.sliding_window == 4096


# ---- Llama-3 RoPE ------------------------------------------------------------------------------

def _published_llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original):
  """Meta's `apply_scaling` (llama-models, Llama 3.1), frequency by frequency in float64."""
  low_freq_wavelen = original / low_freq_factor
  high_freq_wavelen = original / high_freq_factor
  out = []
  for freq in inv_freq:
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
      out.append(freq)
    elif wavelen > low_freq_wavelen:
      out.append(freq / factor)
    else:
      smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


@pytest.mark.parametrize("theta, dim, factor, low, high, original", [
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),   # Llama-3.1
    (500000.0, 64, 32.0, 1.0, 4.0, 8192),   # Llama-3.2-1B
    (500000.0, 32, 8.0, 1.0, 4.0, 64),      # the llama3 fixture
    (10000.0, 16, 4.0, 1.0, 4.0, 48),
])
def test_llama3_frequencies_follow_the_published_formula(theta, dim, factor, low, high, original):
  plain = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
  want = _published_llama3(plain, factor, low, high, original)
  scaling = rope_lib.rope_scaling_items(
      {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
       "high_freq_factor": high, "original_max_position_embeddings": original}, 131072,
      rope_types=("default", "llama3"))
  got, attention_factor = rope_lib.inv_frequencies(dim, theta, scaling)
  assert attention_factor == 1.0 and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=2e-6)
  kept, divided = want == plain, np.isclose(want, plain / factor, rtol=1e-12)
  assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three bands


def test_attention_rotates_by_the_llama3_frequencies():
  """A random-weight attention layer's q/k rotation against NumPy rotate-half RoPE with the
  published frequencies, at positions past original_max_position_embeddings."""
  theta, dim, original = 500000.0, 32, 64
  cfg = ModelConfig(
      architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=64,
      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=dim, rms_norm_eps=1e-5,
      rope_theta=theta, tie_word_embeddings=False, max_position_embeddings=512,
      use_qk_norm=False, rope_scaling=rope_lib.rope_scaling_items(
          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": original}, 512, rope_types=("llama3",)))
  attn = Attention(cfg, jnp.float32, nnx.Rngs(0))
  x_BTNH = np.asarray(jax.random.normal(jax.random.key(1), (2, 5, 4, dim)), np.float64)
  positions_BT = np.array([[0, 1, 2, 3, 4], [60, 61, 100, 200, 511]])
  got = np.asarray(attn._rope(jnp.asarray(x_BTNH, jnp.float32), jnp.asarray(positions_BT)))
  freqs = _published_llama3(1.0 / theta ** (np.arange(0, dim, 2) / dim), 8.0, 1.0, 4.0, original)
  angles = positions_BT[..., None, None] * np.concatenate([freqs, freqs])
  half = dim // 2
  rotated = np.concatenate([-x_BTNH[..., half:], x_BTNH[..., :half]], axis=-1)
  np.testing.assert_allclose(got, x_BTNH * np.cos(angles) + rotated * np.sin(angles), atol=2e-4)


# ---- benchmark presets -------------------------------------------------------------------------

_PUBLISHED = {  # the config.json fields of the published checkpoints the presets stand for
    "llama-3.1-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "llama-3.2-1b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "mixtral-8x7b": dict(
        model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=1e6, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=None, router_jitter_noise=0.0),
}


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_presets_are_the_published_configs(name):
  import dataclasses
  from transformers import AutoConfig
  from jspec.bench.presets import PRESETS
  fields = dict(_PUBLISHED[name])
  hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
  assert dataclasses.replace(config_from_hf(hf), eos_token_ids=()) == PRESETS[name]


@pytest.mark.parametrize("changes", [dict(attention_bias=True, o_proj_bias=True),
                                     dict(moe=MoEConfig(num_experts=4, num_experts_per_tok=2,
                                                        intermediate_size=32,
                                                        norm_topk_prob=True))],
                         ids=["llama-biases", "mixtral"])
def test_roofline_counts_every_weight(changes):
  """At a batch that reaches every expert the step reads every parameter but the embedding."""
  import dataclasses
  from jspec.bench.presets import PRESETS
  from jspec.bench.roofline import step_bytes
  from jspec.models.llama import LlamaCausalLM
  cfg = dataclasses.replace(PRESETS["llama-3.2-1b"], vocab_size=512, hidden_size=64,
                            intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=16, tie_word_embeddings=False, **changes)
  target = nnx.eval_shape(lambda: LlamaCausalLM(cfg, jnp.float32, nnx.Rngs(0)))
  params = sum(int(np.prod(v.get_value().shape))
               for _, v in nnx.to_flat_state(nnx.state(target)))
  batch, kv = 1 << 14, cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
  assert step_bytes(cfg, batch, 1, 0, itemsize=4) == 4 * (
      params - cfg.vocab_size * cfg.hidden_size + batch * kv)


# ---- refusals ----------------------------------------------------------------------------------

def _edited_config(tmp_path, name, **changes):
  src = fixture_dir(name)
  for f in os.listdir(src):
    if f != "config.json":
      os.symlink(os.path.join(src, f), tmp_path / f)
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  for key, value in changes.items():
    if value is None:
      config.pop(key, None)
    else:
      config[key] = value
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  return str(tmp_path)


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("changes, match", [
    ({"mlp_bias": True}, r"mlp_bias=True is not supported for LlamaForCausalLM"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; jspec supports \['silu'\]"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0] * 16,
                       "long_factor": [1.0] * 16, "original_max_position_embeddings": 64}},
     r"rope_type='longrope' is not supported; jspec supports \['default', 'llama3', 'yarn'\]"),
    ({"rope_scaling": {**_LLAMA3_SCALING, "mscale": 2.0}},
     r"keys \['mscale'\] that jspec's llama3 RoPE does not read"),
])
def test_unsupported_llama_config_is_refused(tmp_path, changes, match):
  with pytest.raises(ValueError, match=match):
    config_from_dir(_edited_config(tmp_path, "llama3", **changes))
