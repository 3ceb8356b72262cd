"""`jspec convert --quantize fp8` (jspec.quantize_fp8): unquantized checkpoints written as
fine-grained FP8 in the published layout (DeepSeek-V3 / R1, the Qwen FP8 releases).

The reference here is DeepSeek-V3's weight_quant written out block by block in NumPy, with
round-to-nearest-even onto e4m3 done against a table of every finite e4m3 value built from its
bit fields: per (out, in) block, scale = amax / 448, weight = the e4m3 nearest w / scale (a tie
to the even bit pattern)."""

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import jspec
from helpers import fixture_dir
from jspec import cli
from jspec.checkpoint import save_converted
from jspec.models.safetensors_index import SafetensorsIndex
from jspec.quantize_fp8 import quantize_block_fp8, quantize_checkpoint

PUBLISHED_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 3, 44, 44, 44, 44]]

# Positive finite e4m3fn values by bit pattern 0..0x7E (0x7F is NaN): 4 exponent bits (bias 7),
# 3 mantissa bits, subnormals at exponent 0.
_E4M3_BITS = np.arange(0x7F)
_E4M3_VALUES = np.where(_E4M3_BITS >> 3 == 0, (_E4M3_BITS & 7) / 8 * 2.0 ** -6,
                        (1 + (_E4M3_BITS & 7) / 8) * 2.0 ** ((_E4M3_BITS >> 3) - 7))


def _round_to_e4m3_bits(x: np.ndarray) -> np.ndarray:
  """Round-to-nearest-even of float32 values (|x| <= 448) onto e4m3fn, as uint8 bit patterns."""
  mag = np.abs(x.astype(np.float64)).ravel()
  hi = np.clip(np.searchsorted(_E4M3_VALUES, mag), 1, len(_E4M3_VALUES) - 1)
  lo = hi - 1
  d_lo, d_hi = mag - _E4M3_VALUES[lo], _E4M3_VALUES[hi] - mag
  bits = np.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)
  bits = np.where(mag >= _E4M3_VALUES[-1], len(_E4M3_VALUES) - 1, bits)
  return (bits | (np.signbit(x.ravel()) << 7)).astype(np.uint8).reshape(x.shape)


