"""FP8 checkpoints quantized and written by transformers' own fine-grained FP8 classes
(tests/fixtures/*_fp8, made by scripts/fixture_fp8.py on a GPU): loaded as published, e4m3
weights with their float32 block scales, they give the logits of transformers' dequantized model
(float32) and its greedy tokens, and MTP speculation gives the tokens vanilla decoding gives.

Each case is named for its fixture directory; the hybrid Qwen3.5 / Qwen3-Next ones run alone with
`-k "qwen3_5_text_fp8 or qwen3_next_fp8"`, and are left out with
`-k "not qwen3_5_text_fp8 and not qwen3_next_fp8"`."""

import functools
import json
import os

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jspec
from helpers import FIXTURES, greedy_token_ids

# What the script makes first; the hybrid twins (qwen3_5_text_fp8, qwen3_next_fp8) are tested
# where present.
REQUIRED = ("qwen3_dense_fp8", "qwen3_moe_fp8", "deepseek_v3_fp8")
PRESENT = sorted(d for d in os.listdir(FIXTURES)
                 if d.endswith("_fp8") and os.path.isdir(os.path.join(FIXTURES, d)))
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
# Logits tolerance. Both sides multiply the same e4m3 values by the same float32 scales and run
# the same float32 model; what differs is rounding alone: the order of each dot product's float32
# sum (jspec multiplies a block's scale into its partial sum, transformers into each weight
# before summing), and the norm, softmax, RoPE and recurrence implementations. Each adds a few
# float32 ulps (6e-8 relative) per operation to logits of magnitude up to ~20 after 3 to 5 layers:
# measured here at most 2.0e-5 for attention, MLA and MoE, 3.7e-5 through Gated DeltaNet's
# recurrence, as the unquantized fixtures' parity tests see (test_parity.py 1e-4,
# test_hybrid.py 2e-4). 5x those, and 10x below the smallest top-1 / top-2 margin of any
# reference greedy step (> 2e-3, enforced by the script): a token can only differ where a logit
# is wrong.
TOL = 1e-4
LINEAR_ATTENTION_TOL = 2e-4


def test_the_transformers_fp8_fixtures_are_present():
  missing = [name for name in REQUIRED if name not in PRESENT]
  assert not missing, (f"tests/fixtures lacks {missing}: make them on a GPU machine with "
                       "`PYTHONPATH=. python3 scripts/fixture_fp8.py` (torch + transformers)")


def _reference(name):
  ref = np.load(os.path.join(FIXTURES, name, "reference.npz"))
  count = sum(key.startswith("prompt_") for key in ref.files)
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(count)]
  return ref, prompts


@functools.lru_cache(maxsize=None)
def _llm(name, mtp=False):
  # Waves batching: its programs compile in about 60% of the time continuous batching's take on
  # a CPU, and the scheduler is not what this file tests (test_continuous.py does).
  spec = {"method": "mtp", "num_speculative_tokens": 2} if mtp else None
  return jspec.LLM(model=os.path.join(FIXTURES, name), dtype="float32", max_model_len=64,
                   max_num_seqs=4, speculative_config=spec, batching="waves")


def _tolerance(name):
  with open(os.path.join(FIXTURES, name, "config.json")) as f:
    hybrid = "linear_attention" in (json.load(f).get("layer_types") or ())
  return LINEAR_ATTENTION_TOL if hybrid else TOL


def _e4m3_paths(module):
  return ["/".join(map(str, path)) for path, variable in nnx.to_flat_state(nnx.state(module))
          if np.dtype(variable.get_value().dtype) == E4M3]


@pytest.mark.parametrize("name", PRESENT)
def test_the_fixture_is_in_the_published_fp8_layout(name):
  with open(os.path.join(FIXTURES, name, "config.json")) as f:
    qc = json.load(f)["quantization_config"]
  assert qc["quant_method"] == "fp8" and qc["activation_scheme"] == "dynamic"
  block = tuple(qc["weight_block_size"])
  with open(os.path.join(FIXTURES, name, "model.safetensors"), "rb") as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
  header.pop("__metadata__", None)
  fp8 = {n for n, e in header.items() if e["dtype"] == "F8_E4M3"}
  # One float32 `weight_scale_inv` [ceil(out / b), ceil(in / b)] beside each e4m3 weight, and
  # no other scales (such as fused experts' `experts.gate_up_proj_scale_inv`).
  scales = {n for n in header if n.endswith("_scale_inv")}
  assert scales == {n + "_scale_inv" for n in fp8}, sorted(scales ^ {n + "_scale_inv" for n in fp8})
  for weight in fp8:
    rows, cols = header[weight]["shape"]
    grid = [-(-rows // block[0]), -(-cols // block[1])]
    scale = header[weight + "_scale_inv"]
    assert (scale["dtype"], scale["shape"]) == ("F32", grid), weight
  # Experts stored per expert, and the MTP / NextN layers' projections in e4m3 too.
  assert any(".experts.0." in n for n in fp8) or not any(".experts." in n for n in header)
  assert any(n.startswith(_mtp_prefix(name)) for n in fp8)


def _mtp_prefix(name):
  """Qwen3-Next's layout (`mtp.*`) or DeepSeek-V3's (`model.layers.{L}.*` onwards)."""
  with open(os.path.join(FIXTURES, name, "config.json")) as f:
    config = json.load(f)
  if "mtp_num_hidden_layers" in config:
    return "mtp."
  return f"model.layers.{config['num_hidden_layers']}."


@pytest.mark.parametrize("name", PRESENT)
def test_fp8_logits_and_greedy_choices_match_transformers_dequantized_reference(name):
  llm = _llm(name)
  # Held as the checkpoint's e4m3, not widened to float32 on loading.
  assert any("o_proj" in path for path in _e4m3_paths(llm.target))
  ref, prompts = _reference(name)
  sequences = [p + ref[f"gen_{i}"].tolist() for i, p in enumerate(prompts)]
  for i, logits in enumerate(llm.compute_logits(sequences)):
    np.testing.assert_allclose(logits, ref[f"logits_{i}"], rtol=0, atol=_tolerance(name))
    # Each greedy step's choice (the argmax after its prefix, without a cache, as the script
    # made the reference) is the reference's token.
    steps = logits[len(prompts[i]) - 1:-1]
    assert steps.argmax(-1).tolist() == ref[f"gen_{i}"].tolist()


@pytest.mark.parametrize("name", PRESENT)
def test_fp8_greedy_tokens_are_the_reference_and_mtp_speculation_gives_them_too(name):
  ref, prompts = _reference(name)
  want = [ref[f"gen_{i}"].tolist() for i in range(len(prompts))]
  vanilla = greedy_token_ids(_llm(name), prompts, len(want[0]))
  mtp = _llm(name, mtp=True)
  assert _e4m3_paths(mtp.mtp), "the MTP layers' projections are e4m3 too"
  speculated = greedy_token_ids(mtp, prompts, len(want[0]))
  assert vanilla == want and speculated == vanilla
