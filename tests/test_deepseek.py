"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) and GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`) against
transformers (fixtures from scripts/make_fixtures.py): MLA with and without q_lora_rank, YaRN
with both mscales and interleaved rope, sigmoid group-limited routing, dense-first layers,
NextN heads (two layers in deepseek_v3) whose decoder layers keep latent caches. Speculation
equals vanilla greedy decoding; the 8-device meshes agree; the memory plan counts the latent
cache replicated over tp."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jspec
from helpers import cached_llm, fixture_dir, greedy, reference
from jspec.models.caches import MLACache
from jspec.models.moe_backends import experts_reference

MLA_FIXTURES = ("deepseek_v3", "glm4_moe_lite")
TOL = 1e-4
MAX_TOKENS = 24


def test_configs_follow_the_checkpoints():
  ds = cached_llm("deepseek_v3").config
  assert (ds.architecture, ds.mla.q_lora_rank, ds.mla.kv_lora_rank, ds.rope_interleave) == (
      "DeepseekV3ForCausalLM", 32, 32, True)
  assert dict(ds.rope_scaling) == {
      "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
      "truncate": True}
  assert [layer.is_moe for layer in cached_llm("deepseek_v3").target.layers] == [
      False, True, True]
  lite = cached_llm("glm4_moe_lite")
  assert (lite.config.architecture, lite.config.mla.q_lora_rank) == ("Glm4MoeLiteForCausalLM", 0)
  assert not hasattr(lite.target.layers[0].attn, "q_a_proj")
  # mlp_layer_types ["dense", "sparse", "sparse"], as transformers reads it.
  assert [layer.is_moe for layer in lite.target.layers] == [False, True, True]
  assert cached_llm("deepseek_v3").mtp_spec.num_layers == 2


@pytest.mark.parametrize("name", MLA_FIXTURES)
def test_logits_match_transformers(name):
  """Sequences of 1, 13 and 48 tokens (48 runs past YaRN's 32 original positions)."""
  ref = reference(name)
  seqs = [ref[f"seq_{i}"].tolist() for i in range(3)]
  for i, logits in enumerate(cached_llm(name).compute_logits(seqs)):
    np.testing.assert_allclose(logits, ref[f"logits_{i}"], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", MLA_FIXTURES)
def test_greedy_generate_matches_transformers(name):
  """Prefill in the expanded form, every decode step in the absorbed form."""
  ref = reference(name)
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
  llm = cached_llm(name)
  for i, out in enumerate(llm.generate(prompts, greedy(MAX_TOKENS))):
    assert out.token_ids == ref[f"gen_{i}"].tolist()
    assert out.finish_reason == ("stop" if bool(ref[f"gen_stopped_on_eos_{i}"]) else "length")
  for i, out in enumerate(llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))):
    assert out.token_ids == ref[f"gen_noeos_{i}"].tolist()


@nnx.jit
def _mtp_forward(layer, target, next_tokens, hidden, cache):
  n = next_tokens.shape[1]
  normed, feedback, _ = layer(target, next_tokens, hidden, jnp.arange(n, dtype=jnp.int32)[None],
                              cache, n, experts_reference)
  return layer.logits(target, normed), feedback


@pytest.mark.parametrize("name, layer_index, key", [
    ("deepseek_v3", 0, "mtp"), ("deepseek_v3", 1, "mtp1"), ("glm4_moe_lite", 0, "mtp")])
def test_mtp_layers_match_reference(name, layer_index, key):
  """Each NextN layer: enorm(embed(t+1), zeroed at position 0), hnorm(h), eh_proj, an MLA MoE
  decoder layer over its own latent cache, shared_head; the feedback is the pre-norm y."""
  ref = reference(name)
  llm = cached_llm(name)
  layer = llm.mtp.layers[layer_index]
  for i in (1, 2):
    seq = ref[f"seq_{i}"]
    hidden = jnp.asarray(ref[f"hidden_{i}"][:-1])[None]
    next_tokens = jnp.asarray(seq[1:], jnp.int32)[None]
    n = next_tokens.shape[1]
    cache = llm.mtp.init_caches(1, n, jnp.float32)[layer_index]
    assert isinstance(cache, MLACache)
    logits, feedback = _mtp_forward(layer, llm.target, next_tokens, hidden, cache)
    np.testing.assert_allclose(np.asarray(logits)[0],
                               ref[f"{key}_logits_{i}"], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(feedback)[0], ref[f"{key}_hidden_{i}"], atol=TOL,
                               rtol=0)