def _recipe(w_OI: np.ndarray, block: int):
  """(e4m3 bit patterns [O, I], float32 scales [ceil(O / b), ceil(I / b)]), block by block."""
  w = w_OI.astype(np.float32)
  grid = (-(-w.shape[0] // block), -(-w.shape[1] // block))
  bits, scales = np.zeros(w.shape, np.uint8), np.zeros(grid, np.float32)
  for r in range(grid[0]):
    for c in range(grid[1]):
      rows, cols = slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block)
      scale = np.float32(max(np.abs(w[rows, cols]).max(), np.float32(1e-12))) / np.float32(448)
      bits[rows, cols] = _round_to_e4m3_bits(w[rows, cols] / scale)
      scales[r, c] = scale
  return bits, scales


def _tensors(model_dir) -> dict[str, np.ndarray]:
  index = SafetensorsIndex(str(model_dir))
  return {name: index.read(name) for name in index.names}


def _header_dtypes(path) -> dict[str, str]:
  with safe_open(str(path), framework="numpy") as f:
    return {name: f.get_slice(name).get_dtype() for name in f.keys()}


def _assert_published(source: dict, written: dict, dtypes: dict, quantized: dict[str, np.ndarray],
                      block: int):
  """Each quantized weight is the recipe's e4m3 [out, in] with its float32 scale_inv; every
  other written tensor is the source's, byte for byte."""
  for name, w in quantized.items():
    bits, scales = _recipe(w, block)
    assert dtypes[name] == "F8_E4M3" and written[name].shape == w.shape
    assert dtypes[name + "_scale_inv"] == "F32"
    np.testing.assert_array_equal(written[name].view(np.uint8), bits, err_msg=name)
    np.testing.assert_array_equal(written[name + "_scale_inv"], scales, err_msg=name)
  kept = set(written) - set(quantized) - {n + "_scale_inv" for n in quantized}
  assert kept == set(source) - set(quantized)
  for name in kept:
    assert written[name].dtype == source[name].dtype and written[name].shape == source[name].shape
    assert written[name].tobytes() == source[name].tobytes(), name


@pytest.mark.parametrize("shape, block", [((64, 96), 32), ((70, 45), 32), ((5, 3), 128),
                                          ((130, 257), 64)])
def test_blocks_are_deepseeks_weight_quant_with_partial_edge_blocks(shape, block):
  rng = np.random.default_rng(sum(shape) + block)
  w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(1e-3, 10, shape[1])
  w8, scale = quantize_block_fp8(w, (block, block))
  bits, want_scale = _recipe(w, block)
  assert w8.dtype == ml_dtypes.float8_e4m3fn and w8.shape == shape
  assert scale.dtype == np.float32 and scale.shape == want_scale.shape
  np.testing.assert_array_equal(scale, want_scale)
  np.testing.assert_array_equal(w8.view(np.uint8), bits)


def test_each_blocks_largest_value_maps_to_448_and_an_all_zero_block_to_zeros():
  w = np.zeros((64, 64), np.float32)
  w[:32, :32] = np.random.default_rng(0).standard_normal((32, 32))
  w8, scale = quantize_block_fp8(w, (32, 32))
  assert np.abs(w8[:32, :32].astype(np.float32)).max() == 448.0
  assert np.isfinite(scale).all() and not w8[32:].astype(np.float32).any()


def test_ties_round_to_the_even_e4m3_value():
  # amax 448 gives scale 1: the values are rounded as they are. Between 16 and 32 e4m3 steps
  # by 2, so 17 and 19 are ties: to 16 (mantissa 000) and 20 (mantissa 010).
  w = np.array([[448.0, 17.0, 19.0, -17.0, 0.5]], np.float32)
  w8, scale = quantize_block_fp8(w, (1, 8))
  assert scale.tolist() == [[1.0]]
  assert w8.astype(np.float32).tolist() == [[448.0, 16.0, 20.0, -16.0, 0.5]]


def test_deepseek_checkpoint_in_the_published_layout(tmp_path):
  """MLA, routed and shared experts, dense first layers and the NextN layer: every projection
  e4m3 with its scale, the router, correction bias, norms, embeddings, heads and eh_proj kept."""
  src = fixture_dir("deepseek_v3")
  summary = quantize_checkpoint(src, str(tmp_path / "fp8"), block_size=32)
  source, written = _tensors(src), _tensors(tmp_path / "fp8")
  suffixes = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
              "kv_b_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
              "down_proj.weight")
  quantized = {n: w for n, w in source.items() if n.endswith(suffixes)}
  assert {n.rsplit(".", 2)[-2] for n in quantized} == {s.split(".")[0] for s in suffixes}
  assert any(".experts." in n for n in quantized) and any(".shared_experts." in n
                                                          for n in quantized)
  assert any(n.startswith("model.layers.3.") for n in quantized)  # the NextN layer
  assert summary.quantized == len(quantized) and summary.files == 1
  _assert_published(source, written, _header_dtypes(tmp_path / "fp8" / "model.safetensors"),
                    quantized, 32)
  config = json.loads((tmp_path / "fp8" / "config.json").read_text())
  qc = config.pop("quantization_config")
  assert {k: qc[k] for k in PUBLISHED_CONFIG} == PUBLISHED_CONFIG
  assert qc["weight_block_size"] == [32, 32]
  assert {"lm_head", "model.embed_tokens", "model.layers.1.mlp.gate", "model.layers.3.eh_proj",
          "model.layers.3.shared_head.head"} <= set(qc["modules_to_not_convert"])
  assert not any(m + ".weight" in quantized for m in qc["modules_to_not_convert"])
  assert config == json.loads(open(os.path.join(src, "config.json")).read())
  assert (tmp_path / "fp8" / "generation_config.json").read_bytes() == open(
      os.path.join(src, "generation_config.json"), "rb").read()


