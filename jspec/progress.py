"""Progress display for long host-side work (loading, compiling buckets, benchmarking).

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
