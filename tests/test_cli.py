"""The command line: generate (token ids or text, with each drafter), convert, clear errors."""

import os

import pytest

from helpers import fixture_dir
from jspec import cli


def test_generate_token_ids_with_ngram_prints_tokens_and_metrics(capsys):
  code = cli.main(["generate", "--model", fixture_dir("qwen3_dense"), "--prompt", "7 8 7 8 7 8",
                   "--token-ids", "--dtype", "float32", "--max-model-len", "64",
                   "--max-tokens", "6", "--spec", "ngram", "--k", "2"])
  out, err = capsys.readouterr()
  assert code == 0
  assert len(eval(out.strip().splitlines()[-1])) <= 6  # a list of token ids
  assert "mean acceptance length" in err and "[finish:" in err


def test_generate_text_on_the_demo_model_with_mtp(capsys):
  code = cli.main(["generate", "--prompt", "In the beginning God created", "--dtype", "float32",
                   "--max-model-len", "128", "--max-tokens", "12", "--spec", "mtp", "--k", "2"])
  out, err = capsys.readouterr()
  assert code == 0 and out.strip()
  assert "acceptance per position" in err


def test_convert_then_generate_from_the_converted_directory(tmp_path, capsys):
  out_dir = str(tmp_path / "converted")
  assert cli.main(["convert", "--model", fixture_dir("qwen3_moe"), "--out", out_dir,
                   "--dtype", "float32", "--max-model-len", "64"]) == 0
  assert os.path.isdir(os.path.join(out_dir, "jspec_params"))
  assert cli.main(["generate", "--model", out_dir, "--prompt", "1 2 3", "--token-ids",
                   "--dtype", "float32", "--max-model-len", "64", "--max-tokens", "4"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/no/such/dir", "--prompt", "x"], "does not exist"),
    (["generate", "--model", fixture_dir("qwen3_dense"), "--prompt", "hello"], "no tokenizer"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature=-1.0 must be >= 0"),
    (["generate", "--prompt", "x", "--spec", "ngram", "--k", "0"], "num_speculative_tokens=0"),
])
def test_bad_input_exits_2_with_the_reason(argv, message, capsys):
  assert cli.main(argv) == 2
  assert message in capsys.readouterr().err


def test_compiled_programs_land_in_the_persistent_cache(tmp_path):
  import jspec
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=48,
                  compilation_cache_dir=str(tmp_path))
  llm.generate([[3, 4, 5]], jspec.SamplingParams(temperature=0.0, max_tokens=3))
  assert os.listdir(tmp_path)


def test_repeated_prompts_run_as_one_batch(capsys):
  code = cli.main(["generate", "--prompt", "In the beginning", "--prompt", "def main():",
                   "--dtype", "float32", "--max-model-len", "64", "--max-tokens", "5"])
  out, err = capsys.readouterr()
  assert code == 0 and out.count("--- prompt") == 2
  assert "10 tokens" in err
