"""Mosaic GPU kernels compiled ahead of the programs that call them, on a thread of their own.

Why: jaxlib compiles a program's Mosaic GPU kernels when it loads the program, one at a time
under one process-wide lock (CachedCompileAndInit), after XLA's own passes over that program.
On an H200 the warm-up of Qwen3-30B-A3B in FP8 (12 layers) spent 7.0 s in 9 such compiles back
to back, all after its 4.2 s of lowering (BENCHMARKS.md, "Warm-up: …"). jaxlib keeps each
compiled kernel for the process, keyed by the hash of its module, so a kernel compiled alone
beforehand is not compiled again when a program holding it loads.

How: `ahead(kernel, name)` wraps a Mosaic GPU kernel's callable (plgpu.kernel's). The first
time a program's tracing calls it with given argument shapes, it queues the compile of the
kernel alone on those shapes (jit, lower, compile) on one background thread, then calls the
kernel as before; the compile runs while the rest of the program is traced, lowered and
compiled. Only on a GPU; kernels that talk to other devices are not wrapped (their modules
depend on the mesh they run in).
"""

from __future__ import annotations

import logging
import queue as queues
import threading

import jax

from jspec.pallas_kernels import platform

# Benchmarks turn it off to time the warm-up without it.
ENABLED = True

_queued: set = set()
_jobs: queues.Queue = queues.Queue()
_lock = threading.Lock()
_worker: list = []  # the one background thread, once started


def ahead(kernel, name: str):
  """`kernel` (a Mosaic GPU kernel's callable), its compile queued on its first call per
  argument shapes (see the module docstring); called as it is."""
  def call(*args):
    # Traced into a program only: an eager call compiles the kernel at once anyway.
    if ENABLED and platform.on_gpu() and any(isinstance(a, jax.core.Tracer) for a in args):
      shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
      _queue((name, shapes), kernel, shapes)
    return kernel(*args)
  return call


def _queue(key, kernel, shapes):
  from jspec import interrupt
  with _lock:
    if key in _queued:
      return
    _queued.add(key)
    _jobs.put((key, kernel, shapes))
    if not _worker:  # waited for at exit: a compile cut off by the interpreter's end can crash
      _worker.append(interrupt.start_thread(_compile_queued, name="jspec-precompile"))


def _compile_queued():
  while True:
    try:
      key, kernel, shapes = _jobs.get(timeout=1.0)
    except queues.Empty:
      with _lock:
        if _jobs.empty():  # a later kernel starts a new thread
          _worker.clear()
          return
      continue
    try:
      jax.jit(kernel).lower(*shapes).compile()
    except Exception as err:  # the program's own compile reports what is wrong
      logging.getLogger(__name__).debug("precompile of %s failed: %s", key[0], err)
    finally:
      _jobs.task_done()


def wait():
  """Returns once every queued compile has ended."""
  _jobs.join()
