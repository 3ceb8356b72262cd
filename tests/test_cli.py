"""The command line: generate (token ids or text, with each drafter), convert, clear errors."""

import os

import jax

import pytest

from drafter_checkpoints import eagle3_head, truncated_draft_model
from helpers import fixture_dir
import jspec
from jspec import cli


def test_generate_token_ids_with_ngram_prints_tokens_and_metrics(capsys):
  code = cli.main(["generate", "--model", fixture_dir("qwen3_dense"), "--prompt", "7 8 7 8 7 8",
                   "--token-ids", "--dtype", "float32", "--max-model-len", "64",
                   "--max-tokens", "6", "--spec", "ngram", "--k", "2"])
  out, err = capsys.readouterr()
  assert code == 0
  assert len(eval(out.strip().splitlines()[-1])) <= 6  # a list of token ids
  assert "mean acceptance length" in err and "[finish:" in err


def test_vocab_replicated_keeps_the_vocabulary_whole_and_the_tokens(capsys, monkeypatch):
  """--tp 2 --vocab-replicated: the embedding and lm_head unsplit on both shards, and the
  greedy tokens (with MTP drafts) those of one device."""
  argv = ["generate", "--model", fixture_dir("qwen3_moe"), "--prompt", "5 6 7 8 9",
          "--token-ids", "--dtype", "float32", "--max-model-len", "64", "--max-tokens", "8",
          "--spec", "mtp", "--k", "2"]
  built, build = [], cli._build_llm
  monkeypatch.setattr(cli, "_build_llm", lambda *a: built.append(build(*a)) or built[-1])
  outputs = []
  for extra in ([], ["--tp", "2", "--vocab-replicated"]):
    assert cli.main(argv + extra) == 0
    outputs.append(eval(capsys.readouterr().out.strip().splitlines()[-1]))
  assert outputs[0] == outputs[1] and len(outputs[0]) == 8
  for table in (built[-1].target.embed, built[-1].target.lm_head):
    assert table[...].sharding.spec == jax.sharding.PartitionSpec(None, None)


def test_generate_text_on_the_demo_model_with_mtp(capsys):
  code = cli.main(["generate", "--prompt", "In the beginning God created", "--dtype", "float32",
                   "--max-model-len", "128", "--max-tokens", "12", "--spec", "mtp", "--k", "2"])
  out, err = capsys.readouterr()
  assert code == 0 and out.strip()
  assert "acceptance per position" in err


def test_convert_then_generate_from_the_converted_directory(tmp_path, capsys):
  out_dir = str(tmp_path / "converted")
  assert cli.main(["convert", "--model", fixture_dir("qwen3_moe"), "--out", out_dir,
                   "--dtype", "float32"]) == 0
  assert os.path.isdir(os.path.join(out_dir, "jspec_params"))
  assert cli.main(["generate", "--model", out_dir, "--prompt", "1 2 3", "--token-ids",
                   "--dtype", "float32", "--max-model-len", "64", "--max-tokens", "4"]) == 0


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_generate_with_a_drafter_from_its_own_directory(method, tmp_path, capsys):
  """--spec draft_model|eagle3 --draft-model DIR: the tokens of plain greedy decoding."""
  llama = fixture_dir("llama3")
  draft = (truncated_draft_model(llama, str(tmp_path / "draft"), 1) if method == "draft_model"
           else eagle3_head(llama, str(tmp_path / "head"), 96, aux_layer_ids=[0, 1, 1]))
  argv = ["generate", "--model", llama, "--prompt", "5 17 99 3", "--token-ids", "--dtype",
          "float32", "--max-model-len", "64", "--max-tokens", "8"]
  assert cli.main(argv) == 0
  vanilla = capsys.readouterr().out.strip().splitlines()[-1]
  assert cli.main(argv + ["--spec", method, "--draft-model", draft, "--k", "2"]) == 0
  out, err = capsys.readouterr()
  assert out.strip().splitlines()[-1] == vanilla
  assert "mean acceptance length" in err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/no/such/dir", "--prompt", "x"], "does not exist"),
    (["generate", "--prompt", "x", "--spec", "eagle3"], "method 'eagle3' needs 'model'"),
    (["generate", "--prompt", "x", "--spec", "ngram", "--draft-model", "/d"],
     "method 'ngram' takes no 'model'"),
    (["generate", "--prompt", "x", "--draft-model", "/d"],
     "--draft-model needs --spec draft_model or --spec eagle3"),
    (["generate", "--model", fixture_dir("qwen3_dense"), "--prompt", "hello"], "no tokenizer"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature=-1.0 must be a number >= 0"),
    (["generate", "--prompt", "x", "--spec", "ngram", "--k", "0"], "num_speculative_tokens=0"),
    (["generate", "--prompt", "x", "--stop-token-ids", "1.5"],
     "--stop-token-ids takes integer token ids"),
    (["generate", "--prompt", "1 x", "--token-ids"], "--prompt takes integer token ids"),
])
def test_bad_input_exits_2_with_the_reason(argv, message, capsys):
  assert cli.main(argv) == 2
  assert message in capsys.readouterr().err


