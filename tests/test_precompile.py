"""precompile.ahead: on a GPU, a kernel's first call per argument shapes queues one compile of
the kernel alone on those shapes (on a background thread); the call itself is unchanged."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.pallas_kernels import platform, precompile


@pytest.fixture
def on_gpu(monkeypatch):
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(precompile, "_queued", set())


def _counting_kernel(traced):
  def kernel(x, y):
    traced.append((x.shape, str(x.dtype)))  # once per trace: the standalone compile's
    return x * 2 + y
  return kernel


def test_first_call_per_shapes_compiles_the_kernel_alone_once(on_gpu):
  traced = []
  wrapped = precompile.ahead(_counting_kernel(traced), "double_add")
  rng = np.random.default_rng(0)
  x, y = (jnp.asarray(rng.standard_normal((4, 8)), jnp.float32) for _ in range(2))
  program = jax.jit(lambda a, b: wrapped(a, b) + wrapped(b, a))
  np.testing.assert_allclose(np.asarray(program(x, y)), 3 * np.asarray(x + y), rtol=1e-6)
  precompile.wait()
  # Traced by the program (twice: two calls) and once more by its one standalone compile.
  assert traced.count(((4, 8), "float32")) == 3
  jax.jit(wrapped)(x[:2], y[:2])  # new shapes: a second standalone compile
  precompile.wait()
  assert traced.count(((2, 8), "float32")) == 2


def test_kernels_are_told_apart_by_name(on_gpu):
  traced = []
  first = precompile.ahead(_counting_kernel(traced), "a")
  second = precompile.ahead(_counting_kernel(traced), "b")
  x = jnp.ones((3,), jnp.float32)
  jax.jit(first)(x, x)
  jax.jit(second)(x, x)
  precompile.wait()
  assert len(traced) == 4  # each call, and each name's standalone compile


def test_off_a_gpu_eagerly_or_when_disabled_nothing_is_queued(monkeypatch):
  monkeypatch.setattr(precompile, "_queued", set())
  traced = []
  wrapped = precompile.ahead(_counting_kernel(traced), "off_gpu")
  x = jnp.ones((2,), jnp.float32)
  jax.jit(wrapped)(x, x)
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  wrapped(x, x)  # an eager call compiles at once: nothing to queue
  monkeypatch.setattr(precompile, "ENABLED", False)
  jax.jit(wrapped)(x[:1], x[:1])
  precompile.wait()
  assert len(traced) == 3 and not precompile._queued


def test_a_failing_standalone_compile_leaves_the_call_alone(on_gpu):
  def kernel(x):
    if precompile._worker and precompile._worker[0] is threading.current_thread():
      raise RuntimeError("cannot compile alone")
    return x + 1
  wrapped = precompile.ahead(kernel, "fails_alone")
  assert float(jax.jit(wrapped)(jnp.zeros((), jnp.float32))) == 1.0
  precompile.wait()
  assert ("fails_alone", (jax.ShapeDtypeStruct((), jnp.float32),)) in precompile._queued
