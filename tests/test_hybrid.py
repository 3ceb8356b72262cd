"""Qwen3.5 / Qwen3.6 / Qwen3-Next: the five published architecture names against transformers
(fixtures from scripts/make_fixtures.py), their MTP heads, and speculation over recurrent
state: greedy speculative == greedy vanilla, lossless sampling, clear refusals."""

import json
import os
import shutil

import numpy as np
import pytest

import jspec
from helpers import (assert_mtp_layer_matches_reference, cached_llm, fixture_dir, greedy,
                     reference, two_sample_chi2)
from jspec.models import loading
from jspec.models.hf_config import config_from_dir

HYBRID = ("qwen3_5_dense", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
ARCHITECTURES = {"qwen3_5_dense": "Qwen3_5ForConditionalGeneration",
                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                 "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM"}
# Logits: absolute 2e-4. These fixtures' logits reach ~10-20 over 100-token sequences through
# the chunked delta rule, where float32 rounding alone moves a few of 38400 by up to 1.5e-4
# (transformers reloading the same weights moves them 2.6e-5). MTP outputs hold to 1e-4.
TOL, RTOL = 1e-4, 0.0
LOGITS_TOL = 2e-4
MAX_TOKENS = 24


def _prompts(name, lengths, seed):
  """Ragged random prompts that avoid the image/video placeholder ids (text-only)."""
  cfg = config_from_dir(fixture_dir(name))
  allowed = np.setdiff1d(np.arange(cfg.vocab_size), cfg.multimodal_token_ids)
  rng = np.random.default_rng(seed)
  prompts = [rng.choice(allowed, size=n).tolist() for n in lengths]
  prompts[1] = [allowed[3], allowed[4], allowed[5]] * 3  # repetitive: n-gram finds drafts
  return prompts


PROMPT_LENGTHS = (3, 9, 1, 14, 6, 2, 70, 5, 8)  # 70 crosses the 64-token chunk


@pytest.mark.parametrize("name", HYBRID)
def test_architecture_name_and_layer_types_come_from_the_config(name):
  llm = cached_llm(name)
  assert llm.config.architecture == ARCHITECTURES[name]
  with open(os.path.join(fixture_dir(name), "config.json")) as f:
    raw = json.load(f)
  want = tuple(raw.get("text_config", raw)["layer_types"])
  assert llm.config.layer_types == want
  assert [layer.layer_type for layer in llm.target.layers] == list(want)
  # Not the every-fourth-layer default: the pattern is read, never assumed.
  default = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                  for i in range(len(want)))
  assert want != default


@pytest.mark.parametrize("name", HYBRID)
def test_logits_match_transformers(name):
  """Sequences of 1, 13 and 100 tokens: 100 crosses the chunked delta rule's 64-token chunk."""
  ref = reference(name)
  seqs = [ref[f"seq_{i}"].tolist() for i in range(3)]
  for i, logits in enumerate(cached_llm(name).compute_logits(seqs)):
    np.testing.assert_allclose(logits, ref[f"logits_{i}"], atol=LOGITS_TOL, rtol=RTOL)


@pytest.mark.parametrize("name", HYBRID)
def test_greedy_generate_matches_transformers(name):
  """transformers decodes with its recurrent path and cache; jspec prefills chunked and
  decodes through the same loop as speculation."""
  ref = reference(name)
  llm = cached_llm(name)
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
  for i, out in enumerate(llm.generate(prompts, greedy(MAX_TOKENS))):
    assert out.token_ids == ref[f"gen_{i}"].tolist()
    assert out.finish_reason == ("stop" if bool(ref[f"gen_stopped_on_eos_{i}"]) else "length")
  for i, out in enumerate(llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))):
    assert out.token_ids == ref[f"gen_noeos_{i}"].tolist()


@pytest.mark.parametrize("name", HYBRID)
def test_mtp_head_matches_reference(name):
  """mtp.fc over [pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h)], one gated-
  attention layer (MoE where the model is), mtp.norm, the shared lm_head."""
  llm = cached_llm(name)
  assert llm.mtp_spec.layout == "qwen3_next" and len(llm.mtp.layers) == 1
  assert_mtp_layer_matches_reference(llm, reference(name), TOL)


@pytest.mark.parametrize("name", ["qwen3_5_dense", "qwen3_5_moe"])
def test_vision_tower_is_skipped_without_being_read(name, monkeypatch, capsys):
  read = []
  original = loading.SafetensorsIndex.read
  monkeypatch.setattr(loading.SafetensorsIndex, "read",
                      lambda self, n: (read.append(n), original(self, n))[1])
  llm = jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=64)
  index = loading.SafetensorsIndex(fixture_dir(name))
  visual = {n for n in index.names if n.startswith("model.visual.")}
  assert visual and not visual & set(read)
  assert "skipping %d tensors under model.visual." % len(visual) in capsys.readouterr().out
  assert llm.target.cfg.weight_prefix == "model.language_model."


