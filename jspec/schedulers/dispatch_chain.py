"""Dispatches run back to back on a worker thread, so the device never waits on the host.

The continuous scheduler (jspec.schedulers.continuous) launches each dispatch as soon as the
previous one returns, *before* the host reads that one's finished rows.
"""

from __future__ import annotations

import queue as queues

from jspec import interrupt


class DispatchChain:
  """Runs `start()` (the call's first program: (state, a value for the host)) and then
  dispatches back to back on a worker thread, each on the state the last one returned, until
  one's output satisfies `is_last`. The first dispatch follows the start program on the same
  thread with nothing in between, as the wave scheduler's loop follows its prefill.

  On a GPU the launching thread drives a dispatch's while loop (it reads the loop condition
  back each iteration), so a launch returns only when its dispatch is done. The worker
  therefore launches the next dispatch as soon as the last one returns, without waiting on the
  host, and hands the host the finished rows. It runs at most one dispatch ahead of the
  host's collecting: the host allows each further dispatch with `proceed()` once it has
  collected the one before, and `close()` lets the last launched one end the chain. On a CPU a
  launch returns at once and the same order holds. The host waits in slices (jspec.interrupt),
  so Ctrl-C reaches it at once; `close(wait=False)` then ends the chain after the dispatch
  under way without waiting for it.
  """

  def __init__(self, launch, start, budget: int, is_last=lambda finished: False):
    self._launch = launch
    self._is_last = is_last
    self.budget = budget  # iterations for the next launch; the host adapts it
    self._started = queues.Queue(maxsize=1)
    self._finished = queues.Queue()
    self._permits = queues.Queue()
    self._closed = False
    self._ended = False  # the last dispatch's output has reached the host
    self._permits.put(True)  # the second dispatch runs while the host collects the first
    self._thread = interrupt.start_thread(self._run, start, name="jspec-dispatch")

  def _run(self, start):
    try:
      state, for_host = start()
      self._started.put(for_host)
      while True:
        state, finished = self._launch(state, self.budget)
        self._finished.put(finished)
        if self._is_last(finished) or not self._permits.get() or self._closed:
          return
    except BaseException as err:  # re-raised on the host's thread by started() or next()
      if self._started.empty():
        self._started.put(err)
      self._finished.put(err)

  def started(self):
    """The start program's value for the host, once it has been launched."""
    item = interrupt.get(self._started)
    if isinstance(item, BaseException):
      raise item
    return item

  def next(self):
    """The next dispatch's Finished rows, once its launch has returned."""
    item = interrupt.get(self._finished)
    if isinstance(item, BaseException):
      raise item
    self._ended = bool(self._is_last(item))
    return item

  def proceed(self):
    self._permits.put(True)

  def close(self, wait: bool = True):
    """No dispatch after the one under way; `wait`: until that one has returned (at once
    when the host has had the last one's output: the thread launches nothing after it)."""
    self._closed = True
    self._permits.put(False)
    if wait and not self._ended:
      self._thread.join()
