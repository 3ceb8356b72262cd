"""`train_mtp_head`: give an existing target a trained MTP head, written into its directory.

The target is frozen; the head learns by self-distillation (its soft labels are the target's
own next-next-token distribution, on the target's own hidden states), so no labelled data is
needed and the head learns exactly what speculative decoding asks of it: to agree with the
target. The result is stored in the Qwen3-Next layout (`mtp.fc`, `mtp.pre_fc_norm_*`,
`mtp.layers.0.*`, `mtp.norm`) plus `mtp_num_hidden_layers` in config.json, which jspec's loader
detects and transformers ignores.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jspec.config import ModelConfig
from jspec.models.hf_config import config_from_dir
from jspec.models.loading import load_checkpoint
from jspec.sharding.rules import MeshConfig, ShardingRules
from jspec.train import saver
from jspec.train.trainer import TrainConfig, train_head_distill

Corpus = Sequence[str] | Sequence[Sequence[int]] | np.ndarray


def _token_stream(target_dir: str, corpus: Corpus, eos: int) -> np.ndarray:
  """Documents -> one stream of ids, each document followed by EOS (as in pre-training)."""
  if isinstance(corpus, np.ndarray) and corpus.ndim == 1:
    return corpus.astype(np.int32)
  docs = list(corpus)
  if not docs:
    raise ValueError("corpus is empty")
  if isinstance(docs[0], str):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    docs = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
  return np.concatenate([np.append(np.asarray(d, np.int32), eos) for d in docs])


def write_mtp_head(target_dir: str, cfg: ModelConfig, mtp):
  """Replaces any `mtp.*` tensors of the checkpoint with `mtp`'s, in the checkpoint's dtype."""
  new = saver.mtp_tensors(cfg, mtp)
  index_path = os.path.join(target_dir, "model.safetensors.index.json")
  if os.path.isfile(index_path):
    with open(index_path) as f:
      index = json.load(f)
    some = os.path.join(target_dir, next(iter(index["weight_map"].values())))
    dtype = next(iter(load_file(some).values())).dtype
    shard = "model-mtp.safetensors"
    index["weight_map"] = {n: f for n, f in index["weight_map"].items()
                           if not n.startswith("mtp.")}
    save_file({n: a.astype(dtype) for n, a in new.items()}, os.path.join(target_dir, shard),
              metadata={"format": "pt"})
    index["weight_map"].update({n: shard for n in new})
    with open(index_path + ".tmp", "w") as f:
      json.dump(index, f, indent=2)
    os.replace(index_path + ".tmp", index_path)
  else:
    path = os.path.join(target_dir, "model.safetensors")
    tensors = {n: a for n, a in load_file(path).items() if not n.startswith("mtp.")}
    dtype = tensors["model.embed_tokens.weight"].dtype
    tensors.update({n: np.ascontiguousarray(a.astype(dtype)) for n, a in new.items()})
    save_file(tensors, path + ".tmp", metadata={"format": "pt"})
    os.replace(path + ".tmp", path)
  config_path = os.path.join(target_dir, "config.json")
  with open(config_path) as f:
    config = json.load(f)
  config.pop("num_nextn_predict_layers", None)
  config["mtp_num_hidden_layers"] = len(mtp.layers)
  with open(config_path + ".tmp", "w") as f:
    json.dump(config, f, indent=2)
  os.replace(config_path + ".tmp", config_path)


def train_mtp_head(target_dir: str, corpus: Corpus, *, steps: int = 500, seq_len: int = 256,
                   batch_size: int = 16, learning_rate: float = 1e-3, seed: int = 0,
                   compute_dtype: str = "float32", log: Callable | None = None) -> dict:
  """Trains a one-layer Qwen3-Next MTP head for the (dense) target in `target_dir` and writes it
  there. `corpus`: texts (tokenized with the directory's tokenizer), token-id lists, or one id
  stream. Returns the training info (history of distillation loss and argmax agreement)."""
  cfg = config_from_dir(target_dir)
  if cfg.is_moe:
    raise ValueError("train_mtp_head supports dense targets (Qwen3ForCausalLM)")
  eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
  stream = _token_stream(target_dir, corpus, eos)
  if len(stream) <= seq_len + 1:
    seq_len = max(8, len(stream) // 2)
  mesh = MeshConfig(num_devices=1).make_mesh()
  target, _, _ = load_checkpoint(target_dir, cfg, jnp.float32, mesh, ShardingRules())
  tc = TrainConfig(seq_len=seq_len, batch_size=batch_size, learning_rate=learning_rate,
                   warmup_steps=max(1, steps // 20), steps=steps, seed=seed, weight_decay=0.0,
                   compute_dtype=compute_dtype, log_every=max(1, steps // 10))
  mtp, info = train_head_distill(target, {"corpus": stream}, tc, log=log)
  write_mtp_head(target_dir, cfg, jax.device_get(mtp))
  return info
