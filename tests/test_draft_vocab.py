"""A reduced draft vocabulary changes what the MTP head proposes, never what is generated:
greedy output equals vanilla output, sampled output keeps the target's distribution, and the
restricted head's logits are the full head's logits on the kept tokens, -inf elsewhere."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import cached_llm, fixture_dir, greedy, two_sample_chi2
from jspec.speculative.draft_vocab import coverage, most_frequent_tokens

DENSE, MOE = "qwen3_dense", "qwen3_moe"
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(0, 384, size=n).tolist() for n in (4, 11, 2, 7, 9)]


def _subset(name: str, size: int, seed: int) -> tuple[int, ...]:
  vocab = cached_llm(name).config.vocab_size
  return tuple(int(t) for t in np.random.default_rng(seed).permutation(vocab)[:size])


@functools.lru_cache(maxsize=None)
def _head_llm(name: str, draft_vocab=None) -> jspec.LLM:
  """The fixtures (untied lm_head; DeepSeek layout) and the demo model (tied embeddings)."""
  path = jspec.demo_model_path() if name == "demo" else fixture_dir(name)
  return jspec.LLM(model=path, dtype="float32", max_model_len=64, speculative_config={
      "method": "mtp", "num_speculative_tokens": 2, "draft_vocab": draft_vocab})


@pytest.mark.parametrize("name", [DENSE, MOE, "demo"])
def test_restricted_logits_are_the_full_logits_on_kept_tokens(name):
  full = _head_llm(name)
  ids = tuple(int(t) for t in np.random.default_rng(1).permutation(full.config.vocab_size)[:40])
  restricted = _head_llm(name, ids)
  normed = jax.random.normal(jax.random.key(3), (3, 5, full.config.hidden_size), jnp.float32)
  want = np.asarray(full.mtp.layers[0].logits(full.target, normed))
  got = np.asarray(restricted.mtp.layers[0].logits(restricted.target, normed))
  kept = np.zeros(full.config.vocab_size, bool)
  kept[list(ids)] = True
  np.testing.assert_allclose(got[..., kept], want[..., kept], rtol=1e-6, atol=1e-6)
  assert np.all(got[..., ~kept] == -np.inf)
  # The head now holds only the kept columns: that slice is what a draft step reads.
  assert restricted.mtp.layers[0].draft_head[...].shape == (full.config.hidden_size, len(ids))


# Every size on the dense model (Qwen3-Next-layout MTP head); the MoE model's DeepSeek-layout
# head at the narrowest, one id (its restricted logits at 40 ids:
# test_restricted_logits_are_the_full_logits_on_kept_tokens). Each case compiles an LLM of
# its own: the draft vocabulary's size is in the programs' shapes.
@pytest.mark.parametrize("name, size", [(DENSE, 1), (DENSE, 50), (DENSE, 300), (MOE, 1)])
def test_greedy_output_equals_vanilla(name, size):
  want = [o.token_ids for o in cached_llm(name).generate(PROMPTS, greedy(20, ignore_eos=True))]
  llm = cached_llm(name, "mtp", 3, draft_vocab=_subset(name, size, size))
  outs = llm.generate(PROMPTS, greedy(20, ignore_eos=True))
  assert [o.token_ids for o in outs] == want


def test_drafts_come_only_from_the_draft_vocabulary():
  """With a vocabulary that excludes every token vanilla decoding emits, no draft can be
  accepted; with one that holds them all, the head proposes as freely as without one."""
  vanilla = cached_llm(DENSE).generate(PROMPTS, greedy(20, ignore_eos=True))
  emitted = {t for o in vanilla for t in o.token_ids}
  vocab = cached_llm(DENSE).config.vocab_size
  # 300 ids (of the 448 - at most 100 emitted): the size and k of
  # test_greedy_output_equals_vanilla's largest case, whose programs these LLMs share.
  outside = tuple(t for t in range(vocab) if t not in emitted)[:300]
  outs = cached_llm(DENSE, "mtp", 3, draft_vocab=outside).generate(
      PROMPTS, greedy(20, ignore_eos=True))
  assert outs.metrics.num_accepted_tokens == 0
  assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]


@pytest.mark.runs_programs_often
def test_sampling_with_a_draft_vocabulary_is_lossless():
  """The second token (the first decided by verification) has the same distribution with and
  without speculation when the head drafts from half the vocabulary."""
  # n = 1500 samples of one request: each sample draws from its own random stream, so the
  # samples are the same whatever the number of slots. Two slots draw them fastest on the CPU
  # (a step's cost grows with its rows; every sample is admitted anyway).
  params = jspec.SamplingParams(temperature=1.0, max_tokens=2, seed=0, n=1500, ignore_eos=True)
  second = lambda llm: np.array([c.token_ids[1]
                                 for c in llm.generate([[7, 8, 7, 8, 7, 8]], params)[0].outputs])
  ids = _subset(DENSE, 224, 5)
  a = second(cached_llm(DENSE, max_num_seqs=2))
  b = second(cached_llm(DENSE, "mtp", 2, draft_vocab=ids, max_num_seqs=2))
  stat, critical, dof = two_sample_chi2(a, b)
  assert dof >= 3 and stat < critical, (stat, critical, dof)


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngram", "draft_vocab": (1, 2)}, "draft_vocab restricts an MTP head"),
    ({"method": "mtp", "draft_vocab": ()}, "at least one token id"),
    ({"method": "mtp", "draft_vocab": (3, 3)}, "distinct"),
    ({"method": "mtp", "draft_vocab": (-1, 2)}, ">= 0"),
    ({"method": "mtp", "draft_vocab": (1, 448)}, r"token id 448 outside the vocabulary \[0, 448\)"),
])
def test_bad_draft_vocabularies_are_refused(spec, match):
  with pytest.raises(ValueError, match=match):
    jspec.LLM(model=fixture_dir(DENSE), dtype="float32", max_model_len=64,
              speculative_config={"num_speculative_tokens": 2, **spec})


@pytest.mark.parametrize("draft_tp", [None, 1])
def test_draft_vocabulary_of_any_size_on_tp_shards(draft_tp):
  """7 ids over 2 tp shards: sharded like the target, the draft head's slice is padded by
  repeating an id; replicated over tp, it is not split. Greedy output is vanilla's."""
  mesh = jspec.MeshConfig(dp=1, tp=2, ep=1)
  spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_vocab": tuple(range(7)),
          "draft_tp": draft_tp}
  llm = jspec.LLM(model=fixture_dir(DENSE), dtype="float32", max_model_len=64, mesh=mesh,
                  speculative_config=spec)
  want = cached_llm(DENSE).generate(PROMPTS[:2], greedy(12))
  assert [o.token_ids for o in llm.generate(PROMPTS[:2], greedy(12))] == [
      o.token_ids for o in want]


def test_most_frequent_tokens_and_coverage():
  streams = [[5, 5, 5, 2, 2, 9], np.array([[2, 5], [7, 5]])]
  assert most_frequent_tokens(streams, 3, 10) == (5, 2, 7)  # 7 and 9 tie: lower id first
  assert coverage(streams, (5, 2)) == pytest.approx(8 / 10)
  with pytest.raises(ValueError, match="outside"):
    most_frequent_tokens([[10]], 2, 10)
  with pytest.raises(ValueError, match="size=0"):
    most_frequent_tokens(streams, 0, 10)
