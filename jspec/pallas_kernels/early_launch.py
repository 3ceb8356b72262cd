"""Programmatic dependent launch (PDL) between a step's kernels, on Hopper.

Why: at batch 1 a step is a chain of short kernels, and each one's launch and first loads
(about 2-3 µs for an FP8 product: BENCHMARKS.md, "Inside the FP8 few-row kernel") wait for the
kernel before it to end. With PDL a kernel launched with the programmatic-serialization
attribute may start once every program of the kernel before it has signalled
`griddepcontrol.launch_dependents` (or ended), and it waits for that kernel's writes only where
it calls `griddepcontrol.wait`.

  launch_dependents_at(program)  in a Pallas (Triton) kernel: `program` (an int32 program
                                 id) after the signal, to index the kernel's first loads with,
                                 so that the signal comes before them.
  mark_uses_pdl()                Mosaic GPU kernels that call griddepcontrol_wait carry
                                 "uses_pdl" in their custom call's backend config too, where
                                 XLA looks for it (with --xla_gpu_enable_pdl) to launch them
                                 with the attribute inside its command buffers.

`TRIGGER`: whether the row kernels signal (jspec.pallas_kernels.row_norms, mla_merge).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform

TRIGGER = False
_LANES = 32


def launch_dependents_at(program):
  """`program` (an int32 scalar) unchanged, read back through an asm block that signals
  griddepcontrol.launch_dependents first; `program` itself where TRIGGER is off or off the
  GPU (the interpreter has no such instruction)."""
  if not (TRIGGER and platform.on_gpu()):
    return program
  lanes = jnp.full((_LANES,), program, jnp.int32)
  (out,) = pltriton.elementwise_inline_asm(
      "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[lanes],
      constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct((_LANES,), jnp.int32)])
  # The minimum is `program`; LLVM cannot see it, so the signal stays before the loads.
  return jnp.min(out)


@functools.cache
def mark_uses_pdl():
  """Wraps Mosaic GPU's custom-call emission (once): a kernel module that carries
  `mosaic_gpu.uses_pdl` gets `uses_pdl = true` in its backend config."""
  from jax.experimental.mosaic.gpu import core as mgpu_core
  from jax._src.lib.mlir import ir
  emit = mgpu_core.mlir.custom_call

  def custom_call(call_target_name, *args, backend_config=None, **kwargs):
    if (call_target_name == "mosaic_gpu_v2" and isinstance(backend_config, dict)
        and b"mosaic_gpu.uses_pdl" in ir.StringAttr(backend_config["module"]).value_bytes):
      backend_config = {**backend_config, "uses_pdl": ir.BoolAttr.get(True)}
    return emit(call_target_name, *args, backend_config=backend_config, **kwargs)

  mgpu_core.mlir = _ModuleWith(mgpu_core.mlir, custom_call=custom_call)


class _ModuleWith:
  """A module with some of its names replaced."""

  def __init__(self, module, **names):
    self._module, self._names = module, names

  def __getattr__(self, name):
    return self._names[name] if name in self._names else getattr(self._module, name)
