"""Test-wide settings: float32 exactness on CPU, quiet progress, the `gpu` marker's skip,
compiled programs released before a long-lived worker runs out of memory mappings, one
OpenBLAS thread, the garbage collector's pace, and optimised code for the tests marked
`runs_programs_often`."""

import gc
import os
import sys

os.environ.setdefault("JSPEC_PROGRESS", "0")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# NumPy's OpenBLAS starts a thread per core that spins while it waits for work: beside the
# suite's other worker and XLA's own threads, 3.5% of a test's CPU samples (perf, 2 cores)
# went to that spinning. One thread: the suite's few NumPy products are small.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

import shared_executables  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Tracing allocates millions of short-lived objects, and at Python's default thresholds (700,
# 10, 10) its collector ran often enough to take 3-4% of a test process's CPU samples (perf),
# rescanning the imported modules' objects each time. Those are frozen out of its scans, and
# it runs less often: 5% less time on two test files (BENCHMARKS.md). The memory-mapping
# release below still collects at once when it empties the caches.
gc.freeze()
gc.set_threshold(20_000, 50, 1000)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def has_gpu() -> bool:
  return any(d.platform == "gpu" for d in jax.devices())


# The CPU suite compiles each distinct program once per process (see shared_executables).
if not has_gpu():
  shared_executables.install()


# Tests that hold tens of GB of GPU memory (DeepSeek-V3's experts: 22.5 GB in bf16, drawn in
# float32): `make test-gpu` runs them in a process of their own after the others, which share
# the GPU in parallel processes that never give back the memory they have taken.
LARGE_GPU_MEMORY = pytest.mark.large_gpu_memory


def large_gpu_memory_cases(names, large=lambda name: name.startswith("deepseek")):
  """`names` for a parametrize, those that are `large` marked LARGE_GPU_MEMORY."""
  return [pytest.param(n, marks=LARGE_GPU_MEMORY) if large(n) else n for n in names]


def pytest_collection_modifyitems(config, items):
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU: jax.devices() has none (run `make test-gpu` "
                                 "on a GPU machine)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


# ---- optimised code for the tests that run their programs thousands of times ---------------
# The suite compiles at XLA's -O0 (the Makefile): most programs run a few times, and LLVM's
# optimisations would cost more compile time than they save. A distribution test draws
# thousands of samples through the same few programs, whose -O0 code runs about 3x slower
# than -O2's (BENCHMARKS.md): marked `runs_programs_often`, its programs (and its module's
# fixtures', when it is the first to build them) are compiled at -O2.
RUNS_PROGRAMS_OFTEN_LEVEL = 2


@pytest.hookimpl(tryfirst=True)  # before pytest's own setup builds the test's fixtures
def pytest_runtest_setup(item):
  if item.get_closest_marker("runs_programs_often") is not None:
    shared_executables.OPTIMIZATION_LEVEL = RUNS_PROGRAMS_OFTEN_LEVEL


# ---- compiled programs released before the process runs out of memory mappings -------------
# Every compiled CPU program maps its code and data into the process: an LLM's loop adds a few
# hundred mappings, an interpret-mode Pallas kernel ~300. A pytest-xdist worker that runs half
# the suite keeps every program its caches hold (JAX's jit caches, the tests' lru_caches of
# LLMs), and past the kernel's vm.max_map_count (65530 by default) the next compilation
# aborts the process inside XLA's CPU compiler ("Fatal Python error: Aborted", the worker
# lost). So a worker whose mappings pass a share of the limit empties those caches: after a
# test module (its module-scoped fixtures torn down), or after any test once it is close.

def _map_limit() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except OSError:  # not Linux: no such limit to mind
    return 0


MAP_LIMIT = _map_limit()
RELEASE_AFTER_MODULE, RELEASE_NOW = 0.4, 0.8  # shares of MAP_LIMIT


def _mappings() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


def release_compiled_programs():
  """Empties JAX's caches and every lru_cache of the loaded test modules (the LLMs they hold
  own their compiled programs), then collects, so that the programs are unmapped."""
  tests_dir = os.path.dirname(os.path.abspath(__file__))
  for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None) or ""
    if os.path.dirname(os.path.abspath(path)) != tests_dir:
      continue
    for value in list(vars(module).values()):
      if callable(getattr(value, "cache_clear", None)):  # functools.lru_cache / cache
        value.cache_clear()
  jax.clear_caches()
  gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
  yield  # fixtures that end with this test (or its module) are torn down first
  shared_executables.OPTIMIZATION_LEVEL = None  # set by pytest_runtest_setup
  if not MAP_LIMIT:
    return
  module_ends = nextitem is None or nextitem.module is not item.module
  share = RELEASE_AFTER_MODULE if module_ends else RELEASE_NOW
  if _mappings() > share * MAP_LIMIT:
    release_compiled_programs()


@pytest.fixture
def fresh_traces():
  """For a test that sets module settings read while a program is traced (e.g.
  fp8_gemm.DEFAULT_ACTIVATIONS, fp8_experts.X_E4M3): JAX's caches emptied before and after it,
  so that a module-level jitted function's trace made under another value neither serves the
  test nor outlives it into later tests of the worker."""
  jax.clear_caches()
  yield
  jax.clear_caches()


@pytest.fixture
def interpreted_on_every_device(monkeypatch):
  """Mosaic GPU interpret mode (jax 0.11.2) assumes one kernel runs at a time: when a cluster
  finishes it resets the interpreter's per-cluster state, and at a kernel's end it asserts
  that no barrier is allocated, both over the state of every device ("clusters are executed
  sequentially", gpu_callbacks.cluster_finished). Under shard_map each CPU device interprets
  its own kernel concurrently, so one device would reset or see another's live state. Here
  those two global steps are skipped; each buffer and barrier is still freed and checked."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, shared_memory
  monkeypatch.setattr(gpu_callbacks, "cluster_finished", lambda *, token: token)
  monkeypatch.setattr(shared_memory.GPUSharedMemory, "assert_no_barriers_allocated",
                      lambda self: None)


# ---- xdist: each worker takes a contiguous half of the suite, the idle one steals ----------
# `-n 2` defaults to --dist load, which hands out the collection in ever smaller chunks,
# alternately: by the end the files run two tests here, two there, and both workers compile the
# programs that a file's tests share (its baselines, its cached LLMs). Work stealing starts
# each worker on a contiguous half and moves whole runs of tests from the busy end of one queue
# only when the other runs dry, so a file's shared programs are mostly compiled once.

@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: xdist may be absent
def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "load":  # an explicit --dist is kept
    return None
  from xdist.scheduler import WorkStealingScheduling  # noqa: PLC0415
  return WorkStealingScheduling(config, log)
