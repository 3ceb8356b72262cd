"""Ctrl-C during generation: raised on the caller's thread at once, whatever the device does.

Python runs signal handlers only on the main thread and only between bytecodes. A main thread
blocked in C++ (a compile, a device wait, or on a GPU the launch of a while loop, which
returns only when the loop has ended) would see Ctrl-C only when that call returns, after
the whole generation; a thread blocked on a plain lock may not see it either when the signal
lands on another thread. So long device work runs on a daemon thread (`call`, and the
continuous scheduler's DispatchChain) and the caller waits for it in short slices (`get`),
between which a pending KeyboardInterrupt is raised.

After an interrupt the thread finishes the call it is in (a device program cannot be stopped
midway) and ends without a word; what it returns is dropped, and the LLM stays usable (every
call builds its own state). At interpreter exit such a thread is waited for: Python 3.12 ends
daemon threads still inside C++ by unwinding their stacks, which aborts the process
("terminate called ..."). A second Ctrl-C during that wait ends the process at once
(status 130), as does `jspec generate`'s first.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue as queues
import signal
import sys
import threading
import weakref

POLL_SECONDS = 0.05  # the longest a pending Ctrl-C waits to be raised
# Whether `call_all` runs its functions side by side (else one after the other, on one thread;
# benchmarks time both).
SIDE_BY_SIDE = True
# Whether compile_programs starts each program's compile as soon as it is lowered (else once
# every program is lowered, as before; benchmarks time both).
COMPILE_WHILE_LOWERING = True

_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_exit_registered = False


def get(items: queues.Queue):
  """items.get(), in slices that let a pending KeyboardInterrupt through.

  Python drops a KeyboardInterrupt that its handler raises inside a finalizer or a weakref
  callback ("Exception ignored in ..."), and a waiting main thread runs them often (JAX's
  garbage-collection hook among them): a Ctrl-C could then be lost and the call run to its end.
  So while it waits (and through a whole `watch`), Python's own SIGINT handler (where no other
  is set) also notes the Ctrl-C, and the next slice raises one that was lost."""
  with watch() as lost:
    while True:
      if lost.is_set():
        raise KeyboardInterrupt
      try:
        return items.get(timeout=POLL_SECONDS)
      except queues.Empty:
        continue


_watching: threading.Event | None = None  # the outermost watch's Event (main thread only)


@contextlib.contextmanager
def watch():
  """Ctrl-C noted from here to the end of the block (`get`'s rule): a call wraps its whole
  generation, so that a Ctrl-C whose exception Python dropped between two waits (while the
  host prepares the call or collects its rows) is still raised by the next wait. Nested
  watches share the outermost one's Event."""
  global _watching
  if threading.current_thread() is not threading.main_thread():
    yield threading.Event()  # never set: Python runs signal handlers on the main thread only
    return
  if _watching is not None:
    yield _watching
    return
  with _noting_ctrl_c() as noted:
    _watching = noted
    try:
      yield noted
    finally:
      _watching = None


@contextlib.contextmanager
def _noting_ctrl_c():
  """An Event set by every SIGINT while inside, on the main thread where Python's default
  handler is in place; elsewhere an Event never set."""
  noted = threading.Event()
  previous = signal.getsignal(signal.SIGINT)
  if (threading.current_thread() is not threading.main_thread()
      or previous is not signal.default_int_handler):
    yield noted
    return

  def handler(signum, frame):
    noted.set()
    previous(signum, frame)

  signal.signal(signal.SIGINT, handler)
  try:
    yield noted
  finally:
    signal.signal(signal.SIGINT, previous)


def start_thread(target, *args, name: str) -> threading.Thread:
  """A started daemon thread that runs device work, waited for at interpreter exit."""
  global _exit_registered
  if not _exit_registered:  # after JAX's exit hooks (which clear its backends): runs first
    atexit.register(_wait_at_exit)
    _exit_registered = True
  thread = threading.Thread(target=target, args=args, name=name, daemon=True)
  _threads.add(thread)
  thread.start()
  return thread


def call(fn, *args, name: str = "jspec-device"):
  """fn(*args) on a daemon thread, its result (or exception) returned on the caller's."""
  (value,) = call_all([lambda: fn(*args)], name=name)
  return value


def call_all(fns, name: str = "jspec-device") -> list:
  """Each fn() on a daemon thread of its own, all at once: their results in order, or the
  first exception (in order) once every one has ended. Why: XLA compiles in C++ without the
  GIL, so the programs of one shape (prefill and the loop of steps) compile side by side."""
  if not SIDE_BY_SIDE and len(fns) > 1:
    return call(lambda: [fn() for fn in fns], name=name)
  results = [queues.Queue(maxsize=1) for _ in fns]
  for i, (fn, result) in enumerate(zip(fns, results)):
    start_thread(_run_into, fn, result, name=name if len(fns) == 1 else f"{name}-{i}")
  return _values([get(result) for result in results])


def _run_into(fn, result: queues.Queue):
  """fn()'s (True, result) or (False, exception) into `result`, for the caller's thread."""
  try:
    result.put((True, fn()))
  except BaseException as err:  # re-raised on the caller's thread
    result.put((False, err))


def _values(outcomes) -> list:
  """The values of (ok, value) outcomes, or the first failure's exception raised."""
  for ok, value in outcomes:
    if not ok:
      raise value
  return [value for _, value in outcomes]


def compile_programs(lowerings) -> list:
  """The compiled programs of `lowerings` (functions that each lower one program): lowered
  one after the other on one thread (tracing sets attributes on modules the programs share),
  each compiled on a thread of its own from the moment it is lowered, so that a program's
  compile runs while the next one is lowered (XLA compiles without the GIL: on an H200 the
  FP8 loop's 2.1 s of lowering came after its prefill's lowering and before either compile
  started, BENCHMARKS.md, "Warm-up: …"); and each program's Mosaic GPU kernels compiled on a
  thread of their own meanwhile (jspec.pallas_kernels.precompile). Without SIDE_BY_SIDE, one
  after the other."""
  if not SIDE_BY_SIDE:
    return call(lambda: [lower().compile() for lower in lowerings])
  from jspec.pallas_kernels import precompile
  precompile.before_lowering(start_thread)
  if not COMPILE_WHILE_LOWERING:
    lowered = call(lambda: [lower() for lower in lowerings])
    for program in lowered:
      precompile.start(program, start_thread)
    return call_all([program.compile for program in lowered])
  results = [queues.Queue(maxsize=1) for _ in lowerings]

  def lower_all():
    for i, (lower, result) in enumerate(zip(lowerings, results)):
      try:
        program = lower()
      except BaseException as err:
        for rest in results[i:]:
          rest.put((False, err))
        raise
      precompile.start(program, start_thread)  # its Mosaic GPU kernels, meanwhile
      start_thread(_run_into, program.compile, result, name=f"jspec-compile-{i}")

  try:
    call(lower_all, name="jspec-lower")
  finally:
    outcomes = [get(result) for result in results]
  return _values(outcomes)


def exit_now(code: int = 130):
  """Ends the process without waiting for device work under way (stdout, stderr flushed)."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(code)


def _wait_at_exit():
  try:
    for thread in list(_threads):
      while thread.is_alive():
        thread.join(POLL_SECONDS)
  except KeyboardInterrupt:
    exit_now(130)
