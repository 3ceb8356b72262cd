"""Speculative decoding is exact: greedy speculative output == greedy vanilla output, token for
token, for every drafter, k and batch size; stops land exactly where vanilla decoding stops."""

import numpy as np
import pytest

import jspec
from helpers import cached_llm, greedy, two_sample_chi2

DENSE, MOE = "qwen3_dense", "qwen3_moe"
RNG = np.random.default_rng(20261122)
# Ragged prompts; some repetitive so that n-gram lookup finds matches.
PROMPTS = [RNG.integers(0, 384, size=n).tolist() for n in (3, 9, 1, 14, 6, 2, 11, 5, 8)]
PROMPTS[1] = [10, 11, 12, 10, 11, 12, 10, 11, 12]
PROMPTS[4] = [7, 8, 7, 8, 7, 8]
MAX_TOKENS = 24


def _vanilla(name, prompts, **kwargs):
  return [o.token_ids for o in cached_llm(name).generate(prompts, greedy(MAX_TOKENS, **kwargs))]


# Every k with each drafter on the dense model; the MoE model with each drafter at two k.
GREEDY_CASES = ([(DENSE, m, k) for m in ("mtp", "ngram") for k in (1, 2, 3, 5)]
                + [(MOE, "mtp", 2), (MOE, "mtp", 5), (MOE, "ngram", 1), (MOE, "ngram", 3)])


@pytest.mark.parametrize("name, method, k", GREEDY_CASES)
def test_greedy_speculative_equals_vanilla(name, method, k):
  """The 9 ragged prompts in one batch. (Every batch size from 1 to 9, a lone request included,
  with each drafter: test_every_batch_size_from_1_to_9; at each k, a batch of one more would
  compile the LLM's programs again at the 1-row bucket.)"""
  want = _vanilla(name, PROMPTS)
  outs = cached_llm(name, method, k).generate(PROMPTS, greedy(MAX_TOKENS))
  assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("method", ["mtp", "ngram"])
@pytest.mark.parametrize("batch_size", range(1, 10))
def test_every_batch_size_from_1_to_9(method, batch_size):
  prompts = PROMPTS[-batch_size:]
  want = _vanilla(DENSE, prompts, ignore_eos=True)
  outs = cached_llm(DENSE, method, 3).generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
  assert [o.token_ids for o in outs] == want


