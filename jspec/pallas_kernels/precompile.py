"""A lowered program's Mosaic GPU kernels compiled while XLA compiles the program itself.

Why: jaxlib compiles a program's Mosaic GPU kernels when XLA builds the program's thunks, after
its own passes over the program, one at a time under one process-wide lock. On an H200 the FP8
prefill program of Qwen3-30B-A3B (48 layers) spent 11 s in XLA's passes before its 9 kernels'
6.2 s of compiles began (BENCHMARKS.md, "Warm-up: …"). jaxlib keeps each compiled kernel for
the process, keyed by the custom call's `kernel_hash`, so a kernel compiled beforehand is not
compiled again when the program's thunks are built. Compiling a kernel alone from a fresh trace
does not give the same module (tried: the programs compiled their kernels again), so this takes
the custom calls from the program's own lowered module.

How: `start(lowered, start_thread)` walks the lowered module for Mosaic GPU custom calls and,
for each kernel hash not yet seen in this process, builds a one-op program (the call, its
operands as parameters, every attribute kept but the partitioner's shardings) and compiles and
loads it on a background thread, on the process's first device (jaxlib's cache is the
process's). Kernels that exchange data with other devices (their backend config names replica
ids or collective metadata) are left to their programs. A failure only costs the head start: the
program compiles the kernel itself.
"""

from __future__ import annotations

import logging
import threading

TARGET = "mosaic_gpu_v2"
# Benchmarks turn it off to time the warm-up without it.
ENABLED = True
# Whether each kernel is handed over as its custom call is emitted, during the program's
# lowering (watch_lowerings), rather than once the program is lowered: its compile then
# overlaps the rest of the lowering. Measured on an H200, Qwen3-30B-A3B, runs alternating
# (BENCHMARKS.md, "Warm-up: each Mosaic GPU kernel compiled from the moment it is lowered …"):
# 12 layers FP8 10.32 -> 8.65 s (-16%), bf16 7.12 -> 6.5 s; all 48 layers equal (FP8 25.15 /
# 25.0 s), where the prefill program's XLA compile is the long pole.
AT_LOWERING = True

_started: set = set()  # kernel hashes handed to a compile in this process
_lock = threading.Lock()
# What the compiles did in this process: {"compiled": count, "failed": [error text]}.
stats: dict = {"compiled": 0, "failed": []}
_log = logging.getLogger(__name__)


def _failed(where: str, err: Exception, message: str):
  """A failure counted in `stats` (`where` and the error's first line) and logged as a warning:
  the program compiles the kernel itself."""
  first = str(err).splitlines()[0] if str(err) else repr(err)
  with _lock:
    stats["failed"].append(where + first)
  _log.warning("%s: %s", message, err)


def _config(op):
  """The custom call's backend config as a DictAttr: JAX keeps a dict config in
  `mhlo.backend_config` and leaves `backend_config` an empty string."""
  from jax._src.lib.mlir import ir
  for name in ("mhlo.backend_config", "backend_config"):
    if name in op.attributes and isinstance(op.attributes[name], ir.DictAttr):
      return op.attributes[name]
  return None


def _single_device(config) -> bool:
  from jax._src.lib.mlir import ir
  if any(name in config for name in ("xla_replica_ids", "symmetric_memory_parameters")):
    return False
  metadata = "uses_xla_collective_metadata"
  return not (metadata in config and ir.BoolAttr(config[metadata]).value)