# ---- speculation -------------------------------------------------------------------------------

def _prompts(name, seed):
  vocab = cached_llm(name).config.vocab_size
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, vocab, size=n).tolist() for n in (3, 9, 1, 14, 6, 40)]
  prompts[1] = [3, 4, 5] * 3  # repetitive: n-gram finds drafts
  return prompts


def _tokens(llm, prompts, max_tokens=MAX_TOKENS):
  return [o.token_ids for o in llm.generate(prompts, greedy(max_tokens, ignore_eos=True))]


@pytest.mark.parametrize("name, method, k", [
    ("deepseek_v3", "mtp", 1), ("deepseek_v3", "mtp", 3), ("deepseek_v3", "mtp", 5),
    ("glm4_moe_lite", "mtp", 2), ("glm4_moe_lite", "mtp", 4), ("glm4_moe_lite", "ngram", 3)])
def test_greedy_speculative_equals_vanilla(name, method, k):
  """Verify windows of k+1 tokens attend in the absorbed form and roll back by length; with
  two NextN layers, draft steps alternate between them."""
  prompts = _prompts(name, 31)
  want = _tokens(cached_llm(name), prompts)
  outs = cached_llm(name, method, k).generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
  assert [o.token_ids for o in outs] == want
  assert outs.metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("name, mesh, spec, rows", [
    ("deepseek_v3", (2, 2, 2), "mtp", 1), ("glm4_moe_lite", (2, 4, 1), None, 3),
    # Data-parallel attention (all heads on every device) with the experts over ep.
    ("deepseek_v3", (2, 1, 4), "mtp", 2)],
    ids=lambda v: "dp%d-tp%d-ep%d" % v if isinstance(v, tuple) else str(v))
def test_greedy_outputs_identical_on_the_8_device_meshes(name, mesh, spec, rows):
  """transformers' greedy tokens with query heads over tp, the latent cache replicated over tp
  and routed experts over ep; one prompt on dp = 2 leaves a dp shard idle."""
  dp, tp, ep = mesh
  config = None if spec is None else {"method": spec, "num_speculative_tokens": 2}
  llm = jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=128,
                  mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep, num_devices=dp * tp * ep),
                  speculative_config=config)
  ref = reference(name)
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(rows)]
  assert _tokens(llm, prompts) == [ref[f"gen_noeos_{i}"].tolist() for i in range(rows)]
  attn = llm.target.layers[0].attn
  assert "tp" in str(attn.o_proj.get_value().sharding.spec)
  assert "tp" not in str(attn.kv_a_proj.get_value().sharding.spec)


def test_memory_plan_counts_the_latent_cache_replicated_over_tp():
  """Per device: batch / (dp * ep) rows of C + R values per slot and layer, whatever tp is;
  the MTP layers' latent caches likewise."""
  name = "deepseek_v3"
  cfg = cached_llm(name).config
  row = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
  plans = {}
  for tp in (1, 4):
    llm = jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=64, max_num_seqs=4,
                    mesh=jspec.MeshConfig(dp=2, tp=tp, num_devices=2 * tp),
                    speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    plans[tp] = llm.memory_plan
  slots = 128  # 64 + k + 1, rounded up to a multiple of 128
  assert plans[4].target_cache_bytes == plans[1].target_cache_bytes == (
      cfg.num_layers * 2 * slots * row * 4)
  assert plans[4].draft_cache_bytes == 2 * 2 * slots * row * 4  # two NextN layers


@pytest.mark.parametrize("edit, match", [
    ({"rope_scaling": {"type": "longrope", "factor": 4.0, "short_factor": [1.0] * 4,
                       "long_factor": [1.0] * 4, "original_max_position_embeddings": 32}},
     r"rope_type='longrope' is not supported; jspec supports \['default', 'yarn'\]"),
    ({"attention_bias": True}, r"attention_bias=True is not supported for latent attention"),
    ({"scoring_func": "softmax"}, r"scoring_func='softmax' is not supported"),
])
def test_unsupported_config_is_refused(tmp_path, edit, match):
  src = fixture_dir("deepseek_v3")
  for f in os.listdir(src):
    os.symlink(os.path.join(src, f), tmp_path / f)
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  config.update(edit)
  os.remove(tmp_path / "config.json")
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match=match):
    jspec.LLM(model=str(tmp_path), dtype="float32")
