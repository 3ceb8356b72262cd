"""GLM-4.5 (`Glm4MoeForCausalLM`) against transformers (fixture from scripts/make_fixtures.py):
q/k/v biases, q/k norms, partial rotary, a dense first layer, sigmoid group-limited routing with
a correction bias and shared experts, and the NextN MTP layer in the DeepSeek layout (its
embedding copy loaded once, its own head kept, the position-0 embedding zeroed). Speculation
equals vanilla greedy decoding, sampling stays lossless, the 8-device meshes agree."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import jspec
from jspec.sharding.rules import ShardingRules
from helpers import (assert_mtp_layer_matches_reference, cached_llm, fixture_dir, greedy,
                     reference, two_sample_chi2)
from jspec.models import loading
from jspec.models.moe_backends import experts_reference

NAME = "glm4_moe"
TOL = 1e-4
MAX_TOKENS = 24
PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8], [100, 3, 44, 9, 17, 120, 33]]


def test_config_and_layers_follow_the_checkpoint():
  llm = cached_llm(NAME)
  cfg = llm.config
  assert (cfg.architecture, cfg.moe.router_scoring, cfg.moe.router_correction_bias) == (
      "Glm4MoeForCausalLM", "sigmoid", True)
  moe = cfg.moe
  assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.num_shared_experts) == (
      4, 2, 2.5, 1)
  assert cfg.attention_bias and cfg.use_qk_norm and cfg.rotary_dim == cfg.head_dim // 2
  assert [layer.is_moe for layer in llm.target.layers] == [False, True, True]
  moe = llm.target.layers[1].mlp
  assert moe.correction_bias.get_value().dtype == jnp.float32
  assert np.any(np.asarray(moe.correction_bias.get_value()) != 0)
  spec = llm.mtp_spec
  assert (spec.layout, spec.num_layers, spec.is_moe) == ("deepseek_v3", 1, True)
  # The fixture's MTP embed_tokens is a stored copy of the target's: compared, not loaded.
  # Its shared_head.head differs from lm_head: the head's own.
  assert not spec.has_own_embed and spec.has_own_head
  paths = {path for path, _ in nnx.to_flat_state(nnx.state(llm.mtp))}
  assert ("layers", 0, "head") in paths and ("layers", 0, "embed") not in paths


def test_logits_match_transformers():
  ref = reference(NAME)
  seqs = [ref[f"seq_{i}"].tolist() for i in range(3)]
  for i, logits in enumerate(cached_llm(NAME).compute_logits(seqs)):
    np.testing.assert_allclose(logits, ref[f"logits_{i}"], atol=TOL, rtol=0)


def test_greedy_generate_matches_transformers():
  ref = reference(NAME)
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
  llm = cached_llm(NAME)
  for i, out in enumerate(llm.generate(prompts, greedy(MAX_TOKENS))):
    assert out.token_ids == ref[f"gen_{i}"].tolist()
    assert out.finish_reason == ("stop" if bool(ref[f"gen_stopped_on_eos_{i}"]) else "length")
  for i, out in enumerate(llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))):
    assert out.token_ids == ref[f"gen_noeos_{i}"].tolist()


def test_mtp_head_matches_reference():
  """enorm(embed(t+1), zeroed at position 0) and hnorm(h) through eh_proj, a MoE decoder layer,
  shared_head.norm and the layer's own shared_head.head; the feedback is the pre-norm y."""
  assert_mtp_layer_matches_reference(cached_llm(NAME), reference(NAME), TOL)


def test_group_limit_and_correction_bias_change_the_fixtures_routing():
  """On the fixture's own activations, the experts chosen differ from plain top-k (one group)
  and from the unbiased choice for some tokens: the parity tests above exercise both."""
  from jspec.models.moe import route_sigmoid
  ref = reference(NAME)
  tokens = jnp.asarray(ref["seq_2"], jnp.int32)[None]
  n = tokens.shape[1]

  @nnx.jit
  def moe_inputs(target):
    captured = []

    def experts(x, ids, *rest):
      captured.append(x)
      return experts_reference(x, ids, *rest)

    target(tokens, jnp.arange(n, dtype=jnp.int32)[None], target.init_caches(1, n, jnp.float32),
           n, experts, seq_lens_B=jnp.array([n]))
    return captured

  llm = cached_llm(NAME)
  moe = llm.config.moe
  k, groups, kept = moe.num_experts_per_tok, moe.n_group, moe.topk_group
  moe_layers = [layer.mlp for layer in llm.target.layers if layer.is_moe]
  changed = {"group": 0, "bias": 0}
  for moe, x in zip(moe_layers, moe_inputs(llm.target)):
    logits = x @ moe.router.get_value()
    bias = moe.correction_bias.get_value()
    chosen = lambda g, t, b: np.sort(np.asarray(
        route_sigmoid(logits, b, k, g, t, True, 1.0, jnp.float32)[0]), axis=1)
    used = chosen(groups, kept, bias)
    changed["group"] += int(np.any(used != chosen(1, 1, bias), axis=1).sum())
    changed["bias"] += int(np.any(used != chosen(groups, kept, None), axis=1).sum())
  assert changed["group"] > 0 and changed["bias"] > 0, changed


