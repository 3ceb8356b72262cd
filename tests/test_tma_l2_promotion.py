"""benchmarks/tma_l2_promotion.py, the experiment's host-side parts off a GPU: the promotion
field found from two encodings, and the OR of its bits emitted right after Mosaic GPU's
descriptor init (libcuda's encoding itself runs only on a GPU machine)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax.experimental.mosaic.gpu import launch_context
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func, llvm

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "tma_l2_promotion.py"
_SPEC = importlib.util.spec_from_file_location("tma_l2_promotion", _PATH)
tma_l2_promotion = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tma_l2_promotion)


def test_the_field_is_the_bytes_promotion_sets():
  rng = np.random.default_rng(20261203)
  plain = bytearray(rng.integers(0, 256, 128, dtype=np.uint8).tobytes())
  plain[9] &= 0x0F
  promoted = bytearray(plain)
  promoted[9] |= 0x30
  assert tma_l2_promotion.field_bits(bytes(plain), bytes(plain), bytes(promoted)) == [(9, 0x30)]
  with pytest.raises(RuntimeError, match="not deterministic"):
    tma_l2_promotion.field_bits(bytes(plain), bytes(promoted), bytes(promoted))
  with pytest.raises(RuntimeError, match="no promotion field"):  # bits an OR cannot clear
    tma_l2_promotion.field_bits(bytes(promoted), bytes(promoted), bytes(plain))
  with pytest.raises(RuntimeError, match="no promotion field"):  # nothing differs
    tma_l2_promotion.field_bits(bytes(plain), bytes(plain), bytes(plain))


def _host_ops(callee: str, bits) -> tuple[list[str], int]:
  """The host function's ops after one call of `callee`, and the builds the wrapper patched."""
  undo = tma_l2_promotion.install(bits)
  try:
    with mlir.make_ir_context(), ir.Location.unknown():
      module = ir.Module.create()
      with ir.InsertionPoint(module.body):
        host = func.FuncOp("host", ir.FunctionType.get([llvm.PointerType.get()], []))
        block = host.add_entry_block()
        with ir.InsertionPoint(block):
          launch_context.func.call([], callee, [block.arguments[0]])
          launch_context.func.ReturnOp([])
      return [str(op) for op in block.operations], undo.patched[0]
  finally:
    undo()


def test_each_field_byte_is_ored_right_after_the_descriptor_init():
  ops, patched = _host_ops("mosaic_gpu_init_tma_desc", [(9, 0x30), (10, 0x80)])
  assert "mosaic_gpu_init_tma_desc" in ops[0]
  for first, (byte, value) in zip((1, 6), [(9, 48), (10, -128)]):
    gep, load, constant, ori, store = ops[first:first + 5]
    assert f"rawConstantIndices = array<i32: {byte}>" in gep and "llvm.load" in load
    assert f"value = {value} : i8" in constant and "arith.ori" in ori and "llvm.store" in store
  assert len(ops) == 12 and patched == 1 and launch_context.func is func  # the wrapper undone


def test_other_calls_are_left_alone():
  ops, patched = _host_ops("something_else", [(9, 0x30)])
  assert len(ops) == 2 and "something_else" in ops[0] and patched == 0
