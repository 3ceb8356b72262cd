"""Progress display for long host-side work (loading, compiling buckets, benchmarking) and
for generation (a bar over finished requests).

Goes to stderr through tqdm; `JSPEC_PROGRESS=0` silences it (tests set it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from tqdm.auto import tqdm


def enabled() -> bool:
  return os.environ.get("JSPEC_PROGRESS", "1") != "0"


def progress(items, description: str):
  return tqdm(items, desc=description, disable=not enabled(), leave=False, file=sys.stderr)


class RequestProgress:
  """A bar over finished requests, with the output tokens/s so far in its postfix.

  Shown only for calls longer than a moment (tqdm's `delay`: nothing is drawn before it has
  run that long), as vLLM's `use_tqdm`; `bar` may be a tqdm-like class to draw with instead.
  Updated between the loop's device dispatches, never inside them.
  """

  def __init__(self, total: int, show: bool = True, bar=None, delay_s: float = 1.0):
    self.start = time.perf_counter()
    self.tokens = 0
    show = bool(show) and enabled()
    make = bar if callable(bar) else tqdm
    kwargs = dict(total=total, desc="generating", unit="req", disable=not show, file=sys.stderr,
                  dynamic_ncols=True)
    # No bar object when none is shown: a disabled tqdm still costs ~0.1 ms a call.
    self.bar = (None if make is tqdm and not show else
                make(**kwargs, delay=delay_s) if make is tqdm else make(**kwargs))

  def update(self, finished: int, tokens: int):
    """`finished` more requests are done, `tokens` more output tokens were generated."""
    self.tokens += tokens
    seconds = time.perf_counter() - self.start
    if self.bar is None:
      return
    if seconds > 0:
      self.bar.set_postfix_str(f"{self.tokens / seconds:,.0f} tok/s", refresh=False)
    self.bar.update(finished)

  def close(self):
    if self.bar is not None:
      self.bar.close()


def notice(message: str):
  """One line on stderr: a choice made for the user (max_num_seqs="auto"), said even with
  progress off, since results depend on it."""
  print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def stage(description: str):
  """Prints 'description ...' then the seconds it took, for single long steps (a compile)."""
  if not enabled():
    yield
    return
  start = time.perf_counter()
  print(f"{description} ...", file=sys.stderr, flush=True)
  yield
  print(f"{description}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
