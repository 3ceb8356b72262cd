"""interrupt.compile_programs: programs lowered in order on one thread, each compiled from the
moment it is lowered (so the next lowering overlaps it), results in order, errors raised."""

import threading

import pytest

from jspec import interrupt


class FakeLowered:
  def __init__(self, name, log, compiled_event=None, fail=False):
    self.name, self.log, self.compiled_event, self.fail = name, log, compiled_event, fail

  def compile(self):
    self.log.append(("compile", self.name, threading.current_thread().name))
    if self.fail:
      raise RuntimeError(f"{self.name} failed to compile")
    if self.compiled_event is not None:
      self.compiled_event.set()
    return f"compiled {self.name}"


def _lowering(name, log, wait_for=None, **kwargs):
  def lower():
    if wait_for is not None:
      # Lowering b waits for a's compile: it ends only if a compiles while b lowers.
      assert wait_for.wait(timeout=10), "the first program did not compile while b lowered"
    log.append(("lower", name, threading.current_thread().name))
    return FakeLowered(name, log, **kwargs)
  return lower


def test_each_program_compiles_while_the_next_one_lowers():
  log, a_compiled = [], threading.Event()
  result = interrupt.compile_programs([
      _lowering("a", log, compiled_event=a_compiled),
      _lowering("b", log, wait_for=a_compiled),
      _lowering("c", log)])
  assert result == ["compiled a", "compiled b", "compiled c"]
  lowers = [entry for entry in log if entry[0] == "lower"]
  assert [name for _, name, _ in lowers] == ["a", "b", "c"]
  assert len({thread for *_, thread in lowers}) == 1  # one thread lowers, in order
  compiles = {name: thread for kind, name, thread in log if kind == "compile"}
  assert set(compiles) == {"a", "b", "c"} and lowers[0][2] not in compiles.values()


def test_one_by_one_lowers_and_compiles_in_order(monkeypatch):
  monkeypatch.setattr(interrupt, "SIDE_BY_SIDE", False)
  log = []
  result = interrupt.compile_programs([_lowering("a", log), _lowering("b", log)])
  assert result == ["compiled a", "compiled b"]
  assert [(kind, name) for kind, name, _ in log] == [("lower", "a"), ("compile", "a"),
                                                     ("lower", "b"), ("compile", "b")]


@pytest.mark.parametrize("failing", ["lower", "compile"])
def test_a_failing_lowering_or_compile_is_raised_after_the_others_end(failing):
  log = []

  def broken_lower():
    raise ValueError("b failed to lower")

  second = broken_lower if failing == "lower" else _lowering("b", log, fail=True)
  with pytest.raises(ValueError if failing == "lower" else RuntimeError, match="b failed"):
    interrupt.compile_programs([_lowering("a", log), second])
  assert ("compile", "a") in [(kind, name) for kind, name, _ in log]


def test_lower_first_lowers_every_program_before_any_compiles(monkeypatch):
  monkeypatch.setattr(interrupt, "COMPILE_WHILE_LOWERING", False)
  log = []
  result = interrupt.compile_programs([_lowering("a", log), _lowering("b", log)])
  assert result == ["compiled a", "compiled b"]
  kinds = [kind for kind, *_ in log]
  assert kinds[:2] == ["lower", "lower"] and sorted(kinds[2:]) == ["compile", "compile"]


@pytest.mark.parametrize("while_lowering", [True, False])
def test_each_program_goes_to_the_kernel_precompile_before_its_compile(monkeypatch,
                                                                      while_lowering):
  from jspec.pallas_kernels import precompile
  monkeypatch.setattr(interrupt, "COMPILE_WHILE_LOWERING", while_lowering)
  log = []
  monkeypatch.setattr(precompile, "start", lambda program, start_thread: log.append(
      ("precompile", program.name, start_thread is interrupt.start_thread)))
  result = interrupt.compile_programs([_lowering("a", log), _lowering("b", log)])
  assert result == ["compiled a", "compiled b"]
  handed = [(name, ours) for kind, name, ours in log if kind == "precompile"]
  assert handed == [("a", True), ("b", True)]
  for name in ("a", "b"):
    kinds = [kind for kind, entry, _ in log if entry == name]
    assert kinds == ["lower", "precompile", "compile"]
