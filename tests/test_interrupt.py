"""Ctrl-C during generation ends it at once: `LLM.generate` raises KeyboardInterrupt while the
device is still working (either scheduler), its threads end without a traceback and the LLM
stays usable; `jspec generate` exits with status 130 and one line, whether compiling or
decoding, even where Ctrl-C lands inside a finalizer."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import jspec
from jspec import timing
from jspec.schedulers import continuous, waves

DEVICE_THREADS = ("jspec-dispatch", "jspec-device")  # the schedulers' device work
# Two lengths that share a cache bucket (512 slots at max_model_len=512): one compile.
LONG = jspec.SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
SHORT = jspec.SamplingParams(temperature=0.0, max_tokens=260, ignore_eos=True)


def _interrupt_when_prefill_launches(monkeypatch, module):
  """A user's Ctrl-C (SIGINT to this process), sent once the call's prefill is launched."""

  class Interrupting(timing.ReadyTime):
    def __init__(self, array):
      super().__init__(array)
      os.kill(os.getpid(), signal.SIGINT)

  monkeypatch.setattr(module, "ReadyTime", Interrupting)


def _device_threads():
  return [t for t in threading.enumerate() if t.name in DEVICE_THREADS]


@pytest.mark.runs_programs_often  # a thousand decode steps
@pytest.mark.parametrize("batching, module", [("continuous", continuous), ("waves", waves)])
def test_ctrl_c_during_generate_raises_at_once_and_leaves_the_llm_usable(batching, module,
                                                                         monkeypatch, request):
  # A user's process: Python's own SIGINT handler, the test on the main thread.
  assert threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
  thread_errors = []
  monkeypatch.setattr(threading, "excepthook", thread_errors.append)
  llm = jspec.LLM(model=jspec.demo_model_path(), dtype="float32", max_model_len=512,
                  batching=batching)
  expected = llm.generate(["In the beginning"], SHORT)[0].token_ids

  with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
    _interrupt_when_prefill_launches(patch, module)
    llm.generate(["In the beginning"], LONG)
  # Raised while the 500 decode steps were still running, not after them.
  running = _device_threads()
  assert running

  for thread in running:  # it ends once its program does, on its own
    thread.join(timeout=120)
    assert not thread.is_alive()
  assert thread_errors == []
  assert llm.generate(["In the beginning"], SHORT)[0].token_ids == expected


@pytest.fixture
def dropping_handler(monkeypatch):
  """Python's default SIGINT handler replaced by one that raises nothing and records each
  signal: a stand-in for a KeyboardInterrupt Python dropped inside a finalizer. Yields the
  handler and its record; the real handler is back afterwards."""
  real = signal.default_int_handler
  swallowed = []
  lost = lambda signum, frame: swallowed.append(signum)
  monkeypatch.setattr(signal, "default_int_handler", lost)
  signal.signal(signal.SIGINT, lost)
  try:
    yield lost, swallowed
  finally:
    signal.signal(signal.SIGINT, real)


def test_a_ctrl_c_whose_exception_was_lost_is_raised_by_the_next_wait(dropping_handler):
  """Python drops a KeyboardInterrupt raised inside a finalizer. The wait still raises within
  one slice, and the handler it found is back in place afterwards."""
  import queue
  from jspec import interrupt
  lost, swallowed = dropping_handler
  items = queue.Queue()
  threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
  threading.Timer(5.0, items.put, (None,)).start()  # the call's result, far later
  start = time.monotonic()
  with pytest.raises(KeyboardInterrupt):
    interrupt.get(items)
  assert swallowed == [signal.SIGINT] and time.monotonic() - start < 2
  assert signal.getsignal(signal.SIGINT) is lost  # the handler found is restored


def test_a_ctrl_c_lost_between_two_waits_is_raised_by_the_next_wait(dropping_handler):
  """Inside a `watch` (a whole generate call), a Ctrl-C whose exception Python dropped while
  the host was between waits is raised by the next wait, at once."""
  import queue
  from jspec import interrupt
  lost, swallowed = dropping_handler
  with interrupt.watch():
    os.kill(os.getpid(), signal.SIGINT)  # no wait under way: the host is busy elsewhere
    time.sleep(0.1)
    assert swallowed == [signal.SIGINT]
    items = queue.Queue()
    items.put("ready at once")
    with pytest.raises(KeyboardInterrupt):
      interrupt.get(items)
  assert signal.getsignal(signal.SIGINT) is lost  # the handler found is restored


def _cli_interrupted_at(line_pattern: str) -> tuple[int, float, str]:
  """`jspec generate` (the demo model, 2000 tokens) sent SIGINT when its stderr prints a line
  matching `line_pattern`: (exit status, seconds from the signal to the exit, stderr)."""
  env = dict(os.environ, JSPEC_PROGRESS="1", JSPEC_COMPILATION_CACHE="off")
  child = subprocess.Popen(
      [sys.executable, "-m", "jspec.cli", "generate", "--prompt", "In the beginning",
       "--max-tokens", "2000", "--ignore-eos", "--max-model-len", "2048", "--dtype", "float32"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  seen = []
  for line in child.stderr:
    seen.append(line)
    if re.fullmatch(line_pattern, line.rstrip("\n")):
      break
  sent = time.monotonic()
  child.send_signal(signal.SIGINT)
  _, rest = child.communicate(timeout=60)
  return child.returncode, time.monotonic() - sent, "".join(seen) + rest


@pytest.mark.parametrize("phase, line", [
    ("compiling", r"compiling continuous .* \.\.\."),
    ("decoding", r"compiling continuous .*: [0-9.]+ s"),  # the compile is done, the loop runs
])
def test_ctrl_c_during_jspec_generate_exits_130_with_one_line(phase, line):
  status, seconds, stderr = _cli_interrupted_at(line)
  assert status == 130
  assert seconds < 3  # the compile takes seconds and the 2000 steps longer: neither waited for
  assert stderr.rstrip("\n").splitlines()[-1] == "jspec: interrupted"
  assert "Traceback" not in stderr and "terminate called" not in stderr


def test_ctrl_c_while_jax_imports_exits_130_with_one_line():
  """Half a second in, the command is still importing JAX (a couple of seconds, before any
  model work): `import jspec` loads nothing heavy, so the handler is already set."""
  child = subprocess.Popen(
      [sys.executable, "-m", "jspec.cli", "generate", "--prompt", "In the beginning",
       "--max-tokens", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, JSPEC_COMPILATION_CACHE="off"))
  time.sleep(0.5)
  child.send_signal(signal.SIGINT)
  _, stderr = child.communicate(timeout=60)
  assert child.returncode == 130
  assert stderr.rstrip("\n").splitlines()[-1] == "jspec: interrupted"
  assert "Traceback" not in stderr and "Exception ignored" not in stderr


def test_import_jspec_loads_no_jax():
  code = "import sys, jspec, jspec.cli; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"


FINALIZER_SCRIPT = """
import os, signal
from jspec import cli
cli._exit_on_ctrl_c()

class Finalized:
  def __del__(self):  # Ctrl-C lands here, as it can in any finalizer
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):
      pass

Finalized()
print("ran to the end")
"""


def test_ctrl_c_inside_a_finalizer_still_ends_the_command():
  """Python drops a KeyboardInterrupt raised inside a finalizer ("Exception ignored in ..."):
  the command's handler exits from the signal itself instead."""
  run = subprocess.run([sys.executable, "-c", FINALIZER_SCRIPT], capture_output=True,
                       text=True, timeout=120)
  assert run.returncode == 130
  assert "ran to the end" not in run.stdout
  assert run.stderr.rstrip("\n").splitlines()[-1] == "jspec: interrupted"


def test_the_command_gives_back_the_ctrl_c_handler_it_found(tmp_path):
  """`main` called in-process (a notebook, these tests) leaves Ctrl-C as it found it, here
  after a command that fails on a missing model."""
  from jspec import cli
  before = signal.getsignal(signal.SIGINT)
  assert cli.main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
  assert signal.getsignal(signal.SIGINT) is before
