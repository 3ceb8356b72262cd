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


@pytest.fixture(scope="module")
def demo_pair():
  """(vanilla, MTP k=3) on the trained model, float32: its head drafts tokens that appear in
  the text for the first time, so stops land inside multi-token accepted runs."""
  def make(spec):
    return jspec.LLM(model=demo_model_path(), dtype="float32", max_model_len=256,
                     speculative_config=spec)
  return make(None), make({"method": "mtp", "num_speculative_tokens": 3})


def _greedy(max_tokens, **kwargs):
  return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_mtp_stops_exactly_like_vanilla_inside_accepted_runs(demo_pair):
  """Every token of the continuation used as a stop id, and every max_tokens: the MTP output
  equals vanilla decoding cut at the same place. A stop at index j lies strictly inside a
  multi-token step when the runs for j+1 and j+2 tokens take the same number of steps;
  the test requires such cases to occur, so it exercises the discard-after-stop path."""
  vanilla, mtp = demo_pair
  prompt = PROMPTS[2]
  full = vanilla.generate([prompt], _greedy(40))[0].token_ids
  # One run per limit (greedy runs repeat exactly): its output, and its step count.
  outs = {m: mtp.generate([prompt], _greedy(m))[0] for m in range(1, 42)}
  steps = {m: out.metrics.num_steps for m, out in outs.items()}
  inside_stop = inside_length = 0
  for m in range(1, 40):
    out = outs[m]
    assert out.token_ids == full[:m] and out.finish_reason == "length"
    inside_length += steps[m] == steps[m + 1]
  for j, stop in enumerate(full):
    if full.index(stop) != j:
      continue
    out = mtp.generate([prompt], _greedy(40, stop_token_ids=[stop]))[0]
    assert out.token_ids == full[:j + 1] and out.finish_reason == "stop"
    inside_stop += steps[j + 1] == steps[j + 2]
  assert inside_length > 0 and inside_stop > 0, (inside_length, inside_stop)


def test_eos_inside_an_accepted_run_ends_like_vanilla(demo_pair, tmp_path):
  """A copy of the demo model whose EOS id is a token that MTP emits strictly inside a
  multi-token step: generation (EOS honoured) stops right after it, with finish 'stop',
  exactly where vanilla decoding stops."""
  import shutil
  vanilla, mtp = demo_pair
  prompt = PROMPTS[0]
  full = vanilla.generate([prompt], _greedy(40))[0].token_ids
  steps = {m: mtp.generate([prompt], _greedy(m))[0].metrics.num_steps for m in range(1, 42)}
  inside = [j for j, t in enumerate(full) if full.index(t) == j and steps[j + 1] == steps[j + 2]]
  assert inside, "no first-occurrence token inside a multi-token step"
  j = inside[len(inside) // 2]
  model_dir = tmp_path / "demo_eos"
  shutil.copytree(demo_model_path(), model_dir)
  for name in ("config.json", "generation_config.json"):
    config = json.loads((model_dir / name).read_text())
    config["eos_token_id"] = full[j]
    (model_dir / name).write_text(json.dumps(config))
  params = SamplingParams(temperature=0.0, max_tokens=40)
  for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
    llm = jspec.LLM(model=str(model_dir), dtype="float32", max_model_len=256,
                    speculative_config=spec)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == full[:j + 1] and out.finish_reason == "stop"