def test_max_tokens_inside_an_accepted_run():
  """For every max_tokens m, output == vanilla[:m]; and some m fall strictly inside a step
  that emitted several tokens (m and m+1 take the same number of steps)."""
  llm = cached_llm(DENSE, "ngram", 3)
  prompt = PROMPTS[1]
  full = _vanilla(DENSE, [prompt], ignore_eos=True)[0]
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


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_every_stop_id_ends_where_vanilla_ends(method):
  """Each token of the continuation, used as a stop id, ends the output at its first
  occurrence, whatever was drafted after it. (Stops strictly inside multi-token steps are
  shown on the trained demo model, whose MTP head drafts first occurrences: test_demo_model.)"""
  llm = cached_llm(DENSE, method, 3)
  for prompt in PROMPTS[:5]:
    full = _vanilla(DENSE, [prompt], ignore_eos=True)[0]
    for stop in dict.fromkeys(full):
      out = llm.generate([prompt], greedy(MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop]))[0]
      first = full.index(stop)
      assert out.token_ids == full[:first + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_eos_from_the_config_stops_like_vanilla(method):
  from helpers import reference
  ref = reference(DENSE)
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
  outs = cached_llm(DENSE, method, 3).generate(prompts, greedy(24))
  for i, out in enumerate(outs):
    assert out.token_ids == ref[f"gen_{i}"].tolist()
    assert out.finish_reason == ("stop" if bool(ref[f"gen_stopped_on_eos_{i}"]) else "length")


@pytest.mark.parametrize("method, k", [("mtp", 3), ("ngram", 3), ("ngram", 5)])
def test_metrics_are_consistent(method, k):
  outs = cached_llm(DENSE, method, k).generate(PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
  for o in outs:
    m = o.metrics
    assert m.num_accepted_tokens <= m.num_draft_tokens
    assert len(o.token_ids) == 1 + m.num_accepted_tokens + m.num_steps
    assert len(m.acceptance_rate_per_position) == k
    # Greedy chains: position j+1 is accepted only if position j was.
    assert all(a >= b for a, b in zip(m.num_accepted_per_position,
                                      m.num_accepted_per_position[1:]))
    assert m.mean_acceptance_length == pytest.approx((m.num_accepted_tokens + m.num_steps)
                                                     / m.num_steps)
  agg = outs.metrics
  assert agg.num_generated_tokens == sum(len(o.token_ids) for o in outs)
  assert agg.num_accepted_tokens == sum(o.metrics.num_accepted_tokens for o in outs)
  if method == "ngram":
    assert agg.num_accepted_tokens > 0  # the repetitive prompts do get accepted drafts


@pytest.mark.runs_programs_often
def test_speculative_sampling_is_lossless_end_to_end():
  """With temperature, the second generated token (the first decided by verification) has the
  same distribution with and without speculation: a two-sample chi-square on the top tokens."""
  # n = 1500 samples of one request: each sample draws from its own random stream, so the
  # samples are the same whatever the number of slots. Two slots draw them fastest on the CPU
  # (a step's cost grows with its rows; every sample is admitted anyway).
  params = jspec.SamplingParams(temperature=1.0, max_tokens=2, seed=0, n=1500, ignore_eos=True)
  second = lambda llm: np.array([c.token_ids[1]
                                 for c in llm.generate([PROMPTS[4]], params)[0].outputs])
  a = second(cached_llm(DENSE, max_num_seqs=2))
  b = second(cached_llm(DENSE, "mtp", 2, max_num_seqs=2))
  stat, critical, dof = two_sample_chi2(a, b)
  assert dof >= 3 and stat < critical, (stat, critical, dof)


@pytest.mark.parametrize("config, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported.*mtp"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "n-gram bounds out of order"),
    ({"method": "ngram"}, "needs 'method' and 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "depth": 3}, "unknown speculative_config"),
])
def test_bad_speculative_configs(config, match):
  with pytest.raises(ValueError, match=match):
    jspec.LLM(model=cached_llm(DENSE).model_dir, dtype="float32", speculative_config=config)


@pytest.mark.parametrize("name, max_model_len", [(DENSE, 128), (MOE, 128), (DENSE, 100)])
def test_chunked_prefill_gives_the_one_pass_result(name, max_model_len):
  """Prompts longer than prefill_chunk_size are prefilled in chunks (target and MTP extend):
  the same tokens as one pass over the bucket. max_model_len=100 caps the prompt bucket at
  103 slots, which 16-token chunks do not divide (a shorter last pass)."""
  prompts = [RNG.integers(0, 384, size=n).tolist() for n in (40, 23, 70)]
  runs = []
  for chunk in (16, 1024):
    llm = jspec.LLM(model=cached_llm(name).model_dir, dtype="float32",
                    max_model_len=max_model_len,
                    speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                    prefill_chunk_size=chunk)
    outs = llm.generate(prompts, greedy(12, ignore_eos=True))
    runs.append([o.token_ids for o in outs])
  assert runs[0] == runs[1]


def test_prefill_chunk_size_is_validated():
  with pytest.raises(ValueError, match="prefill_chunk_size=100 must be a power of two >= 16"):
    jspec.LLM(model=cached_llm(DENSE).model_dir, dtype="float32", prefill_chunk_size=100)


@pytest.mark.parametrize("method, k", [("mtp", 5), ("ngram", 5)])
def test_reaching_max_model_len_mid_run_finishes_like_vanilla(method, k):
  """At the cap bucket (max_model_len + k + 1 slots, rounded up to 16) a verify window can
  reach past max_model_len: the sequence must stop exactly at max_model_len, as vanilla
  decoding does."""
  max_model_len = 21
  prompts = [PROMPTS[4], PROMPTS[1], PROMPTS[3]]
  # Vanilla decoding's LLM and its programs are shared by the cases.
  # Each request asks for every token up to max_model_len (more is refused).
  params = [greedy(max_model_len - len(p), ignore_eos=True) for p in prompts]
  want = cached_llm(DENSE, max_model_len=max_model_len).generate(prompts, params)
  got = cached_llm(DENSE, method, k, max_model_len=max_model_len).generate(prompts, params)
  for p, w, g in zip(prompts, want, got):
    assert len(p) + len(g.token_ids) == max_model_len and g.finish_reason == "length"
    assert g.token_ids == w.token_ids