def test_compiled_programs_land_in_the_persistent_cache(tmp_path):
  import jspec
  try:
    llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=48,
                    compilation_cache_dir=str(tmp_path))
    llm.generate([[3, 4, 5]], jspec.SamplingParams(temperature=0.0, max_tokens=3))
    assert os.listdir(tmp_path)
  finally:
    # The rest of this worker's tests run as the suite asked (make test: no cache).
    jspec.api.enable_compilation_cache(None)


def test_off_disables_a_cache_an_earlier_llm_enabled(tmp_path, monkeypatch):
  from jax._src import compilation_cache
  import jspec
  monkeypatch.setenv("JSPEC_COMPILATION_CACHE", "off")
  try:
    jspec.api.enable_compilation_cache(str(tmp_path))
    assert compilation_cache.is_cache_used(jax.devices()[0].client)
    jspec.api.enable_compilation_cache(None)
    assert not compilation_cache.is_cache_used(jax.devices()[0].client)
  finally:
    jspec.api.enable_compilation_cache(None)


def test_repeated_prompts_run_as_one_batch(capsys):
  code = cli.main(["generate", "--prompt", "In the beginning", "--prompt", "def main():",
                   "--dtype", "float32", "--max-model-len", "64", "--max-tokens", "5"])
  out, err = capsys.readouterr()
  assert code == 0 and out.count("--- prompt") == 2
  assert "10 tokens" in err


def test_version(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--version"])
  assert exit_info.value.code == 0
  assert capsys.readouterr().out.strip() == f"jspec {jspec.__version__}"


def test_stop_token_ids_and_ignore_eos_reach_the_request(capsys):
  base = ["generate", "--model", fixture_dir("qwen3_dense"), "--prompt", "5 6 7", "--token-ids",
          "--dtype", "float32", "--max-model-len", "64", "--max-tokens", "6", "--max-num-seqs",
          "2"]
  assert cli.main(base + ["--ignore-eos"]) == 0
  free = eval(capsys.readouterr().out.strip().splitlines()[-1])
  assert len(free) == 6
  # Stopping on the second token ends the sequence there, with it (vLLM keeps stop ids).
  assert cli.main(base + ["--ignore-eos", "--stop-token-ids", str(free[1])]) == 0
  out, err = capsys.readouterr()
  stopped = eval(out.strip().splitlines()[-1])
  assert stopped == free[:free.index(free[1]) + 1] and "[finish: stop]" in err


def test_convert_onto_a_full_directory_is_refused_before_loading(tmp_path, capsys, monkeypatch):
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "keep.txt").write_text("x")
  monkeypatch.setattr(cli, "_build_llm", lambda *a: pytest.fail("the model was loaded"))
  assert cli.main(["convert", "--model", fixture_dir("qwen3_dense"), "--out",
                   str(tmp_path / "out")]) == 2
  assert "exists and is not empty" in capsys.readouterr().err


def test_transformers_says_nothing_about_pytorch_but_keeps_its_other_warnings():
  """jspec needs no PyTorch; transformers' import-time advice about it is dropped, nothing else."""
  import subprocess
  import sys
  script = ("import jspec, transformers; "
            "transformers.logging.get_logger('transformers').warning('a real warning')")
  err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True).stderr
  assert "PyTorch" not in err
  assert "a real warning" in err


def _subcommands():
  import argparse
  parser = cli.build_parser()
  action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  return action.choices


def test_help_shows_defaults_and_every_option_says_what_it_does():
  commands = _subcommands()
  assert set(commands) == {"generate", "demo", "convert", "bench"}
  for name, parser in commands.items():
    silent = [a.option_strings[0] for a in parser._actions
              if a.option_strings and a.dest != "help" and not a.help]
    assert silent == [], (name, silent)
  text = commands["generate"].format_help()
  assert "(default: 64)" in text and "(default: auto)" in text and "(default: None)" not in text


def test_stop_strings_from_the_command_line(capsys):
  """The demo model's greedy text holds " the"; with --stop " the" it ends before it."""
  args = ["generate", "--prompt", "In the beginning", "--max-tokens", "60", "--ignore-eos",
          "--dtype", "float32"]
  assert cli.main(args) == 0
  free = capsys.readouterr().out.split("\n")[0]
  assert " the" in free
  assert cli.main(args + ["--stop", " the"]) == 0
  out, err = capsys.readouterr()
  assert out.split("\n")[0] == free[:free.index(" the")]
  assert "[finish: stop]" in err


def test_no_option_is_taken_for_a_prefix_of_another(capsys):
  """`--stop-t 5` once meant --stop-token-ids 5; now an unknown option."""
  with pytest.raises(SystemExit):
    cli.main(["generate", "--prompt", "x", "--stop-t", "5"])
  assert "unrecognized arguments: --stop-t" in capsys.readouterr().err


def test_convert_takes_its_own_options_only():
  options = {o for a in _subcommands()["convert"]._actions for o in a.option_strings}
  assert options == {"-h", "--help", "--model", "--dtype", "--out", "--quantize",
                     "--block-size"}
