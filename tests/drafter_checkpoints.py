"""Small drafter checkpoints in their published layouts, written from a target fixture.

- `truncated_draft_model`: the target's own first `num_layers` layers, embedding, final norm and
  head, saved as a checkpoint of the target's architecture (a draft model that shares the
  vocabulary and agrees with the target often, so verification accepts long runs).
- `eagle3_head`: an EAGLE-3 head in the layout of the published heads (config architectures
  `LlamaForCausalLMEagle3`; `midlayer.*`, `fc`, `norm`, `lm_head` over a draft vocabulary,
  `d2t` / `t2d`), seeded random weights.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file


def truncated_draft_model(target_dir: str, out_dir: str, num_layers: int) -> str:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(target_dir, "config.json")) as f:
    config = json.load(f)
  config["num_hidden_layers"] = num_layers
  for key in ("layer_types", "mlp_only_layers"):
    if isinstance(config.get(key), list):
      config[key] = config[key][:num_layers]
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f)
  tensors = load_file(os.path.join(target_dir, "model.safetensors"))
  kept = {name: t for name, t in tensors.items()
          if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
  save_file(kept, os.path.join(out_dir, "model.safetensors"))
  for name in os.listdir(target_dir):
    if name.startswith("tokenizer") or name in ("vocab.json", "merges.txt"):
      shutil.copy(os.path.join(target_dir, name), out_dir)
  return out_dir


def eagle3_head(target_dir: str, out_dir: str, draft_vocab: int, seed: int = 0,
                aux_layer_ids=None, hidden: int | None = None, own_embed: bool = False,
                norm_before_residual: bool = False, scale: float = 0.2) -> str:
  """A head for the target in `target_dir` (hidden size `hidden`, default the target's)."""
  with open(os.path.join(target_dir, "config.json")) as f:
    target = json.load(f)
  rng = np.random.default_rng(seed)
  vocab, th = target["vocab_size"], target["hidden_size"]
  h = hidden or th
  heads, kv_heads, head_dim = 4, 2, 16
  inter = 2 * h
  config = {
      "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
      "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 1,
      "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
      "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
      "max_position_embeddings": target["max_position_embeddings"], "vocab_size": vocab,
      "draft_vocab_size": draft_vocab, "tie_word_embeddings": False,
      "target_hidden_size": th, "norm_before_residual": norm_before_residual,
  }
  if aux_layer_ids is not None:
    config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
  normal = lambda *shape: (scale * rng.standard_normal(shape)).astype(np.float32)
  norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
  # The draft vocabulary: `draft_vocab` distinct target ids in increasing order (as the
  # published d2t is built: the most frequent target tokens, sorted), d2t[d] = id - d.
  ids = np.sort(rng.choice(vocab, size=draft_vocab, replace=False))
  t2d = np.zeros(vocab, bool)
  t2d[ids] = True
  a = "midlayer.self_attn."
  tensors = {
      "fc.weight": normal(h, 3 * th),
      "midlayer.input_layernorm.weight": norm(h),
      "midlayer.hidden_norm.weight": norm(h),
      "midlayer.post_attention_layernorm.weight": norm(h),
      a + "q_proj.weight": normal(heads * head_dim, 2 * h),
      a + "k_proj.weight": normal(kv_heads * head_dim, 2 * h),
      a + "v_proj.weight": normal(kv_heads * head_dim, 2 * h),
      a + "o_proj.weight": normal(h, heads * head_dim),
      "midlayer.mlp.gate_proj.weight": normal(inter, h),
      "midlayer.mlp.up_proj.weight": normal(inter, h),
      "midlayer.mlp.down_proj.weight": normal(h, inter),
      "norm.weight": norm(h),
      "lm_head.weight": normal(draft_vocab, h),
      "d2t": (ids - np.arange(draft_vocab)).astype(np.int64),
      "t2d": t2d,
  }
  if own_embed:
    tensors["embed_tokens.weight"] = normal(vocab, h)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"))
  return out_dir