# ---- speculation over recurrent state ---------------------------------------------------------

def _vanilla(name, prompts, **kwargs):
  return [o.token_ids for o in cached_llm(name).generate(prompts, greedy(MAX_TOKENS, **kwargs))]


# The seeded candidates (12 random tokens, seed 18) whose greedy continuations repeat
# themselves, so that n-gram drafts are accepted and verify windows are committed part-way
# (random weights rarely copy): found once over 96 candidates, which cost every test a run of
# two programs of its own (batch 64 and 32). The tests that use them check their acceptance.
DRAFTED = {"qwen3_5_text": (0, 23, 44), "qwen3_next": (11, 38, 91)}


def _drafted_prompts(name, count: int):
  candidates = _prompts(name, [12] * 96, 18)
  return [candidates[i] for i in DRAFTED[name][:count]]


@pytest.mark.parametrize("name, method, k", [
    ("qwen3_5_moe", "mtp", 3), ("qwen3_5_text", "mtp", 1), ("qwen3_5_text", "mtp", 5),
    ("qwen3_5_text", "ngram", 3), ("qwen3_next", "ngram", 5)])
def test_greedy_speculative_equals_vanilla(name, method, k):
  """A batch of 9 ragged prompts (one crossing the 64-token chunk): every token equal. The
  published multimodal MoE layout runs with its own MTP head. (A lone request, which would
  compile each LLM's programs again at the 1-row bucket: MTP in test_every_batch_size_from_1_
  to_9, n-gram drafts in test_eos_and_max_tokens_inside_accepted_runs.)"""
  prompts = _prompts(name, PROMPT_LENGTHS, 14)
  if method == "ngram":  # some rows with accepted drafts: windows committed part-way
    prompts[2:4] = _drafted_prompts(name, 2)
  want = _vanilla(name, prompts, ignore_eos=True)
  outs = cached_llm(name, method, k).generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
  assert [o.token_ids for o in outs] == want
  if method == "ngram":
    assert all(outs[i].metrics.num_accepted_tokens > 0 for i in (2, 3))


def test_every_batch_size_from_1_to_9():
  name = "qwen3_5_text"
  prompts = _prompts(name, PROMPT_LENGTHS, 15)
  want = _vanilla(name, prompts)
  llm = cached_llm(name, "mtp", 5)  # test_greedy_speculative_equals_vanilla's: its programs
  for batch_size in range(1, 10):
    outs = llm.generate(prompts[-batch_size:], greedy(MAX_TOKENS))
    assert [o.token_ids for o in outs] == want[-batch_size:], batch_size


def test_eos_and_max_tokens_inside_accepted_runs():
  """The checkpoint's EOS ends outputs as transformers' do; every max_tokens m gives
  vanilla[:m], some m falling strictly inside a multi-token step; every stop id ends the
  output at its first occurrence, whatever was drafted after it."""
  name = "qwen3_5_text"
  ref = reference(name)
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
  outs = cached_llm(name, "mtp", 5).generate(prompts, greedy(MAX_TOKENS))
  for i, out in enumerate(outs):
    assert out.token_ids == ref[f"gen_{i}"].tolist()
  llm = cached_llm(name, "ngram", 3)
  prompt = _drafted_prompts(name, 1)[0]
  full = _vanilla(name, [prompt], ignore_eos=True)[0]
  # One run per limit (greedy runs repeat exactly), its step count compared with the next's.
  outs = {m: llm.generate([prompt], greedy(m, ignore_eos=True))[0]
          for m in range(1, MAX_TOKENS + 1)}
  steps = lambda m: outs[m].metrics.num_steps
  inside = 0
  for m in range(1, MAX_TOKENS):
    out = outs[m]
    assert out.token_ids == full[:m] and out.finish_reason == "length"
    inside += steps(m) == steps(m + 1)
  assert inside > 0
  for stop in list(dict.fromkeys(full))[:6]:
    out = llm.generate([prompt], greedy(MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert out.token_ids == full[:full.index(stop) + 1] and out.finish_reason == "stop"


def test_store_and_replay_commits_give_the_same_tokens():
  """The "store" commit (the default: test_greedy_speculative_equals_vanilla's LLM) and the
  "replay" one give vanilla's tokens, rows 0 and 1 with windows committed part-way."""
  name = "qwen3_next"
  prompts = _prompts(name, PROMPT_LENGTHS, 16)
  prompts[:2] = _drafted_prompts(name, 2)
  replay = jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=128,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 5},
                     recurrent_commit="replay")
  runs = [llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
          for llm in (replay, cached_llm(name, "ngram", 5))]
  assert all(run[i].metrics.num_accepted_tokens > 0 for run in runs for i in (0, 1))
  tokens = [[o.token_ids for o in run] for run in runs]
  assert tokens[0] == tokens[1] == _vanilla(name, prompts, ignore_eos=True)


