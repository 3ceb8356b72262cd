"""The CPU suite's compile hook (tests/shared_executables.py): one executable per distinct
program in a process, and XLA's optimisation level raised for the tests marked
`runs_programs_often` alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lib import xla_client

import conftest
import shared_executables

pytestmark = pytest.mark.skipif(conftest.has_gpu(), reason="the hook is installed on CPU only")


@pytest.fixture
def compiled_levels(monkeypatch):
  """The optimisation level of each program XLA is asked to compile during the test."""
  levels = []
  compile_program = shared_executables._compile

  def recording(backend, module, devices, options, host_callbacks):
    levels.append(options.executable_build_options.debug_options.xla_backend_optimization_level)
    return compile_program(backend, module, devices, options, host_callbacks)

  monkeypatch.setattr(shared_executables, "_compile", recording)
  return levels


def _new_program(seed: int):
  """A function JAX has not traced before, whose program is new to XLA too (its constant)."""
  return jax.jit(lambda x: jnp.sin(x) * seed + jnp.float32(seed) / 7.0)


def test_the_same_program_from_two_functions_is_compiled_once(compiled_levels):
  seed = int(np.random.default_rng(11).integers(1 << 20, 1 << 30))
  x = np.arange(5, dtype=np.float32)  # NumPy: no eager program of its own
  first, second = _new_program(seed), _new_program(seed)  # two Python functions, one program
  np.testing.assert_array_equal(first(x), second(x))
  assert len(compiled_levels) == 1


def _environment_level() -> int:
  """XLA's optimisation level from XLA_FLAGS (the Makefile's -O0), as JAX's options carry it."""
  options = xla_client.CompileOptions()
  return options.executable_build_options.debug_options.xla_backend_optimization_level


def test_an_unmarked_test_compiles_at_the_environments_level(compiled_levels):
  assert shared_executables.OPTIMIZATION_LEVEL is None
  seed = int(np.random.default_rng(12).integers(1 << 20, 1 << 30))
  _new_program(seed)(np.ones(3, np.float32))
  assert compiled_levels == [_environment_level()]


@pytest.mark.runs_programs_often
def test_a_marked_test_compiles_at_the_raised_level_and_keeps_both_executables(
    compiled_levels):
  assert shared_executables.OPTIMIZATION_LEVEL == conftest.RUNS_PROGRAMS_OFTEN_LEVEL
  seed = int(np.random.default_rng(13).integers(1 << 20, 1 << 30))
  x = np.linspace(0.0, 1.0, 4, dtype=np.float32)
  raised = _new_program(seed)(x)
  shared_executables.OPTIMIZATION_LEVEL = None  # the same program at the environment's level
  unraised = _new_program(seed)(x)
  # The level is part of the key: at another level the program is compiled again.
  levels = [conftest.RUNS_PROGRAMS_OFTEN_LEVEL, _environment_level()]
  assert compiled_levels == levels[:1 if levels[0] == levels[1] else 2]
  np.testing.assert_allclose(raised, unraised, rtol=1e-6)
