"""Dispatches run back to back on a worker thread, so the device never waits on the host.

The continuous scheduler (jspec.schedulers.continuous) launches each dispatch as soon as the
previous one returns, *before* the host reads that one's finished rows.
"""

from __future__ import annotations

import queue as queues

from jspec import interrupt


class DispatchChain:
  """Runs dispatches back to back on a worker thread, each on the state the last one returned,
  until one's output satisfies `is_last`.

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

  def __init__(self, launch, state, budget: int, is_last=lambda finished: False):
    self._launch = launch
    self._is_last = is_last
    self.budget = budget  # iterations for the next launch; the host adapts it
    self._finished = queues.Queue()
    self._permits = queues.Queue()
    self._closed = False
    self._permits.put(True)  # the second dispatch runs while the host collects the first
    self._thread = interrupt.start_thread(self._run, state, name="jspec-dispatch")

  def _run(self, state):
    try:
      while True:
        state, finished = self._launch(state, self.budget)
        self._finished.put(finished)
        if self._is_last(finished) or not self._permits.get() or self._closed:
          return
    except BaseException as err:  # re-raised on the host's thread by next()
      self._finished.put(err)

  def next(self):
    """The next dispatch's Finished rows, once its launch has returned."""
    item = interrupt.get(self._finished)
    if isinstance(item, BaseException):
      raise item
    return item

  def proceed(self):
    self._permits.put(True)

  def close(self, wait: bool = True):
    """No dispatch after the one under way; `wait`: until that one has returned."""
    self._closed = True
    self._permits.put(False)
    if wait:
      self._thread.join()
