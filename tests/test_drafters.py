"""Drafters loaded from their own directory: a draft model ("draft_model") and an EAGLE-3 head
("eagle3"), on the llama3 and mixtral fixtures (drafter checkpoints from
tests/drafter_checkpoints.py).

- Greedy speculation equals greedy vanilla decoding for k = 1, 3, 5 and batches of 1, 4 and 9,
  with partial acceptance (a one-layer draft model), almost none (a random EAGLE-3 head) and
  almost full (the target as its own draft, where stops and length limits land inside
  accepted runs).
- The EAGLE-3 head equals a NumPy transcription of vLLM's `llama_eagle3.py` computed from the
  checkpoint's tensors; the target's aux hidden states are the inputs of the named layers.
- Sampled speculation keeps the target's own distribution (chi-square against the
  distribution `compute_logits` gives).
- Both drafters on Mixtral under dp = 2 x ep = 2, and replicated over tp = 2 (draft_tp = 1).
- What cannot draft for a target is refused, with the reason, before its weights are read.
"""

import dataclasses
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from drafter_checkpoints import eagle3_head, truncated_draft_model
from helpers import cached_llm, fixture_dir, greedy, reference, two_sample_chi2
from jspec.models.eagle3 import read_eagle3_config

TARGET = "llama3"
VOCAB = 320  # llama3's vocabulary
RNG = np.random.default_rng(20261123)
PROMPTS = [RNG.integers(0, VOCAB, size=n).tolist() for n in (3, 9, 1, 14, 6, 2, 11, 5, 8)]
MAX_TOKENS = 20
# The fixtures have two layers, so vLLM's default aux layers (2, L // 2, L - 3) do not exist
# there; their heads name the layers they read.
AUX_LAYERS = (0, 1, 1)
METHOD = {"target_itself": "draft_model", "one_layer": "draft_model", "eagle3": "eagle3"}


@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory):
  """Drafters for llama3: itself, its own first layer (with its embedding, final norm and
  head), and a random EAGLE-3 head over a 96-token draft vocabulary."""
  root, llama = tmp_path_factory.mktemp("llama3_drafters"), fixture_dir(TARGET)
  return {
      "target_itself": llama,
      "one_layer": truncated_draft_model(llama, str(root / "one_layer"), 1),
      "eagle3": eagle3_head(llama, str(root / "eagle3"), 96, aux_layer_ids=AUX_LAYERS),
  }


def _spec_llm(dirs, drafter: str, k: int) -> jspec.LLM:
  return cached_llm(TARGET, METHOD[drafter], k, model=dirs[drafter])


def _vanilla(prompts, max_tokens=MAX_TOKENS, **kwargs):
  outs = cached_llm(TARGET).generate(prompts, greedy(max_tokens, **kwargs))
  return [o.token_ids for o in outs]


# ---- greedy: speculation changes no token ------------------------------------------------------

@pytest.mark.parametrize("drafter", ["one_layer", "eagle3"])
@pytest.mark.parametrize("k, batch_size", [(1, 9), (3, 1), (3, 4), (5, 9)])
def test_greedy_speculation_equals_vanilla(drafter_dirs, drafter, k, batch_size):
  """Every rejected draft is rolled back (the draft model's cache, the head's cache), whatever
  the acceptance; EOS (llama3's 276) stops where vanilla decoding stops. (k, batch) pairs, not
  their product: each pair is one compiled program."""
  outs = _spec_llm(drafter_dirs, drafter, k).generate(PROMPTS[:batch_size], greedy(MAX_TOKENS))
  assert [o.token_ids for o in outs] == _vanilla(PROMPTS)[:batch_size]
  for o in outs:
    assert len(o.token_ids) == 1 + o.metrics.num_accepted_tokens + o.metrics.num_steps
  if drafter == "one_layer":  # some drafts accepted, some rejected: both paths ran
    assert 0 < outs.metrics.num_accepted_tokens < outs.metrics.num_draft_tokens


