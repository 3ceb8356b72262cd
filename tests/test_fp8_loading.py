"""Fine-grained FP8 checkpoints (jspec.models.quantization): e4m3 projection weights with one
float32 `weight_scale_inv` per block, loaded as they are and multiplied by their scales inside
the product.

The FP8 checkpoint here is the qwen3_dense fixture quantized by DeepSeek-V3's published recipe
(per block: scale = amax / 448, weight = round-to-e4m3(w / scale)), written in the published
layout with safetensors; its reference is the same model with each weight dequantized
(e4m3 value x its block's scale, in float32) and written as a plain checkpoint, which the
loader reads through the path the transformers parity tests check."""

import dataclasses
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from helpers import fixture_dir, greedy_token_ids
from jspec.models.hf_config import config_from_dir
from jspec.models.safetensors_index import SafetensorsIndex
from jspec.sharding.plan import validate_mesh

BLOCK = (32, 32)  # (out, in): the fixture's head_dim is 32, its hidden size 64
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 3, 44, 44, 44, 44]]


def _quantize(w_OI: np.ndarray, block=BLOCK):
  """(e4m3 weight, float32 scale_inv [out / b, in / b]) by DeepSeek-V3's weight_quant."""
  (o, i), (bo, bi) = w_OI.shape, block
  blocks = w_OI.astype(np.float32).reshape(o // bo, bo, i // bi, bi)
  scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0
  w8 = (blocks / scale[:, None, :, None]).astype(ml_dtypes.float8_e4m3fn).reshape(o, i)
  return w8, scale.astype(np.float32)


def _dequantize(w8, scale, block=BLOCK):
  return (w8.astype(np.float32)
          * np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1))


def _is_projection(name: str) -> bool:
  return name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))


