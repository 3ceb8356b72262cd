"""Test-wide settings: float32 exactness on CPU, quiet progress, the `gpu` marker's skip."""

import os

os.environ.setdefault("JSPEC_PROGRESS", "0")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def has_gpu() -> bool:
  return any(d.platform == "gpu" for d in jax.devices())


def pytest_collection_modifyitems(config, items):
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU: jax.devices() has none (run `make test-gpu` "
                                 "on a GPU machine)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
