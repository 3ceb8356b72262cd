"""The memory plan on paper (jspec.paper_plan): DeepSeek-V3 at full size (671 B parameters,
61 layers, 256 experts) with its NextN layer, on 8 H200, from its published config alone --
it fits in FP8 and is refused in bf16 with the planner's message. No weight exists: the
modules are built abstractly and the mesh has no devices."""

import json

import jax.numpy as jnp
import pytest

import jspec
from jspec.models.hf_config import config_from_dir
from jspec.models.mtp import MTPSpec
from jspec.paper_plan import plan_for_config

# DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3), its FP8 quantization_config.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "vocab_size": 129280,
    "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}
# An H200's memory as JAX reports it (143,771 MiB) under XLA_PYTHON_CLIENT_MEM_FRACTION=0.95.
H200_BYTES = int(0.95 * 143771 * 2**20)
NEXTN = MTPSpec(layout="deepseek_v3", num_layers=1, is_moe=True)
MESH = jspec.MeshConfig(tp=8)


def _config(tmp_path, fp8: bool):
  raw = dict(DEEPSEEK_V3)
  if not fp8:
    del raw["quantization_config"]
  (tmp_path / "config.json").write_text(json.dumps(raw))
  return config_from_dir(str(tmp_path))


def _plan(cfg, **kwargs):
  return plan_for_config(cfg, MESH, capacity_bytes=H200_BYTES, max_model_len=32768,
                         max_num_seqs=8, dtype=jnp.bfloat16, num_speculative_tokens=1, mtp=NEXTN,
                         **kwargs)


def test_deepseek_v3_with_nextn_fits_8_h200_in_fp8(tmp_path):
  plan = _plan(_config(tmp_path, fp8=True))
  # ~685 B parameters (the NextN layer's ~14 B included) at one byte, most of them split 8 ways,
  # the embedding and lm_head (2 x 0.93 B) in bf16, split over tp too.
  assert 80e9 < plan.weight_bytes < 95e9
  assert plan.total_bytes <= 0.9 * H200_BYTES
  assert plan.target_cache_bytes > 0 and plan.draft_cache_bytes > 0


def test_deepseek_v3_in_bf16_is_refused_on_8_h200(tmp_path):
  with pytest.raises(ValueError, match=r"max_num_seqs=8 x max_model_len=32768 does not fit: .*"
                                       r"weights 1[5-7]\d\.\d\d GiB"):
    _plan(_config(tmp_path, fp8=False))
