"""Every option of jspec.LLM declared once (jspec.options.EngineOptions): LLM's signature, the
CLI's flags and the build all read that one class, and the built parts are attributes that
the LLM class declares (an IDE finds llm.spec, llm.scheduler, llm.device)."""

import argparse
import dataclasses
import inspect

import pytest

import jspec
from jspec import cli
from jspec.build import LLMParts
from jspec.options import EngineOptions, cli_option_names


def test_llm_takes_exactly_the_options_with_their_defaults():
  params = inspect.signature(jspec.LLM).parameters
  public = {name: p for name, p in params.items() if not name.startswith("_")}
  fields = {f.name: f for f in dataclasses.fields(EngineOptions)}
  assert list(public) == ["model", *fields]
  for name, field in fields.items():
    assert public[name].kind == inspect.Parameter.KEYWORD_ONLY
    assert public[name].default == field.default, name


def _generate_parser():
  parser = cli.build_parser()
  action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  return action.choices["generate"]


def test_the_cli_offers_the_options_with_their_declared_help_and_choices():
  actions = {a.dest: a for a in _generate_parser()._actions}
  fields = {f.name: f for f in dataclasses.fields(EngineOptions)}
  assert cli_option_names(), "the CLI offers no engine option"
  for name in cli_option_names():
    action, meta = actions[name], fields[name].metadata
    assert action.option_strings == ["--" + name.replace("_", "-")]
    assert action.help == meta["help"]
    assert (action.choices is None) == (meta["choices"] is None), name
    if meta["choices"] is not None:
      assert list(action.choices) == list(meta["choices"])
  # The CLI reads the checkpoint's own dtype unless told; everything else keeps LLM's default.
  assert actions["dtype"].default == "auto"
  assert all(actions[n].default == fields[n].default for n in cli_option_names() if n != "dtype")


@pytest.mark.parametrize("name, value", [("attention_backend", "fast"), ("batching", "eager"),
                                         ("ep_strategy", "ring"), ("prefill_chunk_size", 100),
                                         ("max_num_seqs", 0), ("seed", "0")])
def test_a_wrong_option_is_refused_by_the_options_alone(name, value):
  """No model needed: the options' own check names the value."""
  with pytest.raises(ValueError, match=name):
    EngineOptions(**{name: value}).check()


def test_each_batching_mode_has_its_scheduler():
  from jspec.build import SCHEDULERS
  from jspec.options import BATCHING_MODES
  assert tuple(SCHEDULERS) == BATCHING_MODES


def test_the_llm_class_declares_its_built_parts():
  declared = {f.name for f in dataclasses.fields(jspec.LLM)}
  assert declared == {f.name for f in dataclasses.fields(LLMParts)}
  assert {"spec", "scheduler", "device", "config", "options"} <= declared


def test_an_llm_is_hashable_and_equal_only_to_itself():
  llm = jspec.LLM(jspec.demo_model_path(), max_model_len=64, max_num_seqs=1)
  assert llm.options.max_model_len == 64 and llm.options.max_num_seqs == 1
  assert llm == llm and {llm: 1}[llm] == 1
  assert "LLM(" in repr(llm) and len(repr(llm)) < 300


def test_each_speculative_method_has_one_registry_entry():
  """A method is a name SpecConfig accepts (jspec.config, the floor with no drafters) and
  one jspec.speculative.drafters.METHODS entry (its drafter and its setup); the CLI offers
  exactly those."""
  from jspec.config import SPEC_METHODS
  from jspec.speculative.drafters import METHODS, Drafter, setup_for
  from jspec.speculative.drafters.setup import DrafterSetup
  assert set(METHODS) == set(SPEC_METHODS)
  for name, method in METHODS.items():
    assert issubclass(method.drafter, Drafter) and isinstance(method.setup, DrafterSetup)
    spec = jspec.SpecConfig.parse({"method": name, "num_speculative_tokens": 2,
                                   **({"model": "/x"} if name in ("draft_model", "eagle3")
                                      else {})})
    assert setup_for(spec) is method.setup
  actions = {a.dest: a for a in _generate_parser()._actions}
  assert list(actions["spec"].choices) == ["none", *SPEC_METHODS]
