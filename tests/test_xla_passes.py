"""XLA's per-pass log read back by program (jspec.bench.xla_passes): lines in XLA's own format,
two programs compiled side by side on two threads, a module the autotuner compiles inside a
pass, and lines that are not pass lines."""

import pytest

from jspec.bench import xla_passes

def _line(clock, thread, message, source="hlo_pass_pipeline.cc:206"):
  """A line as glog writes it: severity and date, time, thread, source, message."""
  return f"I1202 15:08:{clock:09.6f} {thread:>7d} {source}] {message}\n"


def _timed(name, value, unit):
  return f"HLO pass: {name} time: {value} {unit} ({value} {unit}) (cumulative: ..., #called: 1)"


LOG = [
    _line(14.0, 2171, "Running HLO pass pipeline on module jit_start_fn: optimization",
          "hlo_pass_pipeline.cc:302"),
    _line(14.1, 2213, "Running HLO pass pipeline on module jit_dispatch_fn: optimization",
          "hlo_pass_pipeline.cc:302"),
    _line(14.5, 2171, _timed("algsimp", 250, "ms")),
    _line(15.0, 2213, _timed("algsimp", 900, "us")),
    _line(15.1, 2171, "Running HLO pass pipeline on module gemm_fusion_dot.6: autotune",
          "hlo_pass_pipeline.cc:302"),
    _line(15.2, 2171, _timed("dce", 10, "ms")),
    "some other line a program prints\n",
    _line(17.0, 2171, _timed("priority-fusion", 1.5, "s")),
    _line(17.5, 2171, _timed("algsimp", 0.5, "s")),
    _line(17.6, 2171, _timed("algsimp", 9, "s"), "other_file.cc:10"),  # not the pipeline's log
]


def test_passes_are_summed_by_program_and_thread_longest_first():
  start, dispatch = xla_passes.module_passes(LOG)
  assert (start.module, start.thread) == ("jit_start_fn", "2171")
  assert start.seconds == pytest.approx(3.5)
  # The autotuner's module compiled inside a pass counts for the program that compiled it.
  assert dict(start.passes) == pytest.approx({"algsimp": 0.75, "dce": 0.01,
                                              "priority-fusion": 1.5})
  assert (dispatch.module, dispatch.thread) == ("jit_dispatch_fn", "2213")
  assert dispatch.seconds == pytest.approx(0.9)
  assert dict(dispatch.passes) == pytest.approx({"algsimp": 0.0009})


def test_the_report_lists_each_programs_longest_passes():
  text = xla_passes.report(xla_passes.module_passes(LOG), modules=1, passes=2)
  assert text.splitlines() == [
      "  jit_start_fn (thread 2171): 3.50 s from its first pass to its last",
      "       1.50 s  priority-fusion",
      "       0.75 s  algsimp"]


def test_a_log_without_pass_lines_has_no_programs():
  assert xla_passes.module_passes(["plain output\n", "I1202 15:08:14.0 1 x.cc:1] other\n"]) == []
