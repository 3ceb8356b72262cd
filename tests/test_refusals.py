"""Every row of the README's table of refused inputs raises its ValueError before model work:
with reading a checkpoint tensor and compiling any program made to fail, the call must still
end in the message the table gives."""

import os
import re

import pytest
from jax._src.interpreters import pxla

import jspec
from helpers import cached_llm, fixture_dir
from jspec.models import loading

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _rows():
  text = open(README).read()
  table = text[text.index("<!-- refusals -->"):text.index("<!-- /refusals -->")]
  rows = re.findall(r"^\| `(.+)` \| (.+) \|$", table, flags=re.MULTILINE)
  assert len(rows) >= 25, "the README's table of refusals was not found"
  return rows


def _must_not_run(*args, **kwargs):
  raise AssertionError("model work before the refusal")


@pytest.mark.parametrize("call, message", _rows())
def test_each_refusal_comes_before_any_model_work(call, message, monkeypatch):
  llm = cached_llm("qwen3_dense")  # built before the guards
  monkeypatch.setattr(loading.SafetensorsIndex, "read", _must_not_run)
  monkeypatch.setattr(pxla.MeshComputation, "compile", _must_not_run)
  with pytest.raises(ValueError) as refused:
    eval(call, {"jspec": jspec, "model": fixture_dir("qwen3_dense"), "llm": llm})
  assert message in str(refused.value)


def test_the_guards_catch_model_work(monkeypatch):
  """The guards above are not vacuous: loading a model, or generating a new shape, trips them."""
  llm = cached_llm("qwen3_dense")
  monkeypatch.setattr(loading.SafetensorsIndex, "read", _must_not_run)
  monkeypatch.setattr(pxla.MeshComputation, "compile", _must_not_run)
  with pytest.raises(AssertionError, match="model work"):
    jspec.LLM(model=fixture_dir("qwen3_dense"), max_model_len=64)
  with pytest.raises(AssertionError, match="model work"):
    llm.generate([list(range(1, 40))] * 3, jspec.SamplingParams(max_tokens=17, seed=5))


def test_a_model_path_that_is_no_directory_says_what_to_pass(tmp_path):
  """A path to config.json names its directory; an id of the Hugging Face hub gets the hint
  that jspec reads local directories only; a corrupt config.json names the file, in one line
  (no chained traceback of transformers' loader)."""
  config = os.path.join(fixture_dir("qwen3_dense"), "config.json")
  with pytest.raises(ValueError, match="is a file; pass the checkpoint's directory") as err:
    jspec.LLM(model=config)
  assert fixture_dir("qwen3_dense").rstrip("/").split("/")[-1] in str(err.value)
  with pytest.raises(FileNotFoundError, match="loads local directories only.*huggingface-cli "
                                               "download Qwen/Qwen3-8B"):
    jspec.LLM(model="Qwen/Qwen3-8B")
  with pytest.raises(FileNotFoundError, match="does not exist$"):
    jspec.LLM(model=str(tmp_path / "missing"))
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="cannot read .*config.json") as err:
    jspec.LLM(model=str(tmp_path))
  assert err.value.__cause__ is None and err.value.__suppress_context__