def test_fused_experts_are_written_per_expert_and_linear_attention_parts_kept(tmp_path):
  """Qwen3.5-MoE as transformers saves it (experts fused [E, 2F, D], gate rows first) in the
  per-expert layout of the Qwen FP8 releases; Gated DeltaNet's in_proj_qkv / in_proj_z /
  out_proj quantized, its A_log, conv1d, dt_bias, in_proj_a, in_proj_b kept; the vision tower
  kept."""
  src = fixture_dir("qwen3_5_moe")
  quantize_checkpoint(src, str(tmp_path / "fp8"), block_size=32)
  source, written = _tensors(src), _tensors(tmp_path / "fp8")
  p = "model.language_model.layers.0."
  unfused = {}
  for fused in [n for n in source if n.endswith("mlp.experts.gate_up_proj")]:
    prefix = fused.removesuffix("gate_up_proj")
    gate_up, down = source.pop(fused), source.pop(prefix + "down_proj")
    f = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
      unfused[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :f]
      unfused[f"{prefix}{e}.up_proj.weight"] = gate_up[e, f:]
      unfused[f"{prefix}{e}.down_proj.weight"] = down[e]
  assert any(n.startswith("mtp.") for n in unfused) and len(unfused) > 3 * 8
  source.update(unfused)
  linear = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
            "linear_attn.out_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "shared_expert.gate_proj.weight",
            "shared_expert.up_proj.weight", "shared_expert.down_proj.weight")
  quantized = {n: w for n, w in source.items() if n.endswith(linear) or n in unfused}
  _assert_published(source, written, _header_dtypes(tmp_path / "fp8" / "model.safetensors"),
                    quantized, 32)
  for kept in ("linear_attn.A_log", "linear_attn.conv1d.weight", "linear_attn.dt_bias",
               "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight",
               "mlp.gate.weight", "mlp.shared_expert_gate.weight"):
    assert p + kept in written and p + kept + "_scale_inv" not in written
  assert not any(n.startswith("model.visual.") and n.endswith("_scale_inv") for n in written)
  modules = json.loads((tmp_path / "fp8" / "config.json").read_text())[
      "quantization_config"]["modules_to_not_convert"]
  assert {p + "linear_attn.in_proj_a", p + "linear_attn.in_proj_b", p + "mlp.gate",
          p + "mlp.shared_expert_gate", "mtp.fc"} <= set(modules)


def _sharded_bfloat16(model_dir, out):
  """`model_dir` in bfloat16, split over two files with an index json."""
  shutil.copytree(model_dir, out)
  os.remove(out / "model.safetensors")
  tensors = {n: w.astype(ml_dtypes.bfloat16) for n, w in _tensors(model_dir).items()}
  names = sorted(tensors)
  files = {"model-00001-of-00002.safetensors": names[::2],
           "model-00002-of-00002.safetensors": names[1::2]}
  for fname, part in files.items():
    save_file({n: tensors[n] for n in part}, str(out / fname), metadata={"format": "pt"})
  weight_map = {n: fname for fname, part in files.items() for n in part}
  (out / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
       "weight_map": weight_map}))
  return tensors, weight_map


def test_a_sharded_bfloat16_checkpoint_gives_the_same_shards_and_an_index(tmp_path):
  source, source_map = _sharded_bfloat16(fixture_dir("llama3"), tmp_path / "bf16")
  quantize_checkpoint(str(tmp_path / "bf16"), str(tmp_path / "fp8"), block_size=32)
  index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())
  written = _tensors(tmp_path / "fp8")
  assert set(index["weight_map"]) == set(written)
  for name, fname in index["weight_map"].items():
    assert fname == source_map[name.removesuffix("_scale_inv")]
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in written.values())
  quantized = {n: w for n, w in source.items() if n.endswith("_proj.weight")}
  assert len(quantized) == 7 * 2
  dtypes = {}
  for fname in set(source_map.values()):
    dtypes.update(_header_dtypes(tmp_path / "fp8" / fname))
  _assert_published(source, written, dtypes, quantized, 32)
  assert not (tmp_path / "fp8" / "model.safetensors").exists()


def _dequantized(fp8_dir, out, block):
  """The FP8 checkpoint with each weight replaced by e4m3 x its block scale (float32, exact)."""
  shutil.copytree(fp8_dir, out)
  tensors = _tensors(fp8_dir)
  plain = {}
  for name, value in tensors.items():
    if name.endswith("_scale_inv"):
      continue
    if name + "_scale_inv" in tensors:
      scale = tensors[name + "_scale_inv"]
      full = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)
      value = value.astype(np.float32) * full[:value.shape[0], :value.shape[1]]
    plain[name] = value
  save_file(plain, str(out / "model.safetensors"))
  config = json.loads((out / "config.json").read_text())
  del config["quantization_config"]
  (out / "config.json").write_text(json.dumps(config))
  return str(out)


