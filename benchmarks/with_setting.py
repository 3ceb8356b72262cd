"""Runs a benchmark with module-level settings of jspec changed first, for A / B runs of a
setting in fresh processes (a program's traces and compiled kernels hold the value they saw):

    python3 benchmarks/with_setting.py jspec.pallas_kernels.fp8_gemm.TWO_BLOCK_STAGES=4 \
        benchmarks/call_and_step.py --model qwen3-8b --precisions fp8
    python3 benchmarks/with_setting.py jspec.pallas_kernels.fp8_experts.ACT_KERNEL=False \
        -m jspec.cli bench --models qwen3-30b-a3b --batch 1

Each setting is module.NAME=value (several joined by commas); a value that reads as a Python
literal (0, 4, True, 1.5, "text") is taken as one, anything else as a string. The setting must
exist already: a misspelt name is an error, not a new attribute.
"""

from __future__ import annotations

import ast
import importlib
import runpy
import sys


def parse(settings: str) -> list[tuple[object, str, object]]:
  """[(module, name, value)] of 'module.NAME=value[,module.NAME=value...]' ('' -> []): each
  value a Python literal where it reads as one, else the text; a name the module lacks is an
  error."""
  parsed = []
  for setting in filter(None, settings.split(",")):
    target, _, text = setting.partition("=")
    module_name, _, name = target.rpartition(".")
    if not module_name or not name or not text:
      raise SystemExit(f"a setting is module.NAME=value, got {setting!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
      raise SystemExit(f"{module_name} has no setting {name!r}")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    parsed.append((module, name, value))
  return parsed


def apply(settings: str) -> None:
  for module, name, value in parse(settings):
    setattr(module, name, value)
    print(f"# {module.__name__}.{name} = {value!r}", flush=True)


def main() -> None:
  if len(sys.argv) < 3:
    raise SystemExit(__doc__)
  apply(sys.argv[1])
  if sys.argv[2] == "-m":
    sys.argv = sys.argv[3:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
  else:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
  main()