@pytest.mark.runs_programs_often
def test_speculative_sampling_is_lossless_on_a_hybrid_model():
  """The first token decided by verification has the same distribution with and without MTP
  speculation (two-sample chi-square over 1500 seeded samples)."""
  name = "qwen3_5_text"
  prompt = _prompts(name, PROMPT_LENGTHS, 17)[4]
  # n = 1500 samples of one request: each sample draws from its own random stream, so the
  # samples do not depend on how many run at once. max_num_seqs="auto" (64 here) admits them
  # in 24 rounds, 256 slots in 6: no faster on an idle CPU, but fewer dispatches lose less to
  # a busy one (as under pytest -n 2): 49 s -> 44 s beside another test run, 58 s -> 33 s
  # beside two.
  params = jspec.SamplingParams(temperature=1.0, max_tokens=2, seed=0, n=1500, ignore_eos=True)
  second = lambda llm: np.array([c.token_ids[1] for c in llm.generate([prompt], params)[0].outputs])
  stat, critical, dof = two_sample_chi2(
      second(cached_llm(name, max_num_seqs=256)),
      second(cached_llm(name, "mtp", 2, max_num_seqs=256)))
  assert dof >= 3 and stat < critical, (stat, critical, dof)


# ---- memory plan and refusals -----------------------------------------------------------------

def test_memory_plan_counts_recurrent_state_and_verify_windows():
  name = "qwen3_next"
  cfg = config_from_dir(fixture_dir(name))
  llm = jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=64, max_num_seqs=4,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3},
                  recurrent_commit="store")
  g, dk, dv = cfg.linear.num_key_heads, cfg.linear.key_head_dim, cfg.linear.value_head_dim
  r, window = cfg.linear.num_value_heads // g, cfg.linear.conv_kernel - 1
  linear = sum(t == "linear_attention" for t in cfg.layer_types)
  slots = 128  # 64 + k + 1, rounded up to a multiple of 128
  kv = (cfg.num_layers - linear) * 2 * 4 * cfg.num_kv_heads * slots * cfg.head_dim * 4
  state = 4 * g * r * dk * dv * 4                  # float32 [B, G, R, Dk, Dv]
  conv = 4 * window * g * (2 * dk + r * dv) * 4    # [B, X-1, G, C] in the model dtype
  assert llm.memory_plan.target_cache_bytes == kv + linear * (state + conv)
  # "store" keeps the state after each of the k + 1 verify positions until commit.
  assert llm.memory_plan.verify_window_bytes >= linear * 4 * state
  with pytest.raises(ValueError, match="does not fit.*target caches"):
    jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=64, max_num_seqs=4,
              device_memory_bytes=2**20)


def test_unknown_layer_kind_is_refused(tmp_path):
  src = fixture_dir("qwen3_5_text")
  for f in os.listdir(src):
    shutil.copy(os.path.join(src, f), tmp_path / f)
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  config["layer_types"][0] = "sliding_attention"
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match=r"layer_types has unknown kinds \['sliding_attention'\]"):
    jspec.LLM(model=str(tmp_path), dtype="float32")


def test_tp_must_divide_linear_attention_heads():
  # 4 query heads and 2 KV heads divide over tp = 4 (KV heads copied); 2 linear key heads do not.
  with pytest.raises(ValueError, match="tp=4 must divide linear_num_key_heads=2"):
    jspec.LLM(model=fixture_dir("qwen3_5_moe"), dtype="float32",
              mesh=jspec.MeshConfig(tp=4, num_devices=4))


def test_image_and_video_inputs_are_refused():
  llm = cached_llm("qwen3_5_moe")
  image, video = llm.config.multimodal_token_ids
  with pytest.raises(ValueError, match=r"placeholder token ids \[%d\].*text only" % image):
    llm.generate([[5, image, 6]], greedy(2))
  with pytest.raises(ValueError, match=r"placeholder token ids \[%d\]" % video):
    llm.compute_logits([[video, 3]])
  with pytest.raises(ValueError, match="multi_modal_data.*text only"):
    llm.generate([{"prompt": "hi", "multi_modal_data": {"image": None}}], greedy(2))
