"""A checkpoint directory's `ModelConfig`: config.json read through `transformers.AutoConfig`,
translated by the checkpoint's family (jspec.models.registry), with its FP8 block size and the
extra EOS ids of generation_config.json.

AutoConfig normalises the key spellings of old and new checkpoints (`rope_theta` vs
`rope_parameters`, `num_experts` vs `num_local_experts`); the families read only the
normalised attributes. This lives beside the registry, not in jspec.config, so that
configuration data knows no family.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jspec.config import ModelConfig
from jspec.models.quantization import fp8_block_size, refuse_unsupported, unconverted_kinds
from jspec.models.registry import read_config


def config_from_hf(hf_config) -> ModelConfig:
  """The config of a supported architecture, read by its family (jspec.models.registry)."""
  return read_config(hf_config)


def config_from_dir(model_dir: str) -> ModelConfig:
  """The `ModelConfig` of the Hugging Face checkpoint in `model_dir` (no weights read)."""
  from transformers import AutoConfig  # Imported late: transformers is slow to import.
  if not os.path.isfile(os.path.join(model_dir, "config.json")):
    raise FileNotFoundError(f"{model_dir!r} has no config.json")
  try:
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
  except (ValueError, KeyError, json.JSONDecodeError, OSError) as err:
    # transformers' own message, without the chain of its loader's frames behind it.
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    raise ValueError(f"cannot read {model_dir}/config.json: {reason}") from None
  block = fp8_block_size(hf_config, model_dir)
  config = config_from_hf(hf_config)
  if block is not None:
    config = dataclasses.replace(config, fp8_block=block, fp8_unconverted=unconverted_kinds(
        hf_config, config, model_dir))
    refuse_unsupported(config, model_dir)
  # generation_config.json may carry extra EOS ids (as Qwen3 instruct checkpoints do).
  gen_path = os.path.join(model_dir, "generation_config.json")
  if os.path.isfile(gen_path):
    with open(gen_path) as f:
      eos = json.load(f).get("eos_token_id")
    extra = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    config = dataclasses.replace(
        config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
  return config
