"""A step's keys and values written into the KV cache by one kernel
(jspec.pallas_kernels.kv_write), against a NumPy reference of the scatter it replaces (each row
stored at its sequence's slot, rows outside the cache dropped) and against
jspec.models.caches.write_slots itself. Interpret mode here; the compiled kernel on a GPU
(marked gpu). Whole models through it: tests/test_row_kernel_models.py (the row-kernel backend)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.caches import write_slots
from jspec.pallas_kernels.kv_write import fits_kernel, write_kv

RUN_SEED = 20261127


def _reference(cache_BKSH, new_BTKH, positions_BT):
  out = np.array(cache_BKSH)
  slots = out.shape[2]
  for b, t in np.ndindex(*positions_BT.shape):
    if 0 <= positions_BT[b, t] < slots:
      out[b, :, positions_BT[b, t]] = new_BTKH[b, t]
  return out


def _case(rng, b, t, k, s, h, dtype):
  caches = [rng.standard_normal((b, k, s, h)).astype(np.float32) for _ in range(2)]
  new = [rng.standard_normal((b, t, k, h)).astype(np.float32) for _ in range(2)]
  # Distinct slots per sequence (a step's positions are), some before 0 or past the cache.
  positions = np.stack([rng.choice(np.arange(-2, s + 3), t, replace=False) for _ in range(b)])
  return ([jnp.asarray(c, dtype) for c in caches], [jnp.asarray(n, dtype) for n in new],
          positions.astype(np.int32))


@pytest.mark.parametrize("seed", range(8))
def test_write_kv_equals_the_scatter_reference(seed):
  rng = np.random.default_rng(RUN_SEED + seed)
  b, t, k = int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.choice([1, 2, 8]))
  s, h = int(rng.choice([16, 24, 40])), int(rng.choice([16, 64, 128]))
  dtype = [jnp.float32, jnp.bfloat16][seed % 2]
  (keys, values), (k_new, v_new), positions = _case(rng, b, t, k, s, h, dtype)
  got_k, got_v = write_kv(keys, values, k_new, v_new, jnp.asarray(positions))
  for got, cache, new in ((got_k, keys, k_new), (got_v, values, v_new)):
    assert got.dtype == cache.dtype and got.shape == cache.shape
    want = _reference(np.asarray(cache, np.float32), np.asarray(new, np.float32), positions)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(
        write_slots(cache, new, jnp.asarray(positions), slot_axis=2), np.float32))


def test_write_kv_casts_rows_to_the_cache_dtype():
  keys = values = jnp.zeros((1, 2, 16, 16), jnp.bfloat16)
  rows = jnp.full((1, 1, 2, 16), 1 + 2 ** -10, jnp.float32)  # rounds to 1 in bfloat16
  got_k, _ = write_kv(keys, values, rows, rows, jnp.array([[3]]))
  assert got_k.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got_k[0, :, 3], np.float32), 1.0)
  assert float(jnp.abs(got_k).sum()) == 32.0  # nothing else written


def test_write_kv_refuses_what_it_cannot_take():
  assert fits_kernel(128) and fits_kernel(16) and not fits_kernel(96) and not fits_kernel(8)
  cache = jnp.zeros((1, 2, 16, 96))
  with pytest.raises(ValueError, match="power of two"):
    write_kv(cache, cache, jnp.zeros((1, 1, 2, 96)), jnp.zeros((1, 1, 2, 96)),
             jnp.zeros((1, 1), jnp.int32))
  cache = jnp.zeros((1, 2, 16, 64))
  with pytest.raises(ValueError, match="write_kv takes"):
    write_kv(cache, cache, jnp.zeros((1, 1, 4, 64)), jnp.zeros((1, 1, 4, 64)),
             jnp.zeros((1, 1), jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("b, t", [(1, 1), (8, 1), (3, 5), (32, 1)])
def test_gpu_write_kv_at_model_shapes(b, t):
  """Qwen3-8B's cache rows (8 KV heads of 128, bf16) in a 640-slot bucket, compiled, inside a
  program that donates the caches (written in place)."""
  assert jax.devices()[0].platform == "gpu"
  rng = np.random.default_rng(RUN_SEED + b + t)
  (keys, values), (k_new, v_new), positions = _case(rng, b, t, 8, 640, 128, jnp.bfloat16)
  want_k = _reference(np.asarray(keys, np.float32), np.asarray(k_new, np.float32), positions)
  want_v = _reference(np.asarray(values, np.float32), np.asarray(v_new, np.float32), positions)
  step = jax.jit(lambda *a: write_kv(*a), donate_argnums=(0, 1))
  got_k, got_v = step(keys, values, k_new, v_new, jnp.asarray(positions))
  np.testing.assert_array_equal(np.asarray(got_k, np.float32), want_k)
  np.testing.assert_array_equal(np.asarray(got_v, np.float32), want_v)