def _write_checkpoints(root, name: str):
  """(FP8 directory, its dequantized twin) from the fixture `name`."""
  fp8_dir, plain_dir = root / "fp8", root / "dequantized"
  shutil.copytree(fixture_dir(name), fp8_dir)
  shutil.copytree(fixture_dir(name), plain_dir)
  tensors = load_file(str(fp8_dir / "model.safetensors"))
  fp8, plain = {}, {}
  for tensor_name, value in tensors.items():
    if _is_projection(tensor_name):
      w8, scale = _quantize(value)
      fp8[tensor_name], fp8[tensor_name + "_scale_inv"] = w8, scale
      plain[tensor_name] = _dequantize(w8, scale)
    else:
      fp8[tensor_name] = plain[tensor_name] = value
  save_file(fp8, str(fp8_dir / "model.safetensors"))
  save_file(plain, str(plain_dir / "model.safetensors"))
  config = json.loads((fp8_dir / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "dynamic",
                                   "weight_block_size": list(BLOCK)}
  (fp8_dir / "config.json").write_text(json.dumps(config))
  return str(fp8_dir), str(plain_dir), sum(_is_projection(n) for n in tensors)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """The qwen3_dense fixture (with its MTP head) in FP8, and dequantized."""
  fp8_dir, plain_dir, quantized = _write_checkpoints(tmp_path_factory.mktemp("fp8"),
                                                     "qwen3_dense")
  assert quantized == 7 * 4  # 3 layers + the MTP layer
  return fp8_dir, plain_dir


def _llm(model_dir, **kwargs):
  return jspec.LLM(model=model_dir, dtype="float32", max_model_len=64, max_num_seqs=4,
                   **kwargs)


def test_fp8_weights_stay_fp8_and_give_the_dequantized_logits(checkpoints):
  fp8_dir, plain_dir = checkpoints
  fp8, plain = _llm(fp8_dir), _llm(plain_dir)
  attn = fp8.target.layers[0].attn
  assert attn.q_proj[...].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
  # Kept in the checkpoint's [out, in] order: q_proj [N, H, D], its scales [N, H / b, D / b].
  assert attn.q_proj[...].shape == (4, 32, 64)
  assert attn.q_proj_scale[...].shape == (4, 32 // 32, 64 // 32)
  assert fp8.target.layers[0].mlp.down_proj[...].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
  for got, want in zip(fp8.compute_logits(PROMPTS), plain.compute_logits(PROMPTS)):
    # The same float32 weights (e4m3 x scale is exact in float32), multiplied in a fused
    # program instead of read: equal up to float32 summation order.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fp8_llama_gives_the_dequantized_logits(tmp_path):
  fp8_dir, plain_dir, quantized = _write_checkpoints(tmp_path, "llama3")
  assert quantized == 7 * 2
  for got, want in zip(_llm(fp8_dir).compute_logits(PROMPTS),
                       _llm(plain_dir).compute_logits(PROMPTS)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fp8_generation_equals_the_dequantized_model_and_mtp_equals_vanilla(checkpoints):
  fp8_dir, plain_dir = checkpoints
  want = greedy_token_ids(_llm(plain_dir), PROMPTS, 12)
  vanilla = greedy_token_ids(_llm(fp8_dir), PROMPTS, 12)
  mtp = _llm(fp8_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
  assert mtp.mtp.layers[0].decoder.attn.q_proj[...].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
  speculated = greedy_token_ids(mtp, PROMPTS, 12)
  assert vanilla == want and speculated == vanilla


@pytest.mark.parametrize("mesh", [jspec.MeshConfig(tp=2), jspec.MeshConfig(dp=2, tp=2)])
def test_fp8_on_a_mesh_gives_one_devices_tokens(checkpoints, mesh):
  one = greedy_token_ids(_llm(checkpoints[0]), PROMPTS, 8)
  sharded = _llm(checkpoints[0], mesh=mesh)
  assert greedy_token_ids(sharded, PROMPTS, 8) == one


def test_fp8_tensors_without_the_config_are_refused(checkpoints, tmp_path):
  out = tmp_path / "mislabelled"
  shutil.copytree(checkpoints[0], out)
  config = json.loads((out / "config.json").read_text())
  del config["quantization_config"]
  (out / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="weight_scale_inv are FP8 block scales"):
    _llm(str(out))
  # Without their scales too, the e4m3 weights themselves are refused, not read as values.
  index = SafetensorsIndex(str(out))  # safetensors' NumPy reader has no float8
  kept = {n: index.read(n) for n in index.names if not n.endswith("_scale_inv")}
  save_file(kept, str(out / "model.safetensors"))
  with pytest.raises(ValueError, match="float8_e4m3fn; jspec expects an unquantized one"):
    _llm(str(out))


def test_fp8_mesh_that_would_split_a_block_is_refused(checkpoints):
  # An intermediate size of 3 blocks of 32: tp = 2 divides its 96 columns, not its blocks.
  cfg = dataclasses.replace(config_from_dir(checkpoints[0]), intermediate_size=96)
  validate_mesh(dataclasses.replace(cfg, fp8_block=None), jspec.MeshConfig(tp=2))
  with pytest.raises(ValueError, match="tp=2 must divide intermediate_size / FP8 block 32=3"):
    validate_mesh(cfg, jspec.MeshConfig(tp=2))


@pytest.mark.parametrize("field, value, message", [
    ("fmt", "e5m2", "FP8 weights in format 'e5m2' are not supported"),
    ("scale_fmt", "e8m0_packed", "block scales in format 'e8m0_packed' are not supported")])
def test_fp8_formats_other_than_e4m3_with_float32_scales_are_refused(checkpoints, tmp_path,
                                                                    field, value, message):
  out = tmp_path / "other_format"
  shutil.copytree(checkpoints[0], out)
  config = json.loads((out / "config.json").read_text())
  config["quantization_config"][field] = value
  (out / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=message):
    _llm(str(out))


def test_fp8_weights_stored_as_e5m2_are_refused_not_re_rounded(checkpoints, tmp_path):
  # The config says e4m3 but a weight is float8_e5m2: converting it would change its values.
  out = tmp_path / "e5m2"
  shutil.copytree(checkpoints[0], out)
  index = SafetensorsIndex(str(out))
  tensors = {n: index.read(n) for n in index.names}
  name = "model.layers.0.self_attn.q_proj.weight"
  tensors[name] = tensors[name].astype(ml_dtypes.float8_e5m2)
  save_file(tensors, str(out / "model.safetensors"))
  with pytest.raises(ValueError, match="float8_e5m2; jspec reads FP8 weights as float8_e4m3fn"):
    _llm(str(out))
