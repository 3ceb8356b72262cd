"""Every MoE backend computes the same layer; "pallas" runs the Mosaic GPU kernels (interpret
mode off-GPU) inside the jitted loop and gives the reference backend's greedy output."""

import numpy as np
import pytest

import jspec
from conftest import has_gpu
from helpers import fixture_dir, greedy

MOE = fixture_dir("qwen3_moe")
PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8]]
MTP2 = {"method": "mtp", "num_speculative_tokens": 2}


def _llm(backend, dtype="float32", spec=MTP2):
  return jspec.LLM(model=MOE, dtype=dtype, max_model_len=64, moe_backend=backend,
                   speculative_config=spec)


def _tokens(llm):
  # 6 tokens at k = 2: the prefill, the MTP layer's drafts and verify steps all run the
  # experts (interpreted off-GPU, where each step's kernels are the test's time).
  return [o.token_ids for o in llm.generate(PROMPTS, greedy(6, ignore_eos=True))]


@pytest.mark.skipif(has_gpu(), reason="fp32 on GPU falls back to ragged_dot; see the gpu test")
def test_pallas_backend_greedy_generation_equals_reference():
  assert _tokens(_llm("pallas")) == _tokens(_llm("reference"))


@pytest.mark.parametrize("backend", ["ragged_dot", "dense"])
def test_xla_backends_match_reference_logits(backend):
  seq = [PROMPTS[0] + PROMPTS[2]]
  want = _llm("reference", spec=None).compute_logits(seq)[0]
  np.testing.assert_allclose(_llm(backend, spec=None).compute_logits(seq)[0], want, atol=1e-4)


def test_auto_is_reference_off_hopper_and_names_are_checked():
  if not has_gpu():
    assert _llm("auto", spec=None).moe_backend == "reference"
  with pytest.raises(ValueError, match="moe_backend='triton' is not supported.*pallas"):
    _llm("triton")


@pytest.mark.gpu
def test_pallas_on_gpu_matches_reference_in_bf16():
  seq = [PROMPTS[0] + PROMPTS[2]]
  pallas, reference = _llm("pallas", "bfloat16"), _llm("reference", "bfloat16")
  assert pallas.moe_backend == "pallas"
  got, want = pallas.compute_logits(seq)[0], reference.compute_logits(seq)[0]
  np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
  assert [t[:1] for t in _tokens(pallas)] == [t[:1] for t in _tokens(reference)]
