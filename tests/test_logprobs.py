"""logprobs / prompt_logprobs: the target's raw log-softmax at each position, its rank and the
top-N alternatives, as vLLM returns them; checked against `compute_logits`."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import fixture_dir, greedy
from jspec.speculative.logprobs import token_logprobs

PROMPTS = [[5, 6, 7, 8, 9], [7, 8, 7, 8, 7, 8], list(range(3, 43))]


@functools.lru_cache(maxsize=None)
def _llm(method=None, k=0, name="qwen3_dense"):
  spec = None if method is None else {"method": method, "num_speculative_tokens": k}
  return jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=96, max_num_seqs=2,
                   prefill_chunk_size=16, speculative_config=spec)


def _log_softmax(logits):
  logits = logits.astype(np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _check(positions, tokens, reference_logits, num_top):
  """Each position's dict against the log-softmax of the reference logits there."""
  assert len(positions) == len(tokens)
  for entry, token, logits in zip(positions, tokens, reference_logits):
    logp = _log_softmax(logits)
    assert list(entry)[0] == token  # the chosen token first
    assert entry[token].logprob == pytest.approx(logp[token], abs=1e-4)
    assert entry[token].rank == int(np.sum(logp >= logp[token] - 1e-6))
    best = np.argsort(-logp, kind="stable")[:num_top]
    alternatives = [(t, lp) for t, lp in entry.items() if lp.rank <= num_top and t in best]
    assert sorted(t for t, _ in alternatives) == sorted(best.tolist())
    for t, lp in alternatives:
      assert lp.logprob == pytest.approx(logp[t], abs=1e-4) and lp.rank == list(best).index(t) + 1
    assert len(entry) in (num_top, num_top + 1)


@pytest.mark.parametrize("method, k", [(None, 0), ("mtp", 2), ("ngram", 3)])
def test_generated_logprobs_equal_the_targets_log_softmax(method, k):
  """Under speculation they come from the verify pass, equal to vanilla decoding's."""
  llm = _llm(method, k)
  outs = llm.generate(PROMPTS, greedy(12, ignore_eos=True, logprobs=3))
  for prompt, out in zip(PROMPTS, outs):
    logits = llm.compute_logits([prompt + out.token_ids])[0]
    # Generated token j was chosen from the logits at position len(prompt) - 1 + j.
    _check(out.logprobs, out.token_ids, logits[len(prompt) - 1:-1], 3)
    assert out.cumulative_logprob == pytest.approx(
        sum(out.logprobs[j][t].logprob for j, t in enumerate(out.token_ids)), abs=1e-6)
    assert all(lp[t].rank == 1 for lp, t in zip(out.logprobs, out.token_ids))  # greedy


def test_sampled_tokens_get_raw_logprobs_not_the_tempered_ones():
  llm = _llm()
  params = jspec.SamplingParams(temperature=1.7, max_tokens=8, seed=4, logprobs=0,
                                ignore_eos=True)
  out = llm.generate([PROMPTS[0]], params)[0]
  logits = llm.compute_logits([PROMPTS[0] + out.token_ids])[0][len(PROMPTS[0]) - 1:-1]
  for entry, token, row in zip(out.logprobs, out.token_ids, logits):
    assert list(entry) == [token]  # logprobs=0: the chosen token alone
    assert entry[token].logprob == pytest.approx(_log_softmax(row)[token], abs=1e-4)
  assert max(lp[t].rank for lp, t in zip(out.logprobs, out.token_ids)) > 1
  # Requests without logprobs beside one with: None, as vLLM.
  mixed = llm.generate([PROMPTS[0], PROMPTS[1]], [params, greedy(3)])
  assert mixed[1].logprobs is None and mixed[1].cumulative_logprob is None


def test_prompt_logprobs_in_chunks_equal_the_targets_log_softmax():
  """A 40-token prompt in 16-token chunks, logits 8 rows at a time."""
  llm = _llm()
  outs = llm.generate(PROMPTS, [greedy(2, prompt_logprobs=2), greedy(2),
                                greedy(2, prompt_logprobs=4)])
  assert outs[1].prompt_logprobs is None
  for i in (0, 2):
    prompt, got = PROMPTS[i], outs[i].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    logits = llm.compute_logits([prompt])[0]
    _check(got[1:], prompt[1:], logits[:-1], 2 if i == 0 else 4)


def test_decoded_tokens_come_from_the_tokenizer():
  llm = jspec.LLM(model=jspec.demo_model_path(), dtype="float32", max_model_len=64,
                  max_num_seqs=1)
  out = llm.generate(["In the beginning"], greedy(4, logprobs=1, prompt_logprobs=1))[0]
  decode = lambda t: llm.tokenizer.decode([t])
  for entry in out.logprobs + out.prompt_logprobs[1:]:
    assert all(lp.decoded_token == decode(t) for t, lp in entry.items())
  assert "".join(lp[t].decoded_token for lp, t in zip(out.logprobs, out.token_ids)) == out.text


def test_padded_vocabulary_columns_never_rank_or_appear():
  """Columns past the true vocabulary carry -inf logits (jspec.models.layers)."""
  logits = jnp.array([[2.0, 1.0, 3.0, -jnp.inf, -jnp.inf],
                      [0.0, 0.0, -1.0, -jnp.inf, -jnp.inf]])
  out = token_logprobs(logits, jnp.array([0, 2]), 3)
  assert out.rank_N.tolist() == [2, 3]
  assert out.top_ids_NX.tolist() == [[2, 0, 1], [0, 1, 2]]
  assert np.isfinite(np.asarray(out.top_logprobs_NX)).all()
  np.testing.assert_allclose(np.exp(np.asarray(out.top_logprobs_NX)).sum(-1), 1.0, rtol=1e-6)
