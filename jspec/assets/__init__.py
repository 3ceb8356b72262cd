"""Files shipped inside the package: the trained demo model."""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def demo_model_path() -> str:
  """Directory of the built-in demo model (HF format: config, safetensors, tokenizer)."""
  path = os.path.join(_HERE, "demo_model")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"the demo model is missing from the package ({path})")
  return path
