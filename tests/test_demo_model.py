"""The shipped demo model: it loads, generates text, and its MTP head is accepted.

The acceptance floor was set from a measurement, not tuned to pass: on CPU (float32, k=2,
greedy, 64 tokens per prompt, the prompts below) the shipped model reached a mean acceptance
length of 2.65 tokens per verify step (acceptance 0.88 / 0.77 at draft positions 1 / 2; measured
2026-11-22); the floor is that value minus 0.4, room for float32 differences across CPUs and
library versions, while an untrained or mis-wired head (about 1.0) fails it.
"""

import json
import os

import pytest

import jspec
from jspec.assets import demo_model_path
from jspec.config import SamplingParams

MEASURED_MEAN_ACCEPTANCE_LENGTH = 2.65
FLOOR_MARGIN = 0.4

PROMPTS = [
    "Psa23:1 The LORD is my shepherd; I shall not want.\n",
    "Mat5:3 Blessed are the poor in spirit: for theirs is the kingdom of heaven.\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line.\"\"\"\n",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n",
]


def test_demo_model_directory_is_small_hf_qwen3():
  path = demo_model_path()
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  assert config["architectures"] == ["Qwen3ForCausalLM"] and config["mtp_num_hidden_layers"] == 1
  size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
  assert size <= 25 * 2 ** 20, size
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
  assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == config["eos_token_id"]
  text = "def f(x):\n    return x  # ünïcode\n"
  assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@pytest.fixture(scope="module")
def demo_outputs():
  llm = jspec.LLM(model=demo_model_path(), dtype="float32", max_model_len=256,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
  return llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))


def test_demo_model_generates_text(demo_outputs):
  for out in demo_outputs:
    assert len(out.token_ids) == 64 and out.text.strip()
  assert "LORD" in demo_outputs[0].text or "God" in demo_outputs[0].text + demo_outputs[1].text


def test_demo_model_mtp_acceptance_floor(demo_outputs):
  measured = demo_outputs.metrics.mean_acceptance_length
  assert measured >= MEASURED_MEAN_ACCEPTANCE_LENGTH - FLOOR_MARGIN, measured
