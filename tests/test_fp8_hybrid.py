"""FP8 checkpoints of the hybrid family (Qwen3.5 / Qwen3.6, Qwen3-Next): the layout the Qwen FP8
releases ship -- Gated DeltaNet's q / k / v / z (`in_proj_qkv` + `in_proj_z`, or Qwen3-Next's
fused `in_proj_qkvz`) and `out_proj` in e4m3 with block scales, `in_proj_a` / `in_proj_b` /
`in_proj_ba`, A_log, conv1d and dt_bias kept as they were -- beside e4m3 gated attention, dense
MLPs, routed and shared experts and the MTP layer's projections.

The FP8 checkpoints are the repository's fixtures written by `jspec convert --quantize fp8`
(DeepSeek-V3's recipe per block: scale = amax / 448, weight = round-to-e4m3(w / scale)) with
8 x 8 blocks, so that the fixtures' linear-attention heads (key 16, value 24 wide) hold whole
blocks as the published ones (128 wide, blocks of 128) do. The reference is each checkpoint
dequantized (e4m3 value x its block's scale, exact in float32) and written as a plain one."""

import ml_dtypes
import numpy as np
import pytest

import jspec
from helpers import (assert_fp8_greedy_is_the_dequantized_models, fixture_dir, greedy_token_ids,
                     small_llm as _llm, unquantize)
from jspec.quantize_fp8 import quantize_checkpoint

BLOCK = 8
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 3, 44, 44, 44, 44]]
# Qwen3.5 dense (separate in_proj_qkv / z / b / a), Qwen3-Next (fused in_proj_qkvz / ba, MoE
# with a shared expert), Qwen3.5-MoE (fused 3-D experts, written per expert in FP8).
NAMES = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")


def _write(name, root):
  """(FP8 directory, its dequantized twin) of the fixture `name`."""
  quantize_checkpoint(fixture_dir(name), str(root / "fp8"), block_size=BLOCK)
  return str(root / "fp8"), unquantize(root / "fp8", root / "dequantized", BLOCK)


@pytest.fixture(scope="module", params=NAMES)
def checkpoints(request, tmp_path_factory):
  return _write(request.param, tmp_path_factory.mktemp(request.param))


def _linear_attention(llm):
  return next(layer.linear_attn for layer in llm.target.layers
              if layer.layer_type == "linear_attention")


def test_fp8_linear_attention_stays_fp8_and_gives_the_dequantized_logits(checkpoints):
  fp8_dir, plain_dir = checkpoints
  fp8, plain = _llm(fp8_dir), _llm(plain_dir)
  mixer = _linear_attention(fp8)
  # q, k, v, z per key head in the checkpoint's [out, in] order: [G, 2 x 16 + 2 x 2 x 24, D],
  # a scale per 8 x 8 block; b and a unquantized beside them; out_proj [D, G, R, Dv].
  assert mixer.in_proj[...].dtype == E4M3 and mixer.in_proj[...].shape == (2, 128, 64)
  assert mixer.in_proj_scale[...].shape == (2, 128 // BLOCK, 64 // BLOCK)
  assert mixer.in_proj_ba[...].dtype == np.float32 and mixer.in_proj_ba[...].shape == (64, 2, 4)
  assert mixer.out_proj[...].dtype == E4M3 and mixer.out_proj[...].shape == (64, 2, 2, 24)
  for got, want in zip(fp8.compute_logits(PROMPTS), plain.compute_logits(PROMPTS)):
    # The same float32 weights (e4m3 x scale is exact in float32), scaled inside the program
    # instead of read: equal up to float32 summation order.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fp8_hybrid_generation_equals_the_dequantized_model_and_mtp_equals_vanilla(checkpoints):
  assert_fp8_greedy_is_the_dequantized_models(*checkpoints, PROMPTS, 8)


def test_fp8_hybrid_over_dp_and_tp_gives_one_devices_tokens(tmp_path):
  # tp = 2 gives each shard one key head of the linear attention, with its whole blocks.
  fp8_dir, _ = _write("qwen3_5_text", tmp_path)
  one = greedy_token_ids(_llm(fp8_dir), PROMPTS, 8)
  sharded = _llm(fp8_dir, mesh=jspec.MeshConfig(dp=2, tp=2))
  assert greedy_token_ids(sharded, PROMPTS, 8) == one


def test_fp8_blocks_straddling_linear_attention_heads_are_refused(tmp_path):
  # Blocks of 32 rows hold two key heads of 16: one scale for two heads' rows, which jspec
  # (keeping the rows per head) cannot carry.
  quantize_checkpoint(fixture_dir("qwen3_5_text"), str(tmp_path / "fp8"), block_size=32)
  with pytest.raises(ValueError, match="do not tile the linear-attention heads"):
    _llm(str(tmp_path / "fp8"))
