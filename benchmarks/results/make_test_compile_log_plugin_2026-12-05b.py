"""A pytest plugin for the CPU suite: each real XLA compile behind tests/shared_executables.py's
hook (a program the worker had not compiled yet) as a row of /tmp/compiles_<pid>.tsv: seconds,
host callbacks, devices, the module's name, its digest (the hook's key: the module without
source locations, the compile options, the devices), the test. Releases of the workers'
caches go to /tmp/releases_<pid>.log.

    cp this.py /tmp/plug/compile_log.py
    PYTHONPATH=/tmp/plug PYTEST_ADDOPTS="-p compile_log" make test
"""
import hashlib
import os
import sys
import time

CUR = {"id": None}


def _wrap():
  import shared_executables as se
  real = se._compile

  def logged(backend, module, devices, options, host_callbacks):
    start = time.perf_counter()
    compiled = real(backend, module, devices, options, host_callbacks)
    seconds = time.perf_counter() - start
    attributes = module.operation.attributes
    name = str(attributes["sym_name"]).strip('"') if "sym_name" in attributes else "?"
    digest = hashlib.sha256(se._program_bytes(module))
    digest.update(options.SerializeAsString())
    digest.update(repr([d.id for d in devices]).encode())
    with open(f"/tmp/compiles_{os.getpid()}.tsv", "a") as f:
      f.write(f"{seconds:.3f}\t{int(bool(host_callbacks))}\t{len(devices)}\t{name}\t"
              f"{digest.hexdigest()[:16]}\t{CUR['id']}\n")
    return compiled

  se._compile = logged


def pytest_collection_finish(session):
  _wrap()


def pytest_runtest_logstart(nodeid, location):
  CUR["id"] = nodeid


def pytest_runtest_logfinish(nodeid, location):
  conftest = sys.modules.get("conftest")
  if conftest is not None and not getattr(conftest, "_release_logged", False):
    real = conftest.release_compiled_programs

    def logged():
      with open(f"/tmp/releases_{os.getpid()}.log", "a") as f:
        f.write(f"{CUR['id']}\n")
      real()

    conftest.release_compiled_programs = logged
    conftest._release_logged = True