def one_op_program(op) -> str:
  """The text of a module whose public @main takes `op`'s (a stablehlo.custom_call) operands
  as parameters and returns its results, with every attribute of the call kept but the
  partitioner's shardings. Text, so that a compile parses it into a context of its own (an
  MLIR context is not for two threads, and the program's own compile reads `op`'s)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import func as func_dialect
  with op.context, ir.Location.unknown():
    one = ir.Module.create()
    one.operation.attributes["sym_name"] = ir.StringAttr.get("jspec_precompile")
    in_types = [value.type for value in op.operands]
    out_types = [result.type for result in op.results]
    with ir.InsertionPoint(one.body):
      main = func_dialect.FuncOp("main", (in_types, out_types))
      main.attributes["sym_visibility"] = ir.StringAttr.get("public")
      block = main.add_entry_block()
      with ir.InsertionPoint(block):
        attributes = {name: op.attributes[name] for name in op.attributes
                      if not (name == "mhlo.sharding" or name.startswith("sdy."))}
        call = ir.Operation.create("stablehlo.custom_call", results=out_types,
                                   operands=list(block.arguments), attributes=attributes)
        func_dialect.ReturnOp(list(call.results))
    return str(one)


def custom_calls(module, target: str) -> list:
  """The stablehlo.custom_call ops of `module` (an ir.Module) that call `target`, in order,
  nested functions included."""
  from jax._src.lib.mlir import ir
  found = []

  def visit(op):
    if (op.name == "stablehlo.custom_call"
        and ir.StringAttr(op.attributes["call_target_name"]).value == target):
      found.append(op)
    return ir.WalkResult.ADVANCE

  with module.context:
    module.operation.walk(visit)
  return found


def _kernel_key(op) -> bytes | None:
  """The kernel hash of `op` (a Mosaic GPU custom call) where it runs on one device, else
  None."""
  from jax._src.lib.mlir import ir
  config = _config(op)
  if config is None or "kernel_hash" not in config or not _single_device(config):
    return None
  return ir.StringAttr(config["kernel_hash"]).value_bytes


def kernel_programs(module) -> list[tuple[bytes, str]]:
  """(kernel hash, one_op_program text) for each distinct single-device Mosaic GPU kernel of
  `module` (an ir.Module), in order of appearance."""
  calls = {}
  with module.context:
    for op in custom_calls(module, TARGET):
      key = _kernel_key(op)
      if key is not None:
        calls.setdefault(key, op)
    return [(key, one_op_program(op)) for key, op in calls.items()]


def _new(found) -> list[str]:
  """The texts of `found` ((hash, text) pairs) whose hash no compile was handed yet, marked
  handed."""
  with _lock:
    new = [text for key, text in found if key not in _started]
    _started.update(key for key, _ in found)
  return new


def before_lowering(start_thread):
  """Call before a program is lowered: where AT_LOWERING is on (on a GPU, ENABLED),
  watch_lowerings."""
  from jspec.pallas_kernels import platform
  if ENABLED and AT_LOWERING and platform.on_gpu():
    watch_lowerings(start_thread)


def watch_lowerings(start_thread):
  """Wraps Mosaic GPU's lowering rule (once per process; Pallas calls it through its module)
  so that, while AT_LOWERING and ENABLED are on, each new single-device kernel is compiled
  (`compile_all` on a thread of `start_thread`) from the moment its custom call is emitted."""
  from jax.experimental.mosaic.gpu import core
  rule = core._mosaic_gpu_lowering_rule
  if getattr(rule, "jspec_watched", False):
    return

  def watched(ctx, *args, **kwargs):
    outs = rule(ctx, *args, **kwargs)
    if ENABLED and AT_LOWERING and len(outs):
      try:
        op = outs[0].owner
        op = getattr(op, "operation", op)
        key = _kernel_key(op) if op.name == "stablehlo.custom_call" else None
        new = [] if key is None else _new([(key, one_op_program(op))])
        if new:
          start_thread(compile_all, new, name="jspec-precompile")
      except Exception as err:  # the program compiles the kernel itself
        _failed("at lowering: ", err, "a Mosaic GPU kernel was not handed over at its lowering")
    return outs

  watched.jspec_watched = True
  core._mosaic_gpu_lowering_rule = watched


def start(lowered, start_thread) -> threading.Thread | None:
  """Compiles `lowered`'s (a jax.stages.Lowered) new Mosaic GPU kernels on a thread started by
  `start_thread(target, *args, name=)` (jspec.interrupt's, which is waited for at exit; see
  the module docstring); the thread, or None where there is none to compile (off a GPU,
  ENABLED off, no new kernel). Call it before the program's own compile starts."""
  from jspec.pallas_kernels import platform
  if not (ENABLED and platform.on_gpu()):
    return None
  try:
    found = kernel_programs(lowered.compiler_ir("stablehlo"))
  except Exception as err:  # a module this cannot read: the program compiles its kernels
    _failed("reading the module: ", err, "no Mosaic GPU kernels compiled ahead")
    return None
  new = _new(found)
  if not new:
    return None
  return start_thread(compile_all, new, name="jspec-precompile")


def compile_text(text: str, device):
  """`text` (a module with a public @main) compiled and loaded on `device` alone."""
  from jax._src import compiler
  from jax._src.interpreters import mlir
  from jax._src.lib import xla_client
  from jax._src.lib.mlir import ir
  with mlir.make_ir_context():
    module = ir.Module.parse(text)
    return compiler.backend_compile_and_load(
        device.client, module, xla_client.DeviceList((device,)),
        compiler.get_compile_options(num_replicas=1, num_partitions=1), [])


def compile_all(texts):
  """Each of `texts` compiled on this process's first device, one after the other (jaxlib
  compiles Mosaic GPU kernels one at a time anyway); a failure is counted and logged, and the
  program then compiles that kernel itself."""
  import jax
  device = jax.local_devices()[0]
  for text in texts:
    try:
      compile_text(text, device)
      with _lock:
        stats["compiled"] += 1
    except Exception as err:
      _failed("", err, "a Mosaic GPU kernel's compile ahead failed")
