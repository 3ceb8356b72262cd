"""K slices' float32 partials of a few rows times a weight in one kernel
(jspec.pallas_kernels.k_slice_gemm): against a float64 NumPy reference slice by slice, in both
output layouts, and as tensor_parallel.k_slice_partials' products, whose callers (the
all-reduce + norm and q / k kernels) sum them. Interpret mode here; compiled at Qwen3-8B's tp
= 2 shapes on a GPU (marked gpu)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.pallas_kernels import k_slice_gemm as kernel_lib
from jspec.pallas_kernels import platform
from jspec.pallas_kernels.k_slice_gemm import MAX_ROWS, fits, k_slice_gemm
from jspec.sharding import tensor_parallel

RUN_SEED = 20261201


def _reference(x_MK, w_KN, slices):
  """float64 [S, M, N]: slice s's product."""
  k = x_MK.shape[1]
  x_SMK = x_MK.astype(np.float64).reshape(x_MK.shape[0], slices, k // slices).transpose(1, 0, 2)
  return x_SMK @ w_KN.astype(np.float64).reshape(slices, k // slices, -1)


@pytest.mark.parametrize("case", range(8))
def test_kernel_equals_the_float64_reference_slice_by_slice(case):
  """Seeded shapes: 1 to 16 rows (Triton's 16 reached by masked rows), 1 to 8 slices, blocks
  that `blocks` shrinks to divide a slice's K and N and given blocks, both layouts."""
  rng = np.random.default_rng(RUN_SEED + case)
  rows = int(rng.choice([1, 2, 5, 8, 16]))
  slices = int(rng.choice([1, 2, 4, 8]))
  k = slices * int(rng.choice([32, 64, 256]))
  n = int(rng.choice([48, 64, 192]))
  rows_last = bool(case % 2)
  given = {} if case % 3 else {"block_k": 16, "block_n": 16}
  x = rng.standard_normal((rows, k)).astype(np.float32)
  w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
  got = np.asarray(k_slice_gemm(jnp.asarray(x), jnp.asarray(w), slices=slices,
                                rows_last=rows_last, **given))
  want = _reference(x, w, slices)
  if rows_last:
    want = want.transpose(0, 2, 1)
  assert got.shape == want.shape and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_partials_are_float32_sums_of_exact_products():
  """bf16 operands: each partial is the float32 sum of exact products, within float32
  rounding of the float64 reference (no bf16 rounding of the output)."""
  rng = np.random.default_rng(RUN_SEED)
  x = jnp.asarray(rng.standard_normal((8, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((512, 128)) / 23.0, jnp.bfloat16)
  got = np.asarray(k_slice_gemm(x, w, slices=4))
  want = _reference(np.asarray(x, np.float32), np.asarray(w, np.float32), 4)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, k, n, slices, want", [
    (8, 2048, 4096, 4, True), (2, 4096, 3072, 4, True), (MAX_ROWS, 6144, 4096, 4, True),
    (MAX_ROWS + 1, 2048, 4096, 4, False), (0, 2048, 4096, 4, False),
    (8, 2048 + 4, 4096, 4, False), (8, 96, 4096, 4, False), (8, 2048, 40, 4, False)])
def test_fits_takes_few_rows_and_blocks_of_16(rows, k, n, slices, want):
  """More than MAX_ROWS rows, a K that the slices do not cut evenly, and slices' K or N under
  Triton's 16-wide blocks are refused."""
  assert fits(rows, k, n, slices) == want


def test_bad_input_is_refused_with_the_shapes():
  x = jnp.zeros((4, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="one dtype"):
    k_slice_gemm(x, jnp.zeros((256, 64), jnp.float32), slices=2)
  with pytest.raises(ValueError, match="1 to 16 rows"):
    k_slice_gemm(jnp.zeros((17, 256), jnp.bfloat16), jnp.zeros((256, 64), jnp.bfloat16),
                 slices=2)
  with pytest.raises(ValueError, match="must divide"):
    k_slice_gemm(x, jnp.zeros((256, 64), jnp.bfloat16), slices=2, block_k=48)


@pytest.mark.parametrize("rows_last", [False, True])
@pytest.mark.parametrize("rows", [1, 8])
def test_k_slice_partials_take_the_kernel_on_hopper_in_their_layout(monkeypatch, rows,
                                                                     rows_last):
  """k_slice_partials of bf16 rows, the kernel taken (as on a Hopper GPU): the slices'
  float32 partials in its layout, one row doubled; not taken with ENABLED off, for float32,
  or off Hopper."""
  rng = np.random.default_rng(RUN_SEED + rows)
  x = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((1024, 192)) / 32.0, jnp.bfloat16)
  x_rows = np.asarray(x, np.float32)
  want = _reference(np.concatenate([x_rows, x_rows]) if rows == 1 else x_rows,
                    np.asarray(w, np.float32), 4)
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  got = np.asarray(tensor_parallel.k_slice_partials(x, w, 4, rows_last=rows_last))
  np.testing.assert_allclose(got, want.transpose(0, 2, 1) if rows_last else want,
                             rtol=1e-5, atol=1e-5)

  calls = []
  monkeypatch.setattr(kernel_lib, "k_slice_gemm",
                      lambda *a, **kw: calls.append(1) or np.zeros(()))
  tensor_parallel.k_slice_partials(x, w, 4, rows_last=rows_last)
  assert calls == [1]
  monkeypatch.setattr(kernel_lib, "ENABLED", False)
  assert not kernel_lib.use_kernel(8, 1024, 192, 4, jnp.bfloat16)
  # float32 (TF32 in a GPU's dot) keeps XLA's product; so does a GPU that is not Hopper
  monkeypatch.setattr(kernel_lib, "ENABLED", True)
  assert kernel_lib.use_kernel(8, 1024, 192, 4, jnp.bfloat16)
  assert not kernel_lib.use_kernel(8, 1024, 192, 4, jnp.float32)
  monkeypatch.setattr(platform, "on_hopper", lambda: False)
  assert not kernel_lib.use_kernel(8, 1024, 192, 4, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 8, 16])
@pytest.mark.parametrize("k, n", [(2048, 4096), (4096, 3072), (6144, 4096)])
def test_on_the_gpu_at_qwen3_8b_tp2_shapes(rows, k, n):
  """Compiled, Qwen3-8B's o, q / k / v and down shards at tp = 2, against float64 sums."""
  if not platform.on_gpu():
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(RUN_SEED + rows + k)
  x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)) / 64.0, jnp.bfloat16)
  want = _reference(np.asarray(x, np.float32), np.asarray(w, np.float32), 4)
  for rows_last in (False, True):
    got = np.asarray(k_slice_gemm(x, w, slices=4, rows_last=rows_last))
    np.testing.assert_allclose(got, want.transpose(0, 2, 1) if rows_last else want,
                               rtol=1e-4, atol=1e-4)