@pytest.mark.parametrize("k", [3, 5])
def test_target_as_its_own_draft_accepts_almost_every_draft(drafter_dirs, k):
  outs = _spec_llm(drafter_dirs, "target_itself", k).generate(
      PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
  assert [o.token_ids for o in outs] == _vanilla(PROMPTS, ignore_eos=True)
  # The fewest steps that emit MAX_TOKENS - 1 tokens after prefill, k + 1 a step; one step
  # more in all allows one near-tie that the draft's and the target's float sums break apart.
  fewest = -(-(MAX_TOKENS - 1) // (k + 1))
  assert sum(o.metrics.num_steps - fewest for o in outs) <= 1


def test_stops_inside_accepted_runs_end_where_vanilla_ends(drafter_dirs):
  """The target as its own draft emits up to k + 1 tokens a step, so length limits and stop
  ids fall strictly inside accepted runs: the output still ends exactly where vanilla
  decoding ends, and the runs really were cut (metrics say so)."""
  llm = _spec_llm(drafter_dirs, "target_itself", 3)
  prompt = PROMPTS[3]
  full = _vanilla([prompt], ignore_eos=True)[0]
  steps = {}
  for m in range(1, MAX_TOKENS + 1):
    out = llm.generate([prompt], greedy(m, ignore_eos=True))[0]
    assert out.token_ids == full[:m] and out.finish_reason == "length"
    steps[m] = out.metrics.num_steps
  # Token m ends inside an accepted run when the step that emitted it would have emitted
  # token m + 1 too: limits m and m + 1 take the same number of steps.
  inside = {m for m in range(1, MAX_TOKENS) if steps[m] == steps[m + 1]}
  assert inside
  stopped_inside = 0
  for stop in dict.fromkeys(full):
    first = full.index(stop)
    out = llm.generate([prompt], greedy(MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert out.token_ids == full[:first + 1] and out.finish_reason == "stop"
    assert out.metrics.num_steps == steps[first + 1]
    stopped_inside += (first + 1) in inside
  assert stopped_inside > 0


# ---- EAGLE-3 against a NumPy transcription of vLLM's llama_eagle3.py ---------------------------

def _rms_norm(x, weight, eps):
  return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x_TNH, positions_T, theta):
  """Llama's rotate-half RoPE (transformers `apply_rotary_pos_emb`), no scaling."""
  half = x_TNH.shape[-1] // 2
  inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / x_TNH.shape[-1])
  angles_TH = np.concatenate([np.outer(positions_T, inv_freq)] * 2, axis=-1)[:, None]
  rotated = np.concatenate([-x_TNH[..., half:], x_TNH[..., :half]], axis=-1)
  return x_TNH * np.cos(angles_TH) + rotated * np.sin(angles_TH)


def _eagle3_reference(head_dir, embed_VD, hidden_TD, tokens_T, positions_T):
  """vLLM `Eagle3LlamaForCausalLM` (LlamaModel.forward, its midlayer, compute_logits) on the
  checkpoint's tensors over positions at once, causally: `hidden_TD` is the head's hidden
  input (fc over the target's aux states, or the head's own pre-norm output when drafting),
  `tokens_T` the token paired with each. Returns (logits over the target's vocabulary [T, V]
  with -inf outside the draft vocabulary, pre-norm output [T, D])."""
  with open(os.path.join(head_dir, "config.json")) as f:
    cfg = json.load(f)
  w = load_file(os.path.join(head_dir, "model.safetensors"))
  eps, n, kv, hd = (cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                    cfg["head_dim"])
  m, t = "midlayer.", len(tokens_T)
  embed_VD = w.get("embed_tokens.weight", embed_VD)  # a head's own embedding, else the target's
  embeds_TD = _rms_norm(embed_VD[tokens_T], w[m + "input_layernorm.weight"], eps)
  normed_TD = _rms_norm(hidden_TD, w[m + "hidden_norm.weight"], eps)
  # _norm_before_residual / _norm_after_residual
  residual_TD = normed_TD if cfg.get("norm_before_residual") else hidden_TD
  x_T2D = np.concatenate([embeds_TD, normed_TD], axis=-1)  # torch.cat([embeds, hidden_states])
  project = lambda name, heads: (x_T2D @ w[m + f"self_attn.{name}.weight"].T).reshape(t, heads, hd)
  q_TNH = _rope(project("q_proj", n), positions_T, cfg["rope_theta"])
  k_TNH = np.repeat(_rope(project("k_proj", kv), positions_T, cfg["rope_theta"]), n // kv, axis=1)
  v_TNH = np.repeat(project("v_proj", kv), n // kv, axis=1)  # transformers repeat_kv
  scores_NTS = np.einsum("tnh,snh->nts", q_TNH, k_TNH) / np.sqrt(hd)
  scores_NTS = np.where(np.tril(np.ones((t, t), bool)), scores_NTS, -np.inf)
  probs_NTS = np.exp(scores_NTS - scores_NTS.max(-1, keepdims=True))
  probs_NTS /= probs_NTS.sum(-1, keepdims=True)
  attn_TD = (np.einsum("nts,snh->tnh", probs_NTS, v_TNH).reshape(t, n * hd)
             @ w[m + "self_attn.o_proj.weight"].T)
  residual_TD = residual_TD + attn_TD
  mlp_in_TD = _rms_norm(residual_TD, w[m + "post_attention_layernorm.weight"], eps)
  gate_TF = mlp_in_TD @ w[m + "mlp.gate_proj.weight"].T
  up_TF = mlp_in_TD @ w[m + "mlp.up_proj.weight"].T
  mlp_TD = (gate_TF / (1 + np.exp(-gate_TF)) * up_TF) @ w[m + "mlp.down_proj.weight"].T
  prenorm_TD = residual_TD + mlp_TD  # the fused add of self.norm(hidden_states, residual)
  draft_logits_TN = _rms_norm(prenorm_TD, w["norm.weight"], eps) @ w["lm_head.weight"].T
  # compute_logits: draft id d lands at target id d + d2t[d]; every other id is -inf.
  logits_TV = np.full((t, VOCAB), -np.inf)
  logits_TV[:, np.arange(len(w["d2t"])) + w["d2t"]] = draft_logits_TN
  return logits_TV, prenorm_TD


def _jspec_eagle3(llm, tokens_T, next_tokens_T, draft_token):
  """jspec's head as the drafter runs it: the first layer over the prompt positions (the
  target's state at i paired with token i + 1), then one draft step at the next position from
  the head's own pre-norm output. Returns (logits [T + 1, V], prenorm [T + 1, D], the target's
  aux states [T, D] each)."""
  target, head, slots = llm.target, llm.draft_module, 32
  t = len(tokens_T)
  positions_1T = jnp.arange(t, dtype=jnp.int32)[None]
  hidden_1TD, _, aux = target(jnp.asarray([tokens_T]), positions_1T,
                              target.init_caches(1, slots, jnp.float32), slots, llm.experts_fn,
                              seq_lens_B=jnp.asarray([t]), aux_layers=head.aux_layers)
  layer = head.layers[0]
  normed_1TD, prenorm_1TD, cache = layer(
      target, jnp.asarray([next_tokens_T]), head.target_features(target, hidden_1TD, aux),
      positions_1T, head.init_caches(1, slots, jnp.float32)[0], slots, llm.draft_experts_fn)
  normed_11D, prenorm_11D, _ = layer(
      target, jnp.asarray([[draft_token]]), prenorm_1TD[:, -1:], jnp.asarray([[t]]), cache,
      slots, llm.draft_experts_fn)
  logits_TV = np.concatenate([np.asarray(layer.logits(target, normed_1TD)[0]),
                              np.asarray(layer.logits(target, normed_11D)[0])])[:, :VOCAB]
  prenorm_TD = np.concatenate([np.asarray(prenorm_1TD[0]), np.asarray(prenorm_11D[0])])
  return logits_TV, prenorm_TD, [np.asarray(a[0]) for a in aux]


@pytest.mark.parametrize("norm_before_residual, own_embed, hidden", [
    (False, False, None), (True, False, None), (False, True, None), (True, True, 32)])
def test_eagle3_head_equals_vllm_llama_eagle3_on_the_checkpoint(tmp_path, norm_before_residual,
                                                                own_embed, hidden):
  """Both residual conventions; a head with its own embed_tokens, and one whose hidden size
  (32) differs from the target's (64), its fc reading 3 x 64. The aux states come from the
  target (checked apart below)."""
  head_dir = eagle3_head(fixture_dir(TARGET), str(tmp_path / "head"), 96, seed=3,
                         aux_layer_ids=AUX_LAYERS, hidden=hidden, own_embed=own_embed,
                         norm_before_residual=norm_before_residual)
  llm = jspec.LLM(model=fixture_dir(TARGET), dtype="float32", max_model_len=64,
                  speculative_config={"method": "eagle3", "model": head_dir,
                                      "num_speculative_tokens": 2})
  assert llm.draft_module.aux_layers == AUX_LAYERS
  tokens_T = PROMPTS[3][:8]
  next_tokens_T, draft_token = tokens_T[1:] + [17], 45
  got_logits, got_prenorm, aux = _jspec_eagle3(llm, tokens_T, next_tokens_T, draft_token)

  embed_VD = load_file(os.path.join(fixture_dir(TARGET),
                                    "model.safetensors"))["model.embed_tokens.weight"]
  fc = load_file(os.path.join(head_dir, "model.safetensors"))["fc.weight"]
  fused_TD = np.concatenate(aux, axis=-1) @ fc.T  # combine_hidden_states
  t = len(tokens_T)
  _, prenorm_TD = _eagle3_reference(head_dir, embed_VD, fused_TD, np.asarray(next_tokens_T),
                                    np.arange(t))
  # The draft step: the head's own pre-norm output at the last position, the draft token.
  want_logits, want_prenorm = _eagle3_reference(
      head_dir, embed_VD, np.concatenate([fused_TD, prenorm_TD[-1:]]),
      np.asarray(next_tokens_T + [draft_token]), np.arange(t + 1))
  np.testing.assert_array_equal(np.isinf(got_logits), np.isinf(want_logits))
  finite = np.isfinite(want_logits)
  assert finite.sum() == 96 * (t + 1)
  np.testing.assert_allclose(got_logits[finite], want_logits[finite], atol=1e-4, rtol=0)
  np.testing.assert_allclose(got_prenorm, want_prenorm, atol=1e-4, rtol=0)


def test_aux_hidden_states_are_the_inputs_of_the_named_target_layers():
  """Layer 0's input is the embedding; layer 1's input is layer 0's output; the final norm of
  layer 1's output is the hidden state the target returns."""
  llm, slots = cached_llm(TARGET), 32
  target, tokens_T = llm.target, PROMPTS[3]
  positions_1T = jnp.arange(len(tokens_T), dtype=jnp.int32)[None]
  caches = target.init_caches(1, slots, jnp.float32)
  hidden_1TD, _, (aux0, aux1) = target(jnp.asarray([tokens_T]), positions_1T, caches, slots,
                                       llm.experts_fn, aux_layers=(0, 1))
  embed_VD = load_file(os.path.join(fixture_dir(TARGET),
                                    "model.safetensors"))["model.embed_tokens.weight"]
  np.testing.assert_array_equal(np.asarray(aux0[0]), embed_VD[tokens_T])
  after0, _ = target.layers[0](aux0, positions_1T, caches[0], slots, llm.experts_fn)
  np.testing.assert_allclose(np.asarray(aux1), np.asarray(after0), atol=1e-6, rtol=0)
  after1, _ = target.layers[1](aux1, positions_1T, caches[1], slots, llm.experts_fn)
  np.testing.assert_allclose(np.asarray(hidden_1TD), np.asarray(target.final_norm(after1)),
                             atol=1e-6, rtol=0)


def test_default_aux_layers_are_vllms_and_refused_where_the_target_lacks_them(tmp_path):
  """Without eagle_aux_hidden_state_layer_ids a head reads vLLM's default (2, L // 2, L - 3)
  (`get_eagle3_aux_hidden_state_layers`): for a 32-layer target (2, 16, 29); for the 2-layer
  fixture (2, 1, -1), which names layers it does not have."""
  from transformers import AutoConfig
  head_dir = eagle3_head(fixture_dir(TARGET), str(tmp_path / "head"), 96)
  hf_config = AutoConfig.from_pretrained(head_dir, local_files_only=True)
  target_cfg = cached_llm(TARGET).config
  deep = dataclasses.replace(target_cfg, num_layers=32)
  assert read_eagle3_config(hf_config, deep, set()).aux_layer_ids == (2, 16, 29)
  with pytest.raises(ValueError, match=r"EAGLE-3 aux layers \(2, 1, -1\) must be three layer "
                                       r"ids of the target \(0 \.\. 1\)"):
    jspec.LLM(model=fixture_dir(TARGET), dtype="float32", max_model_len=64,
              speculative_config={"method": "eagle3", "model": head_dir,
                                  "num_speculative_tokens": 2})


# ---- sampling: speculation keeps the target's distribution ------------------------------------

CHI_PROMPT = [5, 17, 99, 3]  # a spread next-token distribution on the llama3 fixture


def _processed(logits_V, top_k):
  """The distribution the target samples at temperature 1 (jspec.speculative.sampling:
  top-k by logit, ties to the lower id, renormalised)."""
  keep = np.argsort(-logits_V, kind="stable")[:top_k or len(logits_V)]
  probs_V = np.zeros(len(logits_V))
  exp = np.exp(logits_V[keep].astype(np.float64) - logits_V[keep].max())
  probs_V[keep] = exp / exp.sum()
  return probs_V


def _target_marginals(prompt, top_k, n):
  """The distribution of each of the first n generated tokens under the target alone, from
  `compute_logits` over every continuation with positive probability."""
  llm = cached_llm(TARGET)
  prefixes, marginals = {(): 1.0}, []
  for _ in range(n):
    keys = list(prefixes)
    logits = llm.compute_logits([prompt + list(p) for p in keys])
    marginal, longer = np.zeros(VOCAB), {}
    for prefix, logits_SV in zip(keys, logits):
      probs_V = _processed(logits_SV[-1], top_k)
      marginal += prefixes[prefix] * probs_V
      longer.update({prefix + (int(t),): prefixes[prefix] * probs_V[t]
                     for t in np.flatnonzero(probs_V)})
    marginals.append(marginal / marginal.sum())
    prefixes = longer
  return marginals


@pytest.mark.runs_programs_often
@pytest.mark.parametrize("drafter, top_k", [("one_layer", 8), ("eagle3", 0)])
def test_sampled_speculation_keeps_the_target_distribution(drafter_dirs, drafter, top_k):
  """Temperature 1: the first generated tokens (the second and, with top-k, the third decided
  by verification, k = 2) follow the target's own distribution: a two-sample chi-square of
  1500 samples against 1500 draws from the distribution `compute_logits` gives, at
  tests/test_speculative.py's threshold. The samples are one request's n = 1500 (each its own
  random stream; one admission per 64 of them, where 1500 requests take 1500). The EAGLE-3
  head's draft distribution is zero outside its 96-token draft vocabulary while the target's
  (no top-k) spans all 320."""
  n = 3 if top_k else 2  # without top-k the third token's mixture has 320 x 320 branches
  # Four tokens: the first step's whole window (k + 1 = 3) is emitted, so its acceptances count.
  params = jspec.SamplingParams(temperature=1.0, top_k=top_k, max_tokens=4, seed=0, n=1500,
                                ignore_eos=True)
  # Each sample its own random stream: the same samples on any number of slots; two draw
  # them fastest on the CPU (a step's cost grows with its rows).
  llm = cached_llm(TARGET, METHOD[drafter], 2, model=drafter_dirs[drafter], max_num_seqs=2)
  outs = llm.generate([CHI_PROMPT], params)
  samples = outs[0].outputs
  rng = np.random.default_rng(top_k)
  for i, probs_V in enumerate(_target_marginals(CHI_PROMPT, top_k, n)):
    sampled = np.array([c.token_ids[i] for c in samples])
    stat, critical, dof = two_sample_chi2(sampled, rng.choice(VOCAB, size=len(sampled), p=probs_V))
    assert dof >= 3 and stat < critical, (i, stat, critical, dof)
  assert outs.metrics.num_accepted_tokens < outs.metrics.num_draft_tokens  # rejections ran
  if drafter == "one_layer":
    assert outs.metrics.num_accepted_tokens > 0


# ---- meshes --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mixtral_drafter_dirs(tmp_path_factory):
  root, mixtral = tmp_path_factory.mktemp("mixtral_drafters"), fixture_dir("mixtral")
  return {"draft_model": truncated_draft_model(mixtral, str(root / "one_layer"), 1),
          "eagle3": eagle3_head(mixtral, str(root / "eagle3"), 64, aux_layer_ids=AUX_LAYERS)}


@pytest.fixture(scope="module")
def mixtral_vanilla_dp2_ep2():
  ref = reference("mixtral")
  # Six prompts over a batch of 8 rows split four ways: two shards hold a padding row.
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)] + [p for p in PROMPTS[:3]]
  prompts = [[t % 255 for t in p] for p in prompts]  # mixtral's vocabulary is 255
  llm = jspec.LLM(model=fixture_dir("mixtral"), dtype="float32", max_model_len=64,
                  mesh=jspec.MeshConfig(dp=2, ep=2))
  return prompts, [o.token_ids for o in llm.generate(prompts, greedy(16, ignore_eos=True))]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_mixtral_under_dp2_ep2_with_each_drafter_equals_vanilla(mixtral_drafter_dirs,
                                                                mixtral_vanilla_dp2_ep2, method):
  """The draft model is itself a Mixtral (its experts under the draft's expert sharding)."""
  prompts, want = mixtral_vanilla_dp2_ep2
  llm = jspec.LLM(model=fixture_dir("mixtral"), dtype="float32", max_model_len=64,
                  mesh=jspec.MeshConfig(dp=2, ep=2),
                  speculative_config={"method": method, "model": mixtral_drafter_dirs[method],
                                      "num_speculative_tokens": 3})
  outs = llm.generate(prompts, greedy(16, ignore_eos=True))
  assert [o.token_ids for o in outs] == want


def test_draft_model_replicated_over_tp_2_equals_vanilla(drafter_dirs):
  """draft_tp = 1 at tp = 2: the draft model's weights whole on both tensor shards, the
  target's split."""
  llm = jspec.LLM(model=fixture_dir(TARGET), dtype="float32", max_model_len=64,
                  mesh=jspec.MeshConfig(tp=2),
                  speculative_config={"method": "draft_model", "model": drafter_dirs["one_layer"],
                                      "num_speculative_tokens": 3, "draft_tp": 1})
  assert not llm.target.layers[0].attn.o_proj[...].sharding.is_fully_replicated
  assert llm.draft_module.layers[0].attn.o_proj[...].sharding.is_fully_replicated
  outs = llm.generate(PROMPTS[:4], greedy(MAX_TOKENS))
  assert [o.token_ids for o in outs] == _vanilla(PROMPTS[:4])


# ---- refusals -----------------------------------------------------------------------------------

def _config_only(name: str, out_dir) -> str:
  """A fixture's config without its weights: a check that passes only after reading weights
  would fail on their absence instead."""
  os.makedirs(out_dir, exist_ok=True)
  shutil.copy(os.path.join(fixture_dir(name), "config.json"), out_dir)
  return str(out_dir)


def _draft_model_llm(target_dir, draft_dir, **spec):
  return jspec.LLM(model=target_dir, dtype="float32", max_model_len=64,
                   speculative_config={"method": "draft_model", "model": draft_dir,
                                       "num_speculative_tokens": 2, **spec})


def test_draft_model_of_another_vocabulary_is_refused_before_any_weight_is_read(tmp_path):
  target, draft = _config_only(TARGET, tmp_path / "llama3"), _config_only("qwen2", tmp_path / "q")
  with pytest.raises(ValueError, match=r"draft model's vocab_size 352 \(.*\) differs from the "
                                       r"target's 320 \(.*\): a draft model must share"):
    _draft_model_llm(target, draft)


def _word_level_tokenizer(out_dir, words):
  """A tokenizer.json (one id per whitespace-separated word) that AutoTokenizer loads."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)


def test_draft_model_with_another_tokenizer_is_refused_before_any_weight_is_read(tmp_path):
  """Same vocabulary size, two ids swapped: refused. The same tokenizer passes the check (and
  loading then finds no weights)."""
  words = [f"w{i}" for i in range(VOCAB)]
  target = _config_only(TARGET, tmp_path / "target")
  same, swapped = _config_only(TARGET, tmp_path / "same"), _config_only(TARGET, tmp_path / "swap")
  _word_level_tokenizer(target, words)
  _word_level_tokenizer(same, words)
  _word_level_tokenizer(swapped, [words[1], words[0]] + words[2:])
  with pytest.raises(ValueError, match=r"draft model's tokenizer \(320 tokens, .*\) differs from "
                                       r"the target's \(320 tokens, .*\)"):
    _draft_model_llm(target, swapped)
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    _draft_model_llm(target, same)


def test_recurrent_draft_model_is_refused(tmp_path):
  """qwen3_5_dense shares llama3's vocabulary size (320); its Gated DeltaNet layers keep
  recurrent state, which cannot roll back a rejected draft by length."""
  target, draft = _config_only(TARGET, tmp_path / "t"), _config_only("qwen3_5_dense", tmp_path / "d")
  with pytest.raises(ValueError, match=r"keeps \['KVCache', 'RecurrentCache'\] caches; draft "
                                       r"models must keep caches that roll back by length"):
    _draft_model_llm(target, draft)


@pytest.mark.parametrize("config, match", [
    ({"method": "draft_model", "num_speculative_tokens": 2},
     "method 'draft_model' needs 'model': the drafter's checkpoint directory"),
    ({"method": "eagle3", "num_speculative_tokens": 2},
     "method 'eagle3' needs 'model': the drafter's checkpoint directory"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/some/dir"},
     "method 'ngram' takes no 'model'"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "/no/such/head"},
     "EAGLE-3 head directory '/no/such/head' does not exist"),
])
def test_drafter_directory_is_required_where_needed_and_only_there(config, match):
  with pytest.raises((ValueError, FileNotFoundError), match=match):
    jspec.LLM(model=fixture_dir(TARGET), dtype="float32", max_model_len=64,
              speculative_config=config)


def test_draft_tp_must_be_1_or_the_targets_tp(drafter_dirs):
  with pytest.raises(ValueError, match=r"draft_tp=4 must be 1 \(the draft replicated over tp\) "
                                       r"or the target's tp=2"):
    jspec.LLM(model=fixture_dir(TARGET), dtype="float32", max_model_len=64,
              mesh=jspec.MeshConfig(tp=2),
              speculative_config={"method": "draft_model", "model": drafter_dirs["one_layer"],
                                  "num_speculative_tokens": 2, "draft_tp": 4})


@pytest.mark.parametrize("edit", ["past_the_vocabulary", "onto_one_id_twice"])
def test_d2t_mapping_outside_the_target_vocabulary_is_refused(tmp_path, edit):
  head_dir = eagle3_head(fixture_dir(TARGET), str(tmp_path / "head"), 96,
                         aux_layer_ids=AUX_LAYERS)
  path = os.path.join(head_dir, "model.safetensors")
  tensors = load_file(path)
  d2t = tensors["d2t"]
  if edit == "past_the_vocabulary":
    d2t[-1] += VOCAB
  else:
    d2t[1] = d2t[0] - 1  # draft ids 0 and 1 both map to target id d2t[0]
  save_file(tensors, path)
  with pytest.raises(ValueError, match="d2t maps draft ids outside the target vocabulary or "
                                       "onto one id twice"):
    jspec.LLM(model=fixture_dir(TARGET), dtype="float32", max_model_len=64,
              speculative_config={"method": "eagle3", "model": head_dir,
                                  "num_speculative_tokens": 2})


def test_eagle3_head_trained_for_another_vocabulary_is_refused(tmp_path):
  head_dir = eagle3_head(fixture_dir("qwen2"), str(tmp_path / "head"), 96,
                         aux_layer_ids=AUX_LAYERS)
  with pytest.raises(ValueError, match="EAGLE-3 head's vocab_size 352 differs from the "
                                       "target's 320"):
    jspec.LLM(model=fixture_dir(TARGET), dtype="float32", max_model_len=64,
              speculative_config={"method": "eagle3", "model": head_dir,
                                  "num_speculative_tokens": 2})


def test_eagle3_head_narrower_than_the_target_needs_its_own_embedding(tmp_path):
  """A head of hidden size 32 for a 64-wide target cannot embed with the target's table (one
  with its own embed_tokens runs: the reference test above)."""
  head_dir = eagle3_head(fixture_dir(TARGET), str(tmp_path / "head"), 96,
                         aux_layer_ids=AUX_LAYERS, hidden=32)
  with pytest.raises(ValueError, match="EAGLE-3 head's hidden_size 32 differs from the target's "
                                       "64 and it has no embed_tokens.weight of its own"):
    jspec.LLM(model=fixture_dir(TARGET), dtype="float32", max_model_len=64,
              speculative_config={"method": "eagle3", "model": head_dir,
                                  "num_speculative_tokens": 2})
