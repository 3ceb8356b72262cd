"""FP8 checkpoints of the MoE and MLA families (DeepSeek-V3, GLM-4.7-Flash, GLM-4.5, Qwen3-MoE):
every projection the published FP8 releases quantize -- attention (MLA's q_a / q_b / kv_a /
kv_b / o included), dense MLPs, routed and shared experts, and the MTP / NextN layers' -- in
e4m3 with its block scales, loaded as published and giving the logits and tokens of the same
model with each weight dequantized.

The FP8 checkpoints are the repository's fixtures quantized here by DeepSeek-V3's recipe (per
block: scale = amax / 448, weight = round-to-e4m3(w / scale)), blocks smaller than the
published 128 so that the fixtures' small dimensions hold several, with partial blocks at the
edges (MLA's kv_a_proj_with_mqa rows: 40 = 2.5 blocks of 16) and blocks straddling heads (MLA's
q_b_proj: heads of 24 rows in blocks of 16), as DeepSeek-V3's 576 and 192 do against 128."""

import functools
import json
import re
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import jspec
from helpers import fixture_dir, greedy_token_ids, two_sample_chi2
from jspec.models.moe import MoE
from jspec.models.moe_backends import experts_reference

# Names the published FP8 releases keep in e4m3: every linear projection of decoder and MTP
# layers; never embeddings, lm_head, norms, routers or their biases, nor DeepSeek's MTP eh_proj.
QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|"
                       r"kv_b_proj|gate_proj|up_proj|down_proj)\.weight$")
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 3, 44, 44, 44, 44]]
# Blocks per fixture: GLM-4.7-Flash's of 8 let tp = 2 split its experts (16 rows) too.
FAMILIES = {"deepseek_v3": (16, 16), "glm4_moe_lite": (8, 8), "qwen3_moe": (32, 32),
            "glm4_moe": (16, 16)}


def _quantize(w_OI, block):
  """(e4m3 weight, float32 scale_inv [ceil(out / b), ceil(in / b)]): DeepSeek-V3's weight_quant,
  partial blocks at the edges."""
  (o, i), (bo, bi) = w_OI.shape, block
  go, gi = -(-o // bo), -(-i // bi)
  padded = np.zeros((go * bo, gi * bi), np.float32)
  padded[:o, :i] = w_OI
  blocks = padded.reshape(go, bo, gi, bi)
  scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0
  w8 = (blocks / scale[:, None, :, None]).astype(ml_dtypes.float8_e4m3fn)
  # Contiguous: safetensors writes a view's buffer as it lies, not its elements in order.
  return np.ascontiguousarray(w8.reshape(go * bo, gi * bi)[:o, :i]), scale.astype(np.float32)


def _dequantize(w8, scale, block):
  full = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)
  return w8.astype(np.float32) * full[:w8.shape[0], :w8.shape[1]]


