"""jspec's forward passes equal transformers' (torch) on the committed tiny checkpoints.

References come from scripts/make_fixtures.py; fp32 on CPU, max abs logit error <= 1e-4.
"""

import numpy as np
import pytest

from helpers import (FIXTURE_NAMES, assert_mtp_layer_matches_reference, cached_llm, greedy,
                     reference)

TOL = 1e-4


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_logits_match_transformers(name):
  ref = reference(name)
  llm = cached_llm(name)
  seqs = [ref[f"seq_{i}"].tolist() for i in range(3)]
  for i, logits in enumerate(llm.compute_logits(seqs)):
    assert logits.dtype == np.float32 and logits.shape == ref[f"logits_{i}"].shape
    np.testing.assert_allclose(logits, ref[f"logits_{i}"], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_greedy_generate_matches_transformers(name):
  ref = reference(name)
  llm = cached_llm(name)
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
  outs = llm.generate(prompts, greedy(24))
  for i, out in enumerate(outs):
    assert out.token_ids == ref[f"gen_{i}"].tolist()
    stopped_on_eos = bool(ref[f"gen_stopped_on_eos_{i}"])
    assert out.finish_reason == ("stop" if stopped_on_eos else "length")
  outs = llm.generate(prompts, greedy(24, ignore_eos=True))
  for i, out in enumerate(outs):
    assert out.token_ids == ref[f"gen_noeos_{i}"].tolist()
    assert out.finish_reason == "length" and len(out.token_ids) == 24


@pytest.mark.parametrize("name", ["qwen3_dense", "qwen3_moe"])
def test_mtp_head_matches_torch_reference(name):
  """The MTP layer on the target's post-norm hidden states, against the torch-built reference."""
  assert_mtp_layer_matches_reference(cached_llm(name), reference(name), TOL)


def test_compute_logits_in_prefill_chunks_equals_one_pass():
  import jspec
  from helpers import fixture_dir
  seq = [list(range(3, 73)), list(range(100, 123))]  # bucket capped at max_model_len=100
  one_pass = cached_llm("qwen3_moe").compute_logits(seq)
  chunked = jspec.LLM(model=fixture_dir("qwen3_moe"), dtype="float32", max_model_len=100,
                      prefill_chunk_size=16).compute_logits(seq)
  for a, b in zip(chunked, one_pass):
    np.testing.assert_allclose(a, b, atol=TOL, rtol=0)  # same math, other matmul shapes
