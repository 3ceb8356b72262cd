"""FP8 checkpoints that keep some projections unquantized and list them in the quantization
config's `modules_to_not_convert` (as FP8 releases and users' own quantizations do for
sensitive or odd-shaped weights): jspec builds those projections unquantized and the rest in
FP8, and gives the logits and tokens of the model whose every weight is dequantized.

Each checkpoint is a fixture written by `jspec convert --quantize fp8`, then chosen weights
multiplied back by their block scales (exact in float32) and listed (helpers.unquantize)."""

import json

import ml_dtypes
import numpy as np
import pytest

import jspec
from helpers import (assert_fp8_greedy_is_the_dequantized_models, fixture_dir, greedy_token_ids,
                     small_llm as _llm, unquantize)
from jspec.quantize_fp8 import quantize_checkpoint

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 3, 44, 44, 44, 44]]


def _checkpoints(name, block, tmp_path, kept):
  """(mixed: the weights `kept` accepts unquantized and listed, all dequantized)."""
  fp8 = tmp_path / "fp8"
  quantize_checkpoint(fixture_dir(name), str(fp8), block_size=block)
  return (unquantize(fp8, tmp_path / "mixed", block, kept),
          unquantize(fp8, tmp_path / "dequantized", block))


def _assert_same_model(mixed_dir, plain_dir, speculative=True):
  mixed, plain = _llm(mixed_dir), _llm(plain_dir)
  for got, want in zip(mixed.compute_logits(PROMPTS), plain.compute_logits(PROMPTS)):
    # The same float32 weights, scaled in the program or read: float32 summation order only.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  if speculative:
    assert_fp8_greedy_is_the_dequantized_models(mixed_dir, plain_dir, PROMPTS, 8)
  else:
    assert greedy_token_ids(mixed, PROMPTS, 8) == greedy_token_ids(plain, PROMPTS, 8)
  return mixed


def test_gqa_output_and_mlp_listed_load_unquantized(tmp_path):
  # o_proj and the whole MLP of every layer, the MTP layer's included.
  kept = lambda name: name.endswith(("self_attn.o_proj.weight", "mlp.gate_proj.weight",
                                     "mlp.up_proj.weight", "mlp.down_proj.weight"))
  mixed_dir, plain_dir = _checkpoints("qwen3_dense", 32, tmp_path, kept)
  listed = json.load(open(f"{mixed_dir}/config.json"))["quantization_config"][
      "modules_to_not_convert"]
  assert "model.layers.0.self_attn.o_proj" in listed and "mtp.layers.0.mlp.down_proj" in listed
  mixed = _assert_same_model(mixed_dir, plain_dir)
  attn, mlp = mixed.target.layers[0].attn, mixed.target.layers[0].mlp
  assert attn.q_proj[...].dtype == E4M3 and attn.k_proj[...].dtype == E4M3
  assert attn.o_proj[...].dtype == np.float32 and attn.o_proj_scale is None
  assert mlp.gate_up_proj[...].dtype == np.float32 and mlp.down_proj_scale is None


def test_mla_latent_projection_and_routed_experts_listed_load_unquantized(tmp_path):
  # DeepSeek-V3's kv_a_proj_with_mqa (576 rows, 4.5 blocks of 128) and the routed experts
  # kept unquantized; q, kv_b, o and the shared experts in FP8.
  kept = lambda name: name.endswith("kv_a_proj_with_mqa.weight") or ".mlp.experts." in name
  mixed_dir, plain_dir = _checkpoints("deepseek_v3", 16, tmp_path, kept)
  mixed = _assert_same_model(mixed_dir, plain_dir)
  layers = mixed.target.layers
  assert layers[0].attn.kv_a_proj[...].dtype == np.float32
  assert layers[0].attn.w_uk[...].dtype == E4M3 and layers[0].attn.o_proj[...].dtype == E4M3
  moe = next(layer.mlp for layer in layers if hasattr(layer.mlp, "w_gate"))
  assert moe.w_gate[...].dtype == np.float32 and moe.w_gate_scale is None
  assert moe.shared_experts.down_proj[...].dtype == E4M3


def test_linear_attention_listed_loads_unquantized(tmp_path):
  # Qwen3-Next's fused in_proj_qkvz kept, out_proj in FP8.
  kept = lambda name: name.endswith("linear_attn.in_proj_qkvz.weight")
  mixed_dir, plain_dir = _checkpoints("qwen3_next", 8, tmp_path, kept)
  mixed = _assert_same_model(mixed_dir, plain_dir, speculative=False)
  mixer = next(layer.linear_attn for layer in mixed.target.layers
               if layer.layer_type == "linear_attention")
  assert mixer.in_proj[...].dtype == np.float32 and mixer.out_proj[...].dtype == E4M3


def test_part_of_a_fused_matrix_listed_is_refused(tmp_path):
  # gate_proj without up_proj: jspec multiplies the two as one matrix, in one precision.
  fp8 = tmp_path / "fp8"
  quantize_checkpoint(fixture_dir("qwen3_dense"), str(fp8), block_size=32)
  config = json.load(open(fp8 / "config.json"))
  config["quantization_config"]["modules_to_not_convert"] = ["model.layers.1.mlp.gate_proj"]
  json.dump(config, open(fp8 / "config.json", "w"))
  with pytest.raises(ValueError, match="lists only part of model.layers.1's mlp.gate_up_proj"):
    _llm(str(fp8))


def test_a_projection_listed_in_some_layers_only_is_refused(tmp_path):
  kept = lambda name: name == "model.layers.1.self_attn.o_proj.weight"
  mixed_dir, _ = _checkpoints("qwen3_dense", 32, tmp_path, kept)
  with pytest.raises(ValueError, match="must list a projection in every layer or in none"):
    _llm(mixed_dir)
