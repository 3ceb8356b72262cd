"""A checkpoint directory's tokenizer, when it ships one (jspec needs none: token ids work)."""

from __future__ import annotations

import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str):
  """The Hugging Face tokenizer of `model_dir`, or None where it has no tokenizer files."""
  if not any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
    return None
  from transformers import AutoTokenizer  # slow to import: only where a tokenizer exists
  return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
