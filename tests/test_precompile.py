"""precompile: a lowered program's single-device Mosaic GPU custom calls, each as a program of
its own (the call alone, attributes kept but the partitioner's shardings), compiled on a
background thread once per kernel hash in the process."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from jspec import interrupt
from jspec.pallas_kernels import platform, precompile

# Custom calls lowered as JAX lowers a Mosaic GPU kernel (jax.experimental.mosaic.gpu.core:
# mlir.custom_call with a dict backend config, api_version 4), which a CPU can lower but not
# compile. Each call's config: its kernel hash and what marks it as exchanging data.
fake_kernel_p = Primitive("jspec_fake_mosaic_kernel")
fake_kernel_p.def_abstract_eval(lambda x, s, *, config, target: x)


def _fake_kernel_lowering(ctx, x, s, *, config, target):
  attrs = {"module": ir.StringAttr.get(b"\x00\xffbody"),
           "use_custom_barrier": ir.BoolAttr.get(False)}
  for name, value in config:
    attrs[name] = (ir.BoolAttr.get(value) if isinstance(value, bool)
                   else ir.StringAttr.get(value))
  return mlir.custom_call(
      call_target_name=target,
      result_types=[mlir.aval_to_ir_type(ctx.module_context, ctx.avals_out[0])],
      operands=[x, s], operand_layouts=[[1, 0], [0]], result_layouts=[[1, 0]],
      backend_config=attrs, api_version=4).results


mlir.register_lowering(fake_kernel_p, _fake_kernel_lowering)

KERNELS = (  # (config, target), in program order
    ((("kernel_hash", b"\x01"),), "mosaic_gpu_v2"),
    ((("kernel_hash", b"\x01"),), "mosaic_gpu_v2"),  # the same kernel again
    ((("kernel_hash", b"\x02"), ("uses_xla_collective_metadata", False)), "mosaic_gpu_v2"),
    ((("kernel_hash", b"\x03"), ("xla_replica_ids", "0,1")), "mosaic_gpu_v2"),
    ((("kernel_hash", b"\x04"), ("uses_xla_collective_metadata", True)), "mosaic_gpu_v2"),
    ((("kernel_hash", b"\x05"),), "other_target"),
)


def _program(x, s):
  for config, target in KERNELS:
    x = fake_kernel_p.bind(x, s, config=config, target=target) * 2  # XLA ops in between
  return x


def _attributes_and_types(op) -> str:
  text = str(op)  # %r = stablehlo.custom_call @target(%operands) {attributes} : types
  return text[text.index(") {"):]


def _lowered():
  x = jnp.zeros((4, 8), jnp.bfloat16)
  return jax.jit(_program).lower(x, jnp.zeros((8,), jnp.float32))


def test_each_single_device_kernel_once_as_a_program_of_its_own():
  source = _lowered().compiler_ir("stablehlo")
  programs = precompile.kernel_programs(source)
  assert [key for key, _ in programs] == [b"\x01", b"\x02"]
  calls = precompile.custom_calls(source, "mosaic_gpu_v2")
  assert len(calls) == 5
  originals = {b"\x01": calls[0], b"\x02": calls[2]}
  for key, text in programs:
    with mlir.make_ir_context():
      module = ir.Module.parse(text)
      (call,) = precompile.custom_calls(module, "mosaic_gpu_v2")
      original = originals[key]
      # the same attributes (none is a sharding here) and types, printed as MLIR prints them
      assert not any(name == "mhlo.sharding" or name.startswith("sdy.")
                     for name in original.attributes)
      assert _attributes_and_types(call) == _attributes_and_types(original)
      assert [str(v.type) for v in call.operands] == [str(v.type) for v in original.operands]
      assert [str(r.type) for r in call.results] == [str(r.type) for r in original.results]
    # its operands are @main's parameters, its results @main's return
    assert "func.func public @main(%arg0: tensor<4x8xbf16>, %arg1: tensor<8xf32>)" in text
    assert "return %0" in text


def test_the_partitioners_shardings_are_dropped():
  source = _lowered().compiler_ir("stablehlo")
  with source.context:
    op = precompile.custom_calls(source, "mosaic_gpu_v2")[0]
    op.attributes["mhlo.sharding"] = ir.StringAttr.get("{manual}")
    op.attributes["sdy.sharding"] = ir.StringAttr.get("stand-in")
    text = precompile.one_op_program(op)
  assert "mhlo.sharding" not in text and "sdy." not in text
  assert 'kernel_hash = "\\01"' in text


def test_a_one_op_program_compiles_and_computes_what_the_call_did_in_its_program():
  # The CPU's own FFI custom calls (LAPACK's eigh) stand in for a kernel the CPU can compile.
  rng = np.random.default_rng(7)
  for n in (3, 5, 8):
    a = rng.standard_normal((n, n)).astype(np.float32)
    a = a + a.T
    lowered = jax.jit(lambda m: jnp.linalg.eigh(m)[0] * 2).lower(a)
    (op,) = precompile.custom_calls(lowered.compiler_ir("stablehlo"), "lapack_ssyevd_ffi")
    executable = precompile.compile_text(precompile.one_op_program(op), jax.devices()[0])
    results = executable.execute_sharded([jax.device_put(a)])
    vectors, values, info = [out[0] for out in results.disassemble_into_single_device_arrays()]
    np.testing.assert_allclose(np.asarray(values), np.linalg.eigvalsh(a), rtol=1e-5, atol=1e-5)
    assert int(info) == 0
    v = np.asarray(vectors)
    np.testing.assert_allclose(a @ v, v * np.asarray(values), rtol=1e-4, atol=1e-4)


@pytest.fixture
def recorded(monkeypatch):
  compiled = []
  monkeypatch.setattr(precompile, "_started", set())
  monkeypatch.setattr(precompile, "compile_all", lambda texts: compiled.append(list(texts)))
  return compiled


def test_start_compiles_new_kernels_once_per_process(monkeypatch, recorded):
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  lowered = _lowered()
  first = precompile.start(lowered, interrupt.start_thread)
  first.join()
  assert len(recorded) == 1 and len(recorded[0]) == 2
  # every kernel already handed over
  assert precompile.start(lowered, interrupt.start_thread) is None
  assert len(recorded) == 1


def test_start_does_nothing_off_a_gpu_or_when_disabled(monkeypatch, recorded):
  assert precompile.start(_lowered(), interrupt.start_thread) is None
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(precompile, "ENABLED", False)
  assert precompile.start(_lowered(), interrupt.start_thread) is None
  assert not recorded


def test_a_module_it_cannot_read_leaves_the_program_alone(monkeypatch, recorded):
  monkeypatch.setattr(platform, "on_gpu", lambda: True)

  class Broken:
    def compiler_ir(self, dialect):
      raise RuntimeError("no module")
  failed = len(precompile.stats["failed"])
  assert precompile.start(Broken(), interrupt.start_thread) is None and not recorded
  assert "no module" in precompile.stats["failed"][failed]


def test_a_failed_compile_is_counted_and_the_rest_still_compile(monkeypatch):
  calls = []

  def compile_text(text, device):
    calls.append(text)
    if text == "bad":
      raise RuntimeError("cannot compile\nmore")
  monkeypatch.setattr(precompile, "compile_text", compile_text)
  monkeypatch.setattr(precompile, "stats", {"compiled": 0, "failed": []})
  precompile.compile_all(["good", "bad", "good too"])
  assert calls == ["good", "bad", "good too"]
  assert precompile.stats == {"compiled": 2, "failed": ["cannot compile"]}


def _fake_mosaic_rule(events):
  """A stand-in for Mosaic GPU's lowering rule: the custom call it emits (as the real one,
  through mlir.custom_call with a dict config), each emission logged."""
  def rule(ctx, x, s, *, module, out_types, inout_types, **_):
    config = dict(module)
    events.append(("emit", config["kernel_hash"]))
    return _fake_kernel_lowering(ctx, x, s, config=tuple(config.items()),
                                 target="mosaic_gpu_v2")
  return rule


pallas_like_p = Primitive("jspec_fake_pallas_kernel")
pallas_like_p.def_abstract_eval(lambda x, s, *, config: x)


def _pallas_like_lowering(ctx, x, s, *, config):
  # As Pallas: the rule looked up on its module at every lowering.
  from jax.experimental.mosaic.gpu import core
  return core._mosaic_gpu_lowering_rule(ctx, x, s, module=config, out_types=(),
                                        inout_types=())


mlir.register_lowering(pallas_like_p, _pallas_like_lowering)


@pytest.mark.parametrize("at_lowering", [True, False])
def test_kernels_handed_over_as_their_calls_are_emitted(monkeypatch, at_lowering):
  from jax.experimental.mosaic.gpu import core
  events = []
  monkeypatch.setattr(core, "_mosaic_gpu_lowering_rule", _fake_mosaic_rule(events))
  monkeypatch.setattr(precompile, "_started", set())
  monkeypatch.setattr(precompile, "AT_LOWERING", at_lowering)
  monkeypatch.setattr(platform, "on_gpu", lambda: True)

  def start_thread(target, texts, name):
    assert target is precompile.compile_all and name == "jspec-precompile"
    for text in texts:
      events.append(("handed", text))
    return "a thread"

  precompile.before_lowering(start_thread)
  precompile.before_lowering(start_thread)  # wrapped once however often it is called

  def program(x, s):
    for config, _ in KERNELS[:5]:
      x = pallas_like_p.bind(x, s, config=config) * 2
    return x
  lowered = jax.jit(program).lower(jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((8,), jnp.float32))
  emitted = [key for kind, key in events if kind == "emit"]
  assert emitted == [b"\x01", b"\x02", b"\x03", b"\x04"]  # JAX lowers a repeat once
  if not at_lowering:
    assert all(kind == "emit" for kind, _ in events)
    assert precompile.start(lowered, start_thread) == "a thread"  # after lowering, as before
    assert [text for kind, text in events if kind == "handed"] == [
        text for _, text in precompile.kernel_programs(lowered.compiler_ir("stablehlo"))]
    return
  # Each new single-device kernel right after its emission, before the next is lowered.
  order = [(kind, key if kind == "emit" else _hash_of(key)) for kind, key in events]
  assert order == [("emit", b"\x01"), ("handed", b"\x01"), ("emit", b"\x02"),
                   ("handed", b"\x02"), ("emit", b"\x03"), ("emit", b"\x04")]
  assert [text for kind, text in events if kind == "handed"] == [
      text for _, text in precompile.kernel_programs(lowered.compiler_ir("stablehlo"))]
  assert precompile.start(lowered, start_thread) is None  # nothing left to hand over


def _hash_of(text: str) -> bytes:
  with mlir.make_ir_context():
    (call,) = precompile.custom_calls(ir.Module.parse(text), "mosaic_gpu_v2")
    return precompile._kernel_key(call)


@pytest.mark.gpu
def test_gpu_a_programs_kernel_compiles_alone_and_the_program_runs(monkeypatch):
  from jspec.pallas_kernels.skinny_gemm import skinny_matmul
  # start()'s own path: the kernel not handed over already, by a lowering watcher an earlier
  # test in this process installed, or by an earlier compile of the same kernel.
  monkeypatch.setattr(precompile, "AT_LOWERING", False)
  monkeypatch.setattr(precompile, "_started", set())
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((512, 256)) / 16, jnp.bfloat16)
  lowered = jax.jit(lambda a, b: skinny_matmul(a, b) * 2).lower(x, w)
  assert precompile.kernel_programs(lowered.compiler_ir("stablehlo"))
  before = dict(precompile.stats, failed=list(precompile.stats["failed"]))
  thread = precompile.start(lowered, interrupt.start_thread)
  assert thread is not None, precompile.stats
  thread.join()
  assert precompile.stats["failed"] == before["failed"]
  assert precompile.stats["compiled"] > before["compiled"]
  got = np.asarray(lowered.compile()(x, w), np.float32)
  want = 2 * np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