# ---- speculation -------------------------------------------------------------------------------

def _prompts(lengths, seed):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, 256, size=n).tolist() for n in lengths]
  prompts[1] = [3, 4, 5] * 3  # repetitive: n-gram finds drafts
  return prompts


PROMPT_LENGTHS = (3, 9, 1, 14, 6, 2, 40, 5)
SAMPLES = 1000


def _tokens(llm, prompts, max_tokens=MAX_TOKENS):
  return [o.token_ids for o in llm.generate(prompts, greedy(max_tokens, ignore_eos=True))]


@pytest.mark.parametrize("method, k", [("mtp", 1), ("mtp", 2), ("mtp", 3), ("mtp", 4),
                                       ("mtp", 5), ("ngram", 3)])
def test_greedy_speculative_equals_vanilla(method, k):
  prompts = _prompts(PROMPT_LENGTHS, 21)
  want = _tokens(cached_llm(NAME), prompts)
  outs = cached_llm(NAME, method, k).generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
  assert [o.token_ids for o in outs] == want
  assert outs.metrics.num_accepted_tokens > 0


@pytest.mark.runs_programs_often
def test_speculative_sampling_is_lossless():
  """The first token decided by verification has the same distribution with and without MTP
  speculation (two-sample chi-square over 1000 seeded samples each)."""
  prompt = _prompts(PROMPT_LENGTHS, 22)[3]
  params = [jspec.SamplingParams(temperature=1.0, max_tokens=2, seed=s, ignore_eos=True)
            for s in range(SAMPLES)]
  second = lambda llm: np.array([o.token_ids[1]
                                 for o in llm.generate([prompt] * SAMPLES, params)])
  stat, critical, dof = two_sample_chi2(second(cached_llm(NAME)),
                                        second(cached_llm(NAME, "mtp", 2)))
  assert dof >= 3 and stat < critical, (stat, critical, dof)


@pytest.mark.parametrize("mesh, spec", [((2, 2, 2), "mtp"), ((8, 1, 1), None),
                                        ((1, 4, 2), "mtp")],
                         ids=lambda v: "dp%d-tp%d-ep%d" % v if isinstance(v, tuple) else str(v))
def test_greedy_outputs_identical_on_the_8_device_meshes(mesh, spec):
  """A batch of 3 on dp = 2 (with MTP) and dp = 8 (without) leaves idle dp shards; tp = 4
  copies the 2 KV heads (and their biases); routed experts over ep, shared experts and the
  dense layer over tp."""
  dp, tp, ep = mesh
  config = None if spec is None else {"method": spec, "num_speculative_tokens": 2}
  llm = jspec.LLM(model=fixture_dir(NAME), dtype="float32", max_model_len=64,
                  mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep, num_devices=dp * tp * ep),
                  speculative_config=config)
  baseline = cached_llm(NAME)
  assert _tokens(llm, PROMPTS[1:], 10) == _tokens(baseline, PROMPTS[1:], 10)
  shared = llm.target.layers[1].mlp.shared_experts.gate_up_proj.get_value()
  assert "tp" in str(shared.sharding.spec) or tp == 1
  experts = llm.target.layers[1].mlp.w_gate.get_value()
  assert "ep" in str(experts.sharding.spec) or ep == 1


# ---- the MTP layer's copies of the embedding and head ------------------------------------------

def _edited_copy(tmp_path, edit):
  src = fixture_dir(NAME)
  for f in os.listdir(src):
    if f != "model.safetensors":
      shutil.copy(os.path.join(src, f), tmp_path / f)
  tensors = load_file(os.path.join(src, "model.safetensors"))
  edit(tensors)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  return str(tmp_path)


