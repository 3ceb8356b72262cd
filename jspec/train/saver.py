"""Writing jspec modules as a Hugging Face Qwen3 checkpoint (the inverse of models/weights.py).

`config.json` says `Qwen3ForCausalLM` / `qwen3`, so transformers loads the directory as an
ordinary Qwen3 model (it ignores the extra `mtp.*` tensors); jspec finds the MTP head from those
tensor names (Qwen3-Next layout) and `mtp_num_hidden_layers`.

Every tensor is checked on the way out: the loader's own rule (weights.py) applied to the HF
array must give back the jspec parameter, so the saver cannot drift from the loader.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jspec.config import ModelConfig
from jspec.models import weights as W
from jspec.models.params import unpadded_shape
from jspec.models.qkv_fusion import unfused_flat_state
from jspec.models.mtp import MTPSpec
from jspec.models.registry import family_of

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_config_dict(cfg: ModelConfig, num_mtp_layers: int, dtype: str) -> dict:
  """A transformers `Qwen3Config` as JSON (dense models only)."""
  if cfg.is_moe:
    raise ValueError("the saver writes dense Qwen3 models only (this one has experts)")
  eos = list(cfg.eos_token_ids)
  config = {
      "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
      "max_position_embeddings": cfg.max_position_embeddings,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False,
      "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
      "use_cache": True, "dtype": dtype,
      "bos_token_id": eos[0] if eos else None,
      "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
  }
  if num_mtp_layers:
    config["mtp_num_hidden_layers"] = num_mtp_layers
  return config


def _to_hf(path, array: np.ndarray, rule) -> list[np.ndarray]:
  """jspec layout -> the HF tensors of one rule: the rule's own `split` where it has one (the
  fused gate_up), else vectors and the embedding as they are and projections transposed back
  to nn.Linear's [out, in] (q_proj [D, N, H] -> [N*H, D], o_proj [N, H, D] -> [D, N*H])."""
  if rule.split is not None:
    return rule.split(array)
  if array.ndim == 1 or path[-1] == "embed":
    return [array.reshape(rule.hf_shapes[0])]
  out_dim, in_dim = rule.hf_shapes[0]
  return [np.ascontiguousarray(array.reshape(in_dim, out_dim).T)]


def _hf_tensors(module, rules: dict, prefix: tuple = ()) -> dict:
  tensors = {}
  for path, variable in unfused_flat_state(module, nnx.Param):
    rule = rules[path]
    if len(rule.names) != 1 and rule.split is None:
      raise ValueError(f"parameter {path} maps to {len(rule.names)} HF tensors (MoE experts); "
                       "not supported")
    ours = np.asarray(jax.device_get(variable.get_value())).astype(np.float32)
    ours = ours[tuple(slice(0, n) for n in unpadded_shape(variable))]  # padding is not saved
    theirs = _to_hf(path, ours, rule)
    if not np.array_equal(rule.build(*theirs), ours):  # the loader must read back what we wrote
      raise AssertionError(f"saver/loader mismatch for {prefix + path} -> {rule.names}")
    tensors.update(zip(rule.names, theirs))
  return tensors


def mtp_tensors(cfg: ModelConfig, mtp) -> dict:
  """`mtp.*` tensors (Qwen3-Next layout) of a one-or-more-layer MTP head, float32 arrays."""
  spec = MTPSpec(layout="qwen3_next", num_layers=len(mtp.layers), is_moe=False)
  if mtp.spec.layout != "qwen3_next":
    raise ValueError(f"the saver writes the Qwen3-Next MTP layout; this head is {mtp.spec.layout}")
  family = family_of(cfg)
  return _hf_tensors(mtp, W.mtp_rules(cfg, spec, family.decoder_rules(cfg, set())), ("mtp",))


def save_pretrained(out_dir: str, cfg: ModelConfig, target, mtp=None, *, dtype: str = "bfloat16",
                    tokenizer_dir: str | None = None, extra_config: dict | None = None):
  """Writes config.json, generation_config.json, model.safetensors (+ tokenizer files)."""
  if dtype not in _NP_DTYPES:
    raise ValueError(f"dtype={dtype!r}; choose one of {sorted(_NP_DTYPES)}")
  if cfg.architecture != "Qwen3ForCausalLM":  # before any tensor: another layout's would not map
    raise ValueError(f"the saver writes dense Qwen3 models (Qwen3ForCausalLM) only; this one is "
                     f"{cfg.architecture}")
  os.makedirs(out_dir, exist_ok=True)
  tensors = _hf_tensors(target, family_of(cfg).target_rules(cfg, set()))
  num_mtp = 0
  if mtp is not None:
    tensors.update(mtp_tensors(cfg, mtp))
    num_mtp = len(mtp.layers)
  np_dtype = _NP_DTYPES[dtype]
  save_file({name: np.ascontiguousarray(a.astype(np_dtype)) for name, a in sorted(tensors.items())},
            os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  config = hf_config_dict(cfg, num_mtp, dtype)
  config.update(extra_config or {})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  eos = list(cfg.eos_token_ids)
  generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                "pad_token_id": eos[0] if eos else None, "do_sample": False}
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump(generation, f, indent=2)
  if tokenizer_dir is not None:
    for name in TOKENIZER_FILES:
      src = os.path.join(tokenizer_dir, name)
      if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(
          os.path.join(out_dir, name)):
        shutil.copyfile(src, os.path.join(out_dir, name))
  return out_dir
