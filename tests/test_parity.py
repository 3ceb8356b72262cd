"""jspec's forward passes equal transformers' (torch) on the committed tiny checkpoints.

References come from scripts/make_fixtures.py; fp32 on CPU, max abs logit error <= 1e-4.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import FIXTURE_NAMES, cached_llm, greedy, reference
from jspec.models.moe_backends import experts_reference

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
  ref = reference(name)
  llm = cached_llm(name)

  @nnx.jit  # one program per window length, not ~170 op-by-op compiles
  def run(mtp, target, next_T, hidden_TD):
    n = next_T.shape[1]
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    layer = mtp.layers[0]
    normed, feedback, _ = layer(target, next_T, hidden_TD, positions,
                                mtp.init_caches(1, n, jnp.float32)[0], n, experts_reference)
    return layer.logits(target, normed), feedback

  for i in (1, 2):
    seq = ref[f"seq_{i}"]
    hidden_TD = jnp.asarray(ref[f"hidden_{i}"][:-1])[None]  # h_0 .. h_{n-1}
    next_T = jnp.asarray(seq[1:], jnp.int32)[None]          # t_1 .. t_n
    logits, feedback = run(llm.mtp, llm.target, next_T, hidden_TD)
    logits = np.asarray(logits)[0]
    np.testing.assert_allclose(logits, ref[f"mtp_logits_{i}"], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(feedback)[0], ref[f"mtp_hidden_{i}"], atol=TOL, rtol=0)


def test_compute_logits_in_prefill_chunks_equals_one_pass():
  import jspec
  from helpers import fixture_dir
  seq = [list(range(3, 73)), list(range(100, 123))]  # bucket capped at max_model_len=100
  one_pass = cached_llm("qwen3_moe").compute_logits(seq)
  chunked = jspec.LLM(model=fixture_dir("qwen3_moe"), dtype="float32", max_model_len=100,
                      prefill_chunk_size=16).compute_logits(seq)
  for a, b in zip(chunked, one_pass):
    np.testing.assert_allclose(a, b, atol=TOL, rtol=0)  # same math, other matmul shapes