def test_an_unequal_embedding_copy_is_the_mtp_layers_own(tmp_path):
  def edit(tensors):
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][::-1]
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"].copy()
  llm = jspec.LLM(model=_edited_copy(tmp_path, edit), dtype="float32", max_model_len=64)
  assert llm.mtp_spec.has_own_embed and not llm.mtp_spec.has_own_head
  layer = llm.mtp.layers[0]
  want = load_file(str(tmp_path / "model.safetensors"))["model.layers.3.embed_tokens.weight"]
  np.testing.assert_array_equal(np.asarray(layer.embed.get_value()), want)
  assert not hasattr(layer, "head")  # equal to lm_head: the target's is used


def test_an_own_embedding_split_over_tp_drafts_what_one_device_drafts(tmp_path):
  """The MTP layer's own embedding, its vocabulary split over tp, is looked up shard by shard
  (jspec.sharding.vocab): greedy MTP tokens, and the acceptance they give, equal one
  device's."""
  def edit(tensors):
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][::-1]
  path = _edited_copy(tmp_path, edit)
  spec = {"method": "mtp", "num_speculative_tokens": 2}
  outputs = {}
  for tp in (1, 2):
    # Its rows split over tp (by default an own table is whole: ShardingRules.embed_vocab).
    llm = jspec.LLM(model=path, dtype="float32", max_model_len=64, speculative_config=spec,
                    mesh=jspec.MeshConfig(tp=tp), sharding_rules=ShardingRules(embed_vocab="tp"))
    assert (llm.mtp.layers[0].embedding_lookup is not None) == (tp == 2)
    result = llm.generate(PROMPTS[:2], greedy(8, ignore_eos=True))
    outputs[tp] = ([o.token_ids for o in result], result.metrics.mean_acceptance_length)
  assert outputs[2] == outputs[1]


def test_equality_is_checked_without_loading_the_copy(monkeypatch):
  """The copy is compared block by block (SafetensorsIndex.same_bytes), never read whole."""
  read = []
  original = loading.SafetensorsIndex.read
  monkeypatch.setattr(loading.SafetensorsIndex, "read",
                      lambda self, n: (read.append(n), original(self, n))[1])
  jspec.LLM(model=fixture_dir(NAME), dtype="float32", max_model_len=64)
  assert "model.layers.3.embed_tokens.weight" not in read
  assert read.count("model.embed_tokens.weight") == 1


def test_memory_plan_counts_the_mtp_layers_family_cache():
  """The draft's cache is what `make_mtp_cache` gives (here a KV cache), as the loop allocates."""
  llm = jspec.LLM(model=fixture_dir(NAME), dtype="float32", max_model_len=64, max_num_seqs=4,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3})
  cfg = llm.config
  slots = 128  # 64 + k + 1, rounded up to a multiple of 128
  kv_layer = 2 * 4 * cfg.num_kv_heads * slots * cfg.head_dim * 4
  assert llm.memory_plan.draft_cache_bytes == kv_layer
  assert llm.memory_plan.target_cache_bytes == cfg.num_layers * kv_layer


def test_roofline_counts_every_weight_of_the_family():
  """Biases, the dense first layer, shared experts and the router's correction bias: at a batch
  that reaches every expert, the step reads every parameter but the embedding table."""
  from jspec.bench.presets import PRESETS
  from jspec.bench.roofline import step_bytes
  from jspec.models.glm4_moe import Glm4MoeCausalLM
  cfg = PRESETS["tiny-glm"]
  target = nnx.eval_shape(lambda: Glm4MoeCausalLM(cfg, jnp.float32, nnx.Rngs(0)))
  params = sum(int(np.prod(v.get_value().shape))
               for _, v in nnx.to_flat_state(nnx.state(target)))
  batch, kv = 1 << 14, cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
  assert step_bytes(cfg, batch, 1, 0, itemsize=4) == 4 * (
      params - cfg.vocab_size * cfg.hidden_size + batch * kv)


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, match", [
    ("scoring_func", "softmax", r"scoring_func='softmax' is not supported; jspec supports "
                                r"\['sigmoid'\]"),
    ("topk_method", "greedy", r"topk_method='greedy' is not supported; jspec supports "
                              r"\['noaux_tc'\]"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 128,
                         "partial_rotary_factor": 0.5},
     r"rope_type='yarn' is not supported for Glm4MoeForCausalLM; jspec supports \['default'\]"),
])
def test_unsupported_config_is_refused(tmp_path, key, value, match):
  src = fixture_dir(NAME)
  for f in os.listdir(src):
    os.symlink(os.path.join(src, f), tmp_path / f)
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  config[key] = value
  os.remove(tmp_path / "config.json")
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match=match):
    jspec.LLM(model=str(tmp_path), dtype="float32")
