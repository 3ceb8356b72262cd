"""Loading a checkpoint directory: sharded indexes, converted checkpoints, and clear errors."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from helpers import cached_llm, fixture_dir

DENSE = "qwen3_dense"


def _copy_fixture(tmp_path, name=DENSE):
  out = tmp_path / name
  shutil.copytree(fixture_dir(name), out, symlinks=False)
  return out


def _rewrite_tensors(model_dir, edit):
  path = os.path.join(model_dir, "model.safetensors")
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path)


def _load(model_dir, **kwargs):
  return jspec.LLM(model=str(model_dir), dtype="float32", max_model_len=64, **kwargs)


def test_sharded_index_loads_like_single_file(tmp_path):
  out = _copy_fixture(tmp_path)
  tensors = load_file(os.path.join(out, "model.safetensors"))
  os.remove(os.path.join(out, "model.safetensors"))
  names = sorted(tensors)
  halves = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  weight_map = {}
  for fname, part in halves.items():
    save_file({n: tensors[n] for n in part}, os.path.join(out, fname))
    weight_map.update({n: fname for n in part})
  with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  seq = [[1, 2, 3, 4, 5]]
  np.testing.assert_array_equal(_load(out).compute_logits(seq)[0],
                                cached_llm(DENSE).compute_logits(seq)[0])


def test_converted_checkpoint_round_trip(tmp_path):
  from jspec.checkpoint import save_converted
  original = cached_llm("qwen3_moe")
  save_converted(original, str(tmp_path / "converted"))
  restored = _load(tmp_path / "converted", speculative_config={"method": "mtp",
                                                               "num_speculative_tokens": 2})
  assert restored.mtp_spec == original.mtp_spec
  seq = [[5, 6, 7, 8]]
  np.testing.assert_array_equal(restored.compute_logits(seq)[0], original.compute_logits(seq)[0])
  with pytest.raises(FileExistsError):
    save_converted(original, str(tmp_path / "converted"))


def test_converted_checkpoint_of_an_older_layout_is_refused(tmp_path):
  from jspec.checkpoint import LAYOUT_FILE, save_converted
  original = cached_llm(DENSE)  # dense MLPs: the fused gate_up parameter round-trips
  save_converted(original, str(tmp_path / "converted"))
  seq = [[5, 6, 7, 8]]
  np.testing.assert_array_equal(_load(tmp_path / "converted").compute_logits(seq)[0],
                                original.compute_logits(seq)[0])
  os.remove(tmp_path / "converted" / LAYOUT_FILE)  # as written before the layout was recorded
  with pytest.raises(ValueError, match="converted with parameter layout 1; .* run `jspec "
                                       "convert` again"):
    _load(tmp_path / "converted")


def test_missing_directory():
  with pytest.raises(FileNotFoundError, match="does not exist"):
    _load("/nonexistent/model")


def test_missing_config(tmp_path):
  out = _copy_fixture(tmp_path)
  os.remove(out / "config.json")
  with pytest.raises(FileNotFoundError, match="config.json"):
    _load(out)


def test_missing_weights(tmp_path):
  out = _copy_fixture(tmp_path)
  os.remove(out / "model.safetensors")
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    _load(out)


def test_unsupported_architecture_lists_supported(tmp_path):
  out = _copy_fixture(tmp_path)
  config = json.loads((out / "config.json").read_text())
  config["architectures"] = ["GemmaForCausalLM"]
  config["model_type"] = "gemma"
  (out / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="unsupported architecture.*Qwen3ForCausalLM"):
    _load(out)


def test_missing_tensor_is_named(tmp_path):
  out = _copy_fixture(tmp_path)
  _rewrite_tensors(out, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
  with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.1\.self_attn\.k_proj"):
    _load(out)


def test_unexpected_tensor_is_named(tmp_path):
  out = _copy_fixture(tmp_path)
  _rewrite_tensors(out, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
  with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.extra\.weight"):
    _load(out)


@pytest.mark.parametrize("bad, match", [
    (np.ones(63, np.float32), r"model\.norm\.weight.*shape \(63,\), expected \(64,\)"),
    (np.ones(64, np.int32), r"model\.norm\.weight.*dtype int32"),
])
def test_shape_or_dtype_mismatch_is_named(tmp_path, bad, match):
  out = _copy_fixture(tmp_path)
  _rewrite_tensors(out, lambda t: t.update({"model.norm.weight": bad}))
  with pytest.raises(ValueError, match=match):
    _load(out)


def test_truncated_safetensors(tmp_path):
  out = _copy_fixture(tmp_path)
  path = out / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match="truncated or corrupt"):
    _load(out)


def test_corrupt_header(tmp_path):
  out = _copy_fixture(tmp_path)
  (out / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
  with pytest.raises(ValueError, match="truncated or corrupt"):
    _load(out)


def test_no_tokenizer_means_token_ids_only():
  llm = cached_llm(DENSE)
  assert llm.tokenizer is None
  with pytest.raises(ValueError, match="has no tokenizer files; pass token ids"):
    llm.generate(["hello"])


def test_mtp_requested_without_mtp_weights():
  with pytest.raises(ValueError, match="needs MTP weights.*ngram"):
    _load(fixture_dir("qwen3_dense_tied_legacy"),
          speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_bad_dtype():
  with pytest.raises(ValueError, match="dtype='int8' is not supported"):
    jspec.LLM(model=fixture_dir(DENSE), dtype="int8")


@pytest.mark.parametrize("quantization, match", [
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": [48, 48]}, "FP8 blocks of 48 x 48 straddle attention heads of "
                                      "head_dim=32"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor scales"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [32, 32]},
     "activation_scheme 'static' is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq'"),
    ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
])
def test_quantized_checkpoint_is_refused_before_its_weights_are_read(tmp_path, quantization,
                                                                      match):
  out = _copy_fixture(tmp_path)
  config = json.loads((out / "config.json").read_text())
  config["quantization_config"] = quantization
  (out / "config.json").write_text(json.dumps(config))
  (out / "model.safetensors").write_bytes(b"not read")  # reading it would fail otherwise
  with pytest.raises(ValueError, match=match):
    _load(out)
