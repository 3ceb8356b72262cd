"""A byte-level BPE tokenizer trained with the `tokenizers` library, saved for AutoTokenizer.

Byte-level (GPT-2 / Qwen style) so that every string, Python source included, encodes without
unknown tokens and decodes back exactly. One special token, `<|endoftext|>`, separates
documents and is the EOS the model learns to emit.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str,
                    model_max_length: int = 2048):
  """Trains, writes tokenizer.json + tokenizer_config.json + special_tokens_map.json, and
  returns the `tokenizers.Tokenizer`."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                special_tokens=[EOS_TOKEN],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "bos_token": None, "unk_token": None,
      "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
      "model_max_length": model_max_length,
  }
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=1)
  with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
    json.dump({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}, f, indent=1)
  return tok


def load_tokenizer(tokenizer_dir: str):
  from tokenizers import Tokenizer
  return Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
