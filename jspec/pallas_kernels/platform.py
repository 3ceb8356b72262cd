"""What the kernels need to know about the device they will run on."""

from __future__ import annotations

import functools

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


@functools.cache
def on_gpu() -> bool:
  return jax.devices()[0].platform == "gpu"


@functools.cache
def device_kind() -> str:
  """The local device's kind as JAX names it: "NVIDIA H200", "NVIDIA H100 80GB HBM3", "cpu"."""
  return jax.devices()[0].device_kind


def on_hopper() -> bool:
  """A Hopper GPU (compute capability 9.x): wgmma and the TMA, which the Mosaic GPU kernels use."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return False
  return str(getattr(device, "compute_capability", "")).startswith("9")


def interpret_params() -> plgpu.InterpretGPUParams | None:
  """None on a GPU (compile with Mosaic GPU); interpret mode elsewhere.

  Interpret mode fills freshly allocated buffers with NaN, so a row a kernel forgot to
  write shows up in the tests.
  """
  return None if on_gpu() else plgpu.InterpretGPUParams()


@functools.cache
def num_sms() -> int:
  """Streaming multiprocessors of the local GPU: the persistent grid's size.

  The interpreter simulates a single block, so it gets a grid of one.
  """
  if not on_gpu():
    return 1
  device = jax.local_devices()[0]
  count = getattr(device, "core_count", None)
  if not count:
    raise RuntimeError(f"cannot read the SM count of {device!r}")
  return int(count)


def triton_block(width: int) -> bool:
  """Whether `width` can be one dimension of a Triton block that a dot takes whole: a power
  of two, at least 16."""
  return width >= 16 and width & (width - 1) == 0
