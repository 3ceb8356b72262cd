"""Stop strings (SamplingParams.stop, jspec.stop_strings) on the demo model, which has a
tokenizer: a completion ends at the first token whose text completes a stop string, its text
before the string (or through it), as vLLM does."""

import pytest

import jspec
from helpers import fixture_dir

PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def llm():
  return jspec.LLM(model=jspec.demo_model_path(), max_model_len=128, max_num_seqs=2)


def _params(**kwargs):
  return jspec.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def free(llm):
  """The completion without stop strings, and the texts of its token prefixes."""
  out = llm.generate([PROMPT], _params(logprobs=1), use_tqdm=False)[0]
  assert len(out.text) > 30
  return out


@pytest.mark.parametrize("start, length", [(6, 3), (17, 5), (25, 1)])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_cuts_tokens_text_and_logprobs(llm, free, start, length, include):
  stop = free.text[start:start + length]
  index = free.text.find(stop)  # its first occurrence may start before `start`
  decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)
  out = llm.generate([PROMPT], _params(stop=[stop, "\x00never"], logprobs=1,
                                       include_stop_str_in_output=include), use_tqdm=False)[0]
  completion = out.outputs[0]
  assert completion.text == free.text[:index + (len(stop) if include else 0)]
  assert completion.finish_reason == "stop" and completion.stop_reason == stop
  k = len(completion.token_ids)
  assert completion.token_ids == free.token_ids[:k]
  # The last kept token completes the stop string; one fewer does not.
  assert stop in decode(completion.token_ids) and stop not in decode(completion.token_ids[:-1])
  assert len(completion.logprobs) == k
  assert completion.cumulative_logprob == pytest.approx(
      sum(lp[t].logprob for lp, t in zip(free.logprobs[:k], free.token_ids[:k])))


def test_a_stop_string_that_never_appears_changes_nothing(llm, free):
  out = llm.generate([PROMPT], _params(stop="\x00never", logprobs=1), use_tqdm=False)[0]
  assert out.token_ids == free.token_ids and out.text == free.text
  assert out.finish_reason == "length" and out.outputs[0].stop_reason is None


def test_stop_strings_are_checked_before_work():
  with pytest.raises(ValueError, match="stop=\\[''\\] must be a string or a list of non-empty"):
    jspec.SamplingParams(stop=[""])
  with pytest.raises(ValueError, match="stop=5 must be a string"):
    jspec.SamplingParams(stop=5)
  no_tokenizer = jspec.LLM(model=fixture_dir("qwen3_dense"), max_model_len=64, max_num_seqs=1)
  with pytest.raises(ValueError, match="stop strings need a tokenizer"):
    no_tokenizer.generate([[1, 2]], jspec.SamplingParams(stop="x"))