def _greedy(model_dir, prompts=PROMPTS, **kwargs):
  llm = jspec.LLM(model=str(model_dir), dtype="float32", max_model_len=32, max_num_seqs=4,
                  **kwargs)
  params = jspec.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
  return llm, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_cli_quantized_qwen3_generates_the_dequantized_tokens_and_stays_fp8_in_orbax(
    tmp_path, capsys):
  fp8_dir = tmp_path / "fp8"
  assert cli.main(["convert", "--model", fixture_dir("qwen3_dense"), "--out", str(fp8_dir),
                   "--quantize", "fp8", "--block-size", "32"]) == 0
  assert "28 FP8 weights" in capsys.readouterr().out  # 7 projections x (3 layers + MTP)
  mtp = {"method": "mtp", "num_speculative_tokens": 2}
  fp8, tokens = _greedy(fp8_dir, speculative_config=mtp)
  assert fp8.target.layers[0].attn.q_proj[...].dtype == ml_dtypes.float8_e4m3fn
  # Greedy MTP speculation over the FP8 model gives the dequantized model's vanilla tokens.
  assert tokens == _greedy(_dequantized(fp8_dir, tmp_path / "dequantized", 32))[1]
  # jspec's own orbax format keeps the e4m3 weights and their scales as they are.
  save_converted(fp8, str(tmp_path / "orbax"))
  restored = jspec.LLM(model=str(tmp_path / "orbax"), dtype="float32", max_model_len=32,
                       max_num_seqs=4, speculative_config=mtp)
  for module, want in ((restored.target, fp8.target), (restored.mtp, fp8.mtp)):
    got_leaves, want_leaves = jax.tree.leaves(nnx.state(module)), jax.tree.leaves(
        nnx.state(want))
    assert len(got_leaves) == len(want_leaves)
    for got, want_leaf in zip(got_leaves, want_leaves):
      assert got.dtype == want_leaf.dtype
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want_leaf))
  assert restored.mtp.layers[0].decoder.attn.q_proj[...].dtype == ml_dtypes.float8_e4m3fn


def test_quantized_llama_generates_the_dequantized_tokens(tmp_path):
  quantize_checkpoint(fixture_dir("llama3"), str(tmp_path / "fp8"), block_size=32)
  assert _greedy(tmp_path / "fp8")[1] == _greedy(
      _dequantized(tmp_path / "fp8", tmp_path / "dequantized", 32))[1]


def test_an_already_quantized_source_is_refused(tmp_path):
  quantize_checkpoint(fixture_dir("llama3"), str(tmp_path / "fp8"), block_size=32)
  with pytest.raises(ValueError, match="already quantized .*quant_method 'fp8'"):
    quantize_checkpoint(str(tmp_path / "fp8"), str(tmp_path / "again"))
  config = json.loads((tmp_path / "fp8" / "config.json").read_text())
  del config["quantization_config"]
  (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="holds quantized tensors .* declares no quantization"):
    quantize_checkpoint(str(tmp_path / "fp8"), str(tmp_path / "again"))
  assert not (tmp_path / "again").exists()


def test_a_non_empty_output_directory_is_refused(tmp_path):
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "notes.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="exists and is not empty"):
    quantize_checkpoint(fixture_dir("llama3"), str(tmp_path / "out"))
  assert os.listdir(tmp_path / "out") == ["notes.txt"]


@pytest.mark.parametrize("block_size", [0, -128])
def test_a_block_size_that_is_not_positive_is_refused(tmp_path, capsys, block_size):
  assert cli.main(["convert", "--model", fixture_dir("llama3"), "--out", str(tmp_path / "out"),
                   "--quantize", "fp8", "--block-size", str(block_size)]) == 2
  assert f"block size must be a positive integer, got {block_size}" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def test_block_size_without_quantize_is_refused(tmp_path, capsys):
  assert cli.main(["convert", "--model", fixture_dir("llama3"), "--out", str(tmp_path / "out"),
                   "--block-size", "64"]) == 2
  assert "--block-size is the FP8 block of --quantize fp8" in capsys.readouterr().err


def test_the_written_weights_take_the_umasks_mode(tmp_path):
  """safetensors writes its files 0600; a converted checkpoint is readable as any file the
  user writes (here: umask 022 -> 0644)."""
  from jspec.quantize_fp8 import quantize_checkpoint
  previous = os.umask(0o022)
  try:
    quantize_checkpoint(fixture_dir("qwen3_dense"), str(tmp_path / "fp8"), 32)
  finally:
    os.umask(previous)
  weights = [f for f in os.listdir(tmp_path / "fp8") if f.endswith(".safetensors")]
  assert weights
  for name in weights:
    assert os.stat(tmp_path / "fp8" / name).st_mode & 0o777 == 0o644
