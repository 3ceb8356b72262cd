"""precompile: a lowered program's single-device Mosaic GPU custom calls, each as a program of
its own (the call alone, attributes kept but the partitioner's sharding), compiled on a
background thread once per kernel hash in the process."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from jspec.pallas_kernels import platform, precompile

LAYOUTS = ("operand_layouts = [dense<[1, 0]> : tensor<2xindex>, dense<0> : tensor<1xindex>], "
           "result_layouts = [dense<[1, 0]> : tensor<2xindex>]")


def _call(result, operands, config, target="mosaic_gpu_v2", extra=""):
  return (f'%{result} = stablehlo.custom_call @{target}({operands}) {{api_version = 4 : i32, '
          f'backend_config = {{{config}}}, mhlo.sharding = "{{manual}}", {LAYOUTS}{extra}}} : '
          f'(tensor<4x8xbf16>, tensor<8xf32>) -> tensor<4x8xbf16>')


PROGRAM = f"""
module @program {{
  func.func public @main(%x: tensor<4x8xbf16>, %s: tensor<8xf32>) -> tensor<4x8xbf16> {{
    {_call(0, "%x, %s", 'kernel_hash = "\\01", module = "\\00\\FFa"')}
    {_call(1, "%0, %s", 'kernel_hash = "\\01", module = "\\00\\FFa"')}
    {_call(2, "%1, %s", 'kernel_hash = "\\02", module = "b", uses_xla_collective_metadata = false',
           extra=", has_side_effect = true")}
    {_call(3, "%2, %s", 'kernel_hash = "\\03", module = "c", xla_replica_ids = "0,1"')}
    {_call(4, "%3, %s", 'kernel_hash = "\\04", module = "d", uses_xla_collective_metadata = true')}
    {_call(5, "%4, %s", 'kernel_hash = "\\05"', target="other_target")}
    return %5 : tensor<4x8xbf16>
  }}
}}
"""


def _parse(text):
  ctx = mlir.make_ir_context()
  with ctx:
    return ir.Module.parse(text)


def _custom_calls(module):
  found = []

  def visit(op):
    if op.name == "stablehlo.custom_call":
      found.append(op)
    return ir.WalkResult.ADVANCE
  with module.context:
    module.operation.walk(visit)
  return found


def test_each_single_device_kernel_once_as_a_program_of_its_own():
  programs = precompile.kernel_programs(_parse(PROGRAM))
  assert [key for key, _ in programs] == [b"\x01", b"\x02"]
  source = _parse(PROGRAM)  # kept alive: its ops are views into it
  calls = _custom_calls(source)
  originals = {b"\x01": calls[0], b"\x02": calls[2]}
  for key, text in programs:
    module = _parse(text)
    (call,) = _custom_calls(module)
    original = originals[key]
    assert set(call.attributes) == set(original.attributes) - {"mhlo.sharding"}
    for name in call.attributes:
      assert str(call.attributes[name]) == str(original.attributes[name])
    assert [str(v.type) for v in call.operands] == [str(v.type) for v in original.operands]
    assert [str(r.type) for r in call.results] == [str(r.type) for r in original.results]
    # its operands are @main's parameters, its results @main's return
    assert "func.func public @main" in text and "return %0" in text


class FakeLowered:
  def __init__(self, text):
    self.text = text

  def compiler_ir(self, dialect):
    assert dialect == "stablehlo"
    return _parse(self.text)


@pytest.fixture
def recorded(monkeypatch):
  compiled = []
  monkeypatch.setattr(precompile, "_started", set())
  monkeypatch.setattr(precompile, "_compile_all", lambda texts: compiled.append(list(texts)))
  return compiled


def test_start_compiles_new_kernels_once_per_process(monkeypatch, recorded):
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  first = precompile.start(FakeLowered(PROGRAM))
  first.join()
  assert len(recorded) == 1 and len(recorded[0]) == 2
  assert precompile.start(FakeLowered(PROGRAM)) is None  # every kernel already handed over
  assert len(recorded) == 1


def test_start_does_nothing_off_a_gpu_or_when_disabled(monkeypatch, recorded):
  assert precompile.start(FakeLowered(PROGRAM)) is None
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(precompile, "ENABLED", False)
  assert precompile.start(FakeLowered(PROGRAM)) is None
  assert not recorded


def test_a_module_it_cannot_read_leaves_the_program_alone(monkeypatch, recorded):
  monkeypatch.setattr(platform, "on_gpu", lambda: True)

  class Broken:
    def compiler_ir(self, dialect):
      raise RuntimeError("no module")
  assert precompile.start(Broken()) is None and not recorded


@pytest.mark.gpu
def test_gpu_a_programs_kernel_compiles_alone_and_the_program_runs():
  from jspec.pallas_kernels.skinny_gemm import skinny_matmul
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((512, 256)) / 16, jnp.bfloat16)
  lowered = jax.jit(lambda a, b: skinny_matmul(a, b) * 2).lower(x, w)
  before = precompile.stats["compiled"]
  thread = precompile.start(lowered)
  assert thread is not None
  thread.join()
  assert precompile.stats["compiled"] > before, precompile.stats["failed"]
  got = np.asarray(lowered.compile()(x, w), np.float32)
  want = 2 * np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
