"""Generation semantics: request validation, finishing, batching and seeded sampling."""

import numpy as np
import pytest

import jspec
from helpers import cached_llm, fixture_dir, greedy

DENSE = "qwen3_dense"
PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [7, 7, 7, 7, 7, 7, 7, 7, 7], [100, 3, 44]]


@pytest.mark.parametrize("prompts, match", [
    ([], "prompts is empty"),
    ([[]], "prompt 0 is empty"),
    ([[1, 2], [9999]], r"prompt 1 has token ids \[9999\] outside the vocabulary \[0, 448\)"),
    ([[-1]], "outside the vocabulary"),
    ([[1.7, 2.2]], r"prompt 0 has token ids that are not integers: \[1.7, 2.2\]"),
    ([list(range(1, 65))], "prompt 0 has 64 tokens; max_model_len=64"),
    ([1, 2, 3], "wrap a single prompt in a list"),
])
def test_bad_prompts_raise_before_device_work(prompts, match):
  llm = jspec.LLM(model=cached_llm(DENSE).model_dir, dtype="float32", max_model_len=64)
  with pytest.raises(ValueError, match=match):
    llm.generate(prompts, greedy(4))
  assert not llm.scheduler.dispatch_programs  # nothing was compiled or run


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens=0 must be an integer >= 1"),
    (dict(temperature=-0.5), "temperature=-0.5 must be a number >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 must be a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be a number in \(0, 1\]"),
    (dict(top_k=-2), "top_k=-2 must be an integer >= 0"),
    (dict(top_k=2.5), "top_k=2.5 must be an integer >= 0"),
    (dict(stop_token_ids=5), r"stop_token_ids=5 must be a list of token ids.*\[5\]"),
    (dict(stop_token_ids=[1.5]), r"stop_token_ids=\[1.5\] must be a list of token ids"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids=\[-1\] must be a list of token ids"),
    (dict(stop_token_ids="7"), "stop_token_ids='7' must be a list of token ids"),
])
def test_bad_sampling_params(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jspec.SamplingParams(**kwargs)


def test_sampling_params_take_vllm_spellings():
  assert jspec.SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
  assert jspec.SamplingParams(stop_token_ids=[3, np.int64(4)]).stop_token_ids == (3, 4)


def test_too_many_speculative_tokens_are_refused_before_loading():
  with pytest.raises(ValueError, match=r"num_speculative_tokens=100 must be an integer in \[1, 16\]"):
    jspec.LLM(model="/nonexistent", speculative_config={"method": "ngram",
                                                        "num_speculative_tokens": 100})


@pytest.mark.parametrize("fixture, dtype", [("qwen3_dense", "float32"),
                                            ("demo", "bfloat16")])
def test_dtype_auto_is_the_checkpoints_own(fixture, dtype):
  model = jspec.demo_model_path() if fixture == "demo" else fixture_dir(fixture)
  llm = jspec.LLM(model=model, dtype="auto", max_model_len=64, max_num_seqs=2)
  assert llm.dtype == np.dtype(dtype)
  assert llm.target.embed[...].dtype == np.dtype(dtype)


def test_bad_ep_strategy_is_refused_on_any_mesh():
  with pytest.raises(ValueError, match="ep_strategy='bogus' is not supported"):
    jspec.LLM(model="/nonexistent", ep_strategy="bogus")


def test_sampling_params_count_must_match_prompts():
  with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
    cached_llm(DENSE).generate([[1], [2]], [greedy(3)])


def test_batched_greedy_equals_one_at_a_time():
  llm = cached_llm(DENSE)
  batched = llm.generate(PROMPTS, greedy(12, ignore_eos=True))
  for prompt, out in zip(PROMPTS, batched):
    alone = llm.generate([prompt], greedy(12, ignore_eos=True))[0]
    assert out.token_ids == alone.token_ids
    assert out.prompt_token_ids == prompt


def test_max_tokens_and_stop_ids_finish_exactly():
  llm = cached_llm(DENSE)
  full = llm.generate([PROMPTS[0]], greedy(20, ignore_eos=True))[0].token_ids
  for m in (1, 2, 7):
    out = llm.generate([PROMPTS[0]], greedy(m, ignore_eos=True))[0]
    assert out.token_ids == full[:m] and out.finish_reason == "length"
  stop = full[5]
  out = llm.generate([PROMPTS[0]], greedy(20, ignore_eos=True, stop_token_ids=[stop]))[0]
  assert out.token_ids == full[:full.index(stop) + 1] and out.finish_reason == "stop"


def test_max_model_len_finishes_with_length():
  """A request may fill max_model_len exactly (prompt + max_tokens); one more is refused."""
  llm = jspec.LLM(model=cached_llm(DENSE).model_dir, dtype="float32", max_model_len=12)
  out = llm.generate([PROMPTS[0]], greedy(12 - len(PROMPTS[0]), ignore_eos=True))[0]
  assert len(PROMPTS[0]) + len(out.token_ids) == 12 and out.finish_reason == "length"
  with pytest.raises(ValueError, match="exceed max_model_len=12"):
    llm.generate([PROMPTS[0]], greedy(13 - len(PROMPTS[0]), ignore_eos=True))


def test_long_continuations_move_to_a_larger_cache_bucket():
  llm = jspec.LLM(model=cached_llm(DENSE).model_dir, dtype="float32", max_model_len=256)
  short = llm.generate([PROMPTS[1]], greedy(20, ignore_eos=True))[0]
  long = llm.generate([PROMPTS[1]], greedy(200, ignore_eos=True))[0]
  assert len(long.token_ids) == 200 and long.token_ids[:20] == short.token_ids
  cache_lens = sorted(plan.loop.cache_len for plan, *_ in llm.scheduler.dispatch_programs)
  assert cache_lens[0] < cache_lens[-1] <= 256 + 1


def test_same_seed_same_output_regardless_of_batch():
  llm = cached_llm(DENSE)
  params = jspec.SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=16, seed=7,
                                ignore_eos=True)
  alone = llm.generate([PROMPTS[0]], params)[0].token_ids
  again = llm.generate([PROMPTS[0]], params)[0].token_ids
  in_batch = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]],
                          [greedy(5), params, params])[1].token_ids
  assert alone == again == in_batch
  other = llm.generate([PROMPTS[0]], jspec.SamplingParams(
      temperature=1.0, top_k=50, top_p=0.95, max_tokens=16, seed=8, ignore_eos=True))[0]
  assert other.token_ids != alone