def _write(root, name: str, block=None):
  """(FP8 directory, its dequantized twin, tensors quantized) from the fixture `name`."""
  block = block or FAMILIES[name]
  fp8_dir, plain_dir = root / "fp8", root / "dequantized"
  shutil.copytree(fixture_dir(name), fp8_dir)
  shutil.copytree(fixture_dir(name), plain_dir)
  fp8, plain, count = {}, {}, 0
  for tensor_name, value in load_file(str(fp8_dir / "model.safetensors")).items():
    if QUANTIZED.search(tensor_name):
      w8, scale = _quantize(value.astype(np.float32), block)
      fp8[tensor_name], fp8[tensor_name + "_scale_inv"] = w8, scale
      plain[tensor_name] = _dequantize(w8, scale, block)
      count += 1
    else:
      fp8[tensor_name] = plain[tensor_name] = value
  save_file(fp8, str(fp8_dir / "model.safetensors"))
  save_file(plain, str(plain_dir / "model.safetensors"))
  config = json.loads((fp8_dir / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "dynamic",
                                   "weight_block_size": list(block)}
  (fp8_dir / "config.json").write_text(json.dumps(config))
  return str(fp8_dir), str(plain_dir), count


def _llm(model_dir, max_num_seqs=4, **kwargs):
  return jspec.LLM(model=model_dir, dtype="float32", max_model_len=64,
                   max_num_seqs=max_num_seqs, **kwargs)


@functools.lru_cache(maxsize=None)  # the tests of one checkpoint share its LLMs and programs
def _shared_llm(model_dir, mtp: bool = False):
  spec = {"method": "mtp", "num_speculative_tokens": 2} if mtp else None
  return _llm(model_dir, speculative_config=spec)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
  return _write(tmp_path_factory.mktemp("deepseek_fp8"), "deepseek_v3")


def _is_e4m3(array) -> bool:
  return np.dtype(array.dtype) == np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fp8_family_gives_the_dequantized_logits(name, tmp_path):
  fp8_dir, plain_dir, count = _write(tmp_path, name)
  assert count > 0
  fp8 = _llm(fp8_dir)
  e4m3 = [path for path, leaf in _leaves(fp8.target) if _is_e4m3(leaf)]
  # Every expert stack and attention projection of the target is held in e4m3.
  assert any("w_down" in path for path in e4m3) and any("o_proj" in path for path in e4m3)
  for got, want in zip(fp8.compute_logits(PROMPTS), _llm(plain_dir).compute_logits(PROMPTS)):
    # e4m3 x scale is exact in float32: the same weights, multiplied in another order.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_blocks_holding_two_heads_and_a_partial_intermediate_block(tmp_path):
  """Llama's fixture in blocks of 64: each block row of q / k / v holds two heads of 32 (the
  heads are stored split, each with its block's scale), o_proj's input likewise, and the
  intermediate size of 96 leaves gate and up a partial block each. Scaled per axis, the
  weights are the checkpoint's."""
  fp8_dir, plain_dir, _ = _write(tmp_path, "llama3", block=(64, 64))
  for got, want in zip(_llm(fp8_dir).compute_logits(PROMPTS),
                       _llm(plain_dir).compute_logits(PROMPTS)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _leaves(module):
  return [("/".join(map(str, path)), variable.get_value())
          for path, variable in nnx.to_flat_state(nnx.state(module))]


def test_fp8_deepseek_mtp_equals_vanilla_and_the_dequantized_model(deepseek):
  fp8_dir, plain_dir, _ = deepseek
  want = greedy_token_ids(_llm(plain_dir), PROMPTS, 10)
  mtp = _shared_llm(fp8_dir, mtp=True)
  # The NextN layers' own projections and experts are e4m3 too.
  assert any(_is_e4m3(leaf) and "w_gate" in path for path, leaf in _leaves(mtp.mtp))
  vanilla = greedy_token_ids(_shared_llm(fp8_dir), PROMPTS, 10)
  speculated = greedy_token_ids(mtp, PROMPTS, 10)
  assert vanilla == want and speculated == vanilla


@pytest.mark.parametrize("mesh", [jspec.MeshConfig(ep=2), jspec.MeshConfig(dp=2, ep=2)])
def test_fp8_deepseek_on_a_mesh_gives_one_devices_tokens(deepseek, mesh):
  one = greedy_token_ids(_shared_llm(deepseek[0]), PROMPTS, 8)
  sharded = _llm(deepseek[0], mesh=mesh)
  assert greedy_token_ids(sharded, PROMPTS, 8) == one


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe_lite"])
def test_fp8_with_heads_and_experts_split_over_tp_gives_one_devices_tokens(name, tmp_path):
  fp8_dir, _, _ = _write(tmp_path, name)
  one = greedy_token_ids(_llm(fp8_dir), PROMPTS, 8)
  assert greedy_token_ids(_llm(fp8_dir, mesh=jspec.MeshConfig(tp=2, ep=2)), PROMPTS, 8) == one


def test_fp8_mesh_that_would_split_an_expert_block_is_refused(deepseek):
  # moe_intermediate_size 16 is one block of 16: tp = 2 would split it.
  with pytest.raises(ValueError, match="tp=2 must divide moe_intermediate_size / FP8 block"):
    _llm(deepseek[0], mesh=jspec.MeshConfig(tp=2))


def test_fp8_experts_gathered_for_few_tokens_give_the_full_computation(deepseek):
  """A step of fewer token copies than experts multiplies only its routed experts' scales
  (gathered); a wider step every expert's. A token's MoE output is the same either way."""
  llm = _shared_llm(deepseek[0])
  moe = next(node for _, node in nnx.iter_graph(llm.target) if isinstance(node, MoE))
  num_experts, top_k = moe.w_gate[...].shape[0], moe.top_k
  rng = np.random.default_rng(5)
  x_BTD = jnp.asarray(rng.standard_normal((1, num_experts, llm.config.hidden_size)),
                      jnp.float32)
  wide = moe(x_BTD, experts_reference)  # 16 tokens x top-k copies: every expert
  assert x_BTD.shape[1] * top_k >= num_experts
  for t in range(3):
    one = moe(x_BTD[:, t:t + 1], experts_reference)  # top-k copies < experts: gathered
    np.testing.assert_allclose(np.asarray(one[0, 0]), np.asarray(wide[0, t]), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.runs_programs_often
def test_fp8_deepseek_speculative_sampling_is_lossless(deepseek):
  """With temperature, the second generated token (the first decided by verification) has the
  same distribution with the FP8 model's NextN drafts as without: a two-sample chi-square on
  the top tokens, 1500 samples each (each its own random stream)."""
  params = jspec.SamplingParams(temperature=1.0, max_tokens=2, seed=0, n=1500, ignore_eos=True)
  second = lambda llm: np.array([c.token_ids[1] for c in llm.generate(
      [PROMPTS[2]], params, use_tqdm=False)[0].outputs])
  # The samples are the same on any number of slots; two draw them fastest on the CPU.
  vanilla = second(_llm(deepseek[0], max_num_seqs=2))
  speculated = second(_llm(deepseek[0], max_num_seqs=2,
                           speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
  stat, critical, dof = two_sample_chi2(vanilla, speculated)
  assert dof >= 3 and stat < critical, (stat, critical, dof)
