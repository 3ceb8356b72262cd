"""One compiled executable per distinct program in a test process.

Many tests build an LLM of their own (a fresh scheduler, a checkpoint edited on disk, one mesh
among several), and JAX compiles each new LLM's programs anew even where XLA is handed a
program it has compiled before: its caches key on the Python functions, which every LLM makes
its own. XLA's compile is most of the CPU suite's time, so here the executable is shared when
the module's bytecode (its constants included, its source locations left out), the compile
options and the devices are the same bytes: the same program on the same devices, whichever
LLM asked. This is the persistent compilation cache's key, kept in memory: writing some
large CPU executables to disk crashes jaxlib 0.11.2. Programs with host callbacks (interpret-mode Pallas kernels) hold pointers to
their own Python objects and are always compiled.

conftest.release_compiled_programs empties EXECUTABLES with the tests' other caches.

OPTIMIZATION_LEVEL, where set, replaces XLA's backend optimisation level (the Makefile's -O0)
in the programs compiled meanwhile: conftest sets it for the tests marked `runs_programs_often`,
which run their programs thousands of times."""

import hashlib
import io

from jax._src import compiler
from jax._src.lib.mlir import passmanager

EXECUTABLES = {}  # key -> LoadedExecutable
OPTIMIZATION_LEVEL: int | None = None
_compile = compiler.backend_compile_and_load


def _program_bytes(module) -> bytes:
  """The module's bytecode (constants and resources included) without source locations, which
  differ between LLMs of the same program: the persistent cache's canonical form."""
  with module.context:
    stripped = module.operation.clone(ip=False)
    passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(stripped)
  bytecode = io.BytesIO()
  stripped.write_bytecode(file=bytecode)
  return bytecode.getvalue()


def _shared_compile(backend, module, executable_devices, options, host_callbacks):
  if OPTIMIZATION_LEVEL is not None:  # before the key: the level is part of the program's key
    options.executable_build_options.debug_options.xla_backend_optimization_level = (
        OPTIMIZATION_LEVEL)
  program = _program_bytes(module)
  if host_callbacks or b"callback" in program:
    return _compile(backend, module, executable_devices, options, host_callbacks)
  digest = hashlib.sha256(program)
  digest.update(options.SerializeAsString())
  digest.update(repr([d.id for d in executable_devices]).encode())
  key = (backend.platform, digest.hexdigest())
  if key not in EXECUTABLES:
    EXECUTABLES[key] = _compile(backend, module, executable_devices, options, host_callbacks)
  return EXECUTABLES[key]


# As for the tests' lru_caches, release_compiled_programs calls it.
_shared_compile.cache_clear = EXECUTABLES.clear


def install():
  compiler.backend_compile_and_load = _shared_compile