def test_sampling_follows_the_model_distribution():
  """First sampled token frequencies match softmax(logits / T) over many seeded requests."""
  llm = cached_llm(DENSE)
  prompt = PROMPTS[3]
  logits = llm.compute_logits([prompt])[0][-1].astype(np.float64)
  temperature = 1.5
  probs = np.exp((logits - logits.max()) / temperature)
  probs /= probs.sum()
  n = 2000
  outs = llm.generate([prompt] * n, [jspec.SamplingParams(temperature=temperature, max_tokens=1,
                                                          seed=s) for s in range(n)])
  counts = np.bincount([o.token_ids[0] for o in outs], minlength=len(probs))
  top = np.argsort(probs)[::-1][:5]
  for token in top:  # each frequent token within 5 standard errors of its probability
    se = np.sqrt(probs[token] * (1 - probs[token]) / n)
    assert abs(counts[token] / n - probs[token]) < 5 * se + 1e-9


def test_outputs_are_in_prompt_order_with_metrics():
  llm = cached_llm(DENSE)
  outs = llm.generate(PROMPTS, greedy(6, ignore_eos=True))
  assert [o.prompt_token_ids for o in outs] == PROMPTS
  assert outs.metrics.num_generated_tokens == 6 * len(PROMPTS)
  for o in outs:
    assert o.metrics.num_steps == 5 and o.metrics.mean_acceptance_length == 1.0
    assert o.metrics.acceptance_rate_per_position == []


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 2}])
def test_temperature_only_request_is_reproducible_beside_top_p_requests(spec):
  llm = jspec.LLM(model=cached_llm(DENSE).model_dir, dtype="float32", max_model_len=64,
                  speculative_config=spec)
  plain = jspec.SamplingParams(temperature=0.9, max_tokens=12, seed=11, ignore_eos=True)
  nucleus = jspec.SamplingParams(temperature=0.9, top_p=0.7, max_tokens=12, seed=5)
  alone = llm.generate([PROMPTS[0]], plain)[0].token_ids
  mixed = llm.generate([PROMPTS[1], PROMPTS[0]], [nucleus, plain])[1].token_ids
  assert alone == mixed


def test_any_integer_seed_works_and_others_are_refused():
  llm = cached_llm(DENSE)
  sample = lambda seed: llm.generate([PROMPTS[0]], jspec.SamplingParams(
      temperature=1.0, max_tokens=6, seed=seed, ignore_eos=True))[0].token_ids
  assert sample(-1) == sample(2**32 - 1) and sample(2**40 + 3) == sample(3)
  with pytest.raises(ValueError, match="seed='7' must be an integer or None"):
    jspec.SamplingParams(seed="7")


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_chat_renders_the_template_and_generates_the_rendered_text():
  llm = jspec.LLM(model=jspec.demo_model_path(), max_model_len=128, max_num_seqs=2)
  conversations = [[{"role": "user", "content": "def add(a, b):"}],
                   [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "import os"}]]
  params = greedy(8)
  chatted = llm.chat(conversations, params, use_tqdm=False, chat_template=TEMPLATE)
  rendered = ["user: def add(a, b):\nassistant:", "system: Be brief.\nuser: import os\nassistant:"]
  direct = llm.generate(rendered, params, use_tqdm=False)
  assert [o.token_ids for o in chatted] == [o.token_ids for o in direct]
  one = llm.chat(conversations[0], params, use_tqdm=False, chat_template=TEMPLATE)
  assert len(one) == 1 and one[0].token_ids == chatted[0].token_ids
  with pytest.raises(ValueError, match="has no chat template; pass chat_template="):
    llm.chat(conversations[0], params)
  with pytest.raises(ValueError, match="conversation 0 must be a non-empty list"):
    llm.chat([[{"content": "no role"}]], params, chat_template=TEMPLATE)
