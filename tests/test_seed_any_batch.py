"""The seed promise, as users rely on it: a seeded sampled request gives the same tokens alone
and inside batches of mixed requests (other prompts, greedy and other seeds, other lengths),
including a batch larger than the slots (admitted mid-loop), for every drafter, in bfloat16
and float32, under both schedulers."""

import numpy as np
import pytest

import jspec
from drafter_checkpoints import eagle3_head, truncated_draft_model
from helpers import fixture_dir

RNG = np.random.default_rng(20261124)


def _prompts(vocab: int):
  return [RNG.integers(0, vocab, size=n).tolist() for n in (5, 2, 9, 4, 7, 3, 11, 6, 8)]


PROMPTS = {"qwen3_dense": _prompts(448), "llama3": _prompts(320)}


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
  root, llama = tmp_path_factory.mktemp("seed_drafters"), fixture_dir("llama3")
  return {"draft_model": truncated_draft_model(llama, str(root / "one_layer"), 1),
          "eagle3": eagle3_head(llama, str(root / "eagle3"), 96, aux_layer_ids=(0, 1, 1))}


# (target, drafter, dtype, scheduler): every drafter in bfloat16, MTP in float32 too (plain
# decoding in float32: tests/test_generate.py), the wave scheduler with MTP.
CASES = [("qwen3_dense", None, "bfloat16", "continuous"),
         ("qwen3_dense", "mtp", "bfloat16", "continuous"),
         ("qwen3_dense", "mtp", "float32", "continuous"),
         ("qwen3_dense", "ngram", "bfloat16", "continuous"),
         ("llama3", "draft_model", "bfloat16", "continuous"),
         ("llama3", "eagle3", "bfloat16", "continuous"),
         ("qwen3_dense", "mtp", "bfloat16", "waves")]


@pytest.mark.parametrize("target, drafter, dtype, batching", CASES)
def test_seeded_request_alone_equals_it_in_any_batch(target, drafter, dtype, batching,
                                                     drafters):
  spec = None if drafter is None else {"method": drafter, "num_speculative_tokens": 2}
  if drafter in drafters:
    spec["model"] = drafters[drafter]
  llm = jspec.LLM(model=fixture_dir(target), dtype=dtype, max_model_len=64, max_num_seqs=4,
                  speculative_config=spec, batching=batching)
  prompts = PROMPTS[target]
  seeded = jspec.SamplingParams(temperature=0.9, top_p=0.95, max_tokens=14, seed=1234,
                                ignore_eos=True)
  alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].token_ids
  others = [jspec.SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True) if i % 2
            else jspec.SamplingParams(temperature=1.0, max_tokens=3 + 2 * i, seed=i,
                                      ignore_eos=True) for i in range(1, 9)]
  for size, place in ((3, 1), (9, 6)):  # 9 requests on 4 slots: admitted after others end
    batch = prompts[1:size]
    batch.insert(place, prompts[0])
    params = others[:size - 1]
    params.insert(place, seeded)
    out = llm.generate(batch, params, use_tqdm=False)
    assert out[place].token_ids == alone, f"batch of {size}"


@pytest.mark.gpu
def test_seeded_mtp_request_alone_equals_it_in_any_batch_on_gpu(drafters):
  """The same promise on the GPU's kernels and fusions: MTP in bfloat16, continuous batching."""
  test_seeded_request_alone_equals_it_in_any_batch("qwen3_dense", "mtp", "bfloat16",
                                                   "continuous", drafters)
