# `make demo` and `make test` create or refresh .venv with a Python >= 3.12, install jspec, run.
VENV := .venv
PY := $(VENV)/bin/python
# Installed: jspec and its dependencies (all `make demo` needs); then the extras for the
# tests, benchmarks and training (`make test`).
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
# The CPU suite's programs are small and each is compiled once: LLVM at -O0 compiles them
# sooner than the optimised code would save (about 15% of the suite's time; the tests that run
# their programs thousands of times compile at -O2, tests/conftest.py). XLA's CPU compiler then
# spent most of a compile emitting each fusion through its MLIR fusion emitters, a context and
# pass pipeline per fusion; its former emitters compile the same fusions in about half the
# time. Its fast-compile preset and one LLVM module a program, not several compiled on threads
# (the suite's two workers keep both cores busy), take off another tenth (BENCHMARKS.md).
CPU_TEST_XLA_FLAGS := --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 \
  --xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters \
  --xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE --xla_cpu_parallel_codegen_split_count=1
CPU_DEVICES := XLA_FLAGS="$(CPU_TEST_XLA_FLAGS)"
export JSPEC_COMPILATION_CACHE ?= $(CURDIR)/.cache/xla

.PHONY: demo test test-gpu venv clean

# pip is upgraded first: a current one installs jspec's dependencies in about 2/3 of the time
# Python 3.12.1's own pip 23.2 takes (20 s + 2 s for the upgrade against 30 s on 2 cores).
# --no-compile: pip would byte-compile every module of every package (transformers alone has
# thousands), half of a fresh install's time; Python compiles the few hundred that jspec
# imports when it first imports them.
$(STAMP): pyproject.toml scripts/find_python.sh
	@python=$$(scripts/find_python.sh) || exit 1; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then \
	  echo "creating $(VENV) with $$python"; rm -rf $(VENV); $$python -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check --no-compile -e .
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check --no-compile -e '.[test,bench,train]'
	@touch $(DEV_STAMP)

venv: $(DEV_STAMP)

demo: $(STAMP)
	$(VENV)/bin/jspec demo

# CPU suite: 8 fake devices so that every mesh shape runs on one machine. No persistent
# compilation cache: writing some large CPU executables into it crashes jaxlib 0.11.2.
# Bytecode written even where the environment sets PYTHONDONTWRITEBYTECODE: without it each of
# the suite's Python processes (2 workers, ~8 subprocesses) parses jax, transformers and the
# rest from source, 8.8 s of CPU for a collection against 2.6 s with .pyc files.
# TESTS narrows the run to files or test ids under the same settings
# (`make test TESTS=tests/test_hybrid.py`).
TESTS ?= tests
test: $(DEV_STAMP)
	$(CPU_DEVICES) PYTHONDONTWRITEBYTECODE= JSPEC_PROGRESS=0 JSPEC_COMPILATION_CACHE=off \
	  $(PY) -m pytest -q -n 2 -m "not gpu" $(TESTS)

# On a GPU runner: after `pip install -e '.[cuda,test]'`, or with a jax that is already there
# (no registry access), the checkout as it is. PYTHON names another interpreter. The tests
# spend most of their time compiling, on the CPU cores: where pytest-xdist is installed they
# run in GPU_WORKERS processes (0: one) that share the GPUs, each taking GPU memory as it needs
# it rather than 75% of every GPU at start (and keeping it): one per two CPU cores, at most 16
# (16 on 2 H200 with 32 cores: 6 min 5 s, BENCHMARKS.md).
# The few that hold tens of GB (marked large_gpu_memory) run afterwards in one process, alone.
PYTHON ?= python3
GPU_WORKERS ?= $(shell n=$$(( $$(nproc 2>/dev/null || echo 8) / 2 )); [ $$n -gt 16 ] && n=16; \
                 [ $$n -lt 1 ] && n=1; echo $$n)
GPU_PYTEST := PYTHONPATH=. JSPEC_PROGRESS=0 XLA_PYTHON_CLIENT_PREALLOCATE=false $(PYTHON) -m pytest -q
test-gpu:
	@workers=$$($(PYTHON) -c 'import xdist' 2>/dev/null && echo "-n $(GPU_WORKERS)"); set -x; \
	$(GPU_PYTEST) $$workers --durations=15 -m "gpu and not large_gpu_memory" tests; status=$$?; \
	$(GPU_PYTEST) --durations=5 -m "gpu and large_gpu_memory" tests || status=1; exit $$status

clean:
	rm -rf $(VENV) .cache
