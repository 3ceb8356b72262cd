"""Many rows against a block-scaled FP8 weight (jspec.pallas_kernels.fp8_prefill): x quantized
per row and 128 columns to e4m3, e4m3 x e4m3 products with both block scales applied per 128-K
step, in both of its forms (warp-specialized, items), in interpret mode here, against float32
NumPy on the dequantized operands."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh

from jspec.models import projections
from jspec.pallas_kernels import fp8_gemm, fp8_prefill, platform
from jspec.pallas_kernels.fp8_gemm import BLOCK, quantize_activations
from jspec.pallas_kernels.fp8_prefill import fp8_prefill_matmul
from jspec.sharding.rules import ShardingRules

RUN_SEED = 20261125


def _fp8_weight(rng, n, k):
  w8 = np.clip(rng.standard_normal((n, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  scale = rng.uniform(1e-4, 1e-2, (n // BLOCK, k // BLOCK)).astype(np.float32)
  return w8, scale


def _dequantized(w8_NK, scale_NbKb):
  return (np.asarray(w8_NK).astype(np.float32)
          * np.repeat(np.repeat(np.asarray(scale_NbKb), BLOCK, axis=0), BLOCK, axis=1))


def _exactly_quantizable(rng, rows, k):
  """x whose per-row, per-128-column quantization is exact: e4m3 values times a power of two
  per group, each group's largest |x| at 448 times it (whatever the division compiles to)."""
  x8 = np.clip(rng.standard_normal((rows, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  x8 = x8.astype(np.float32).reshape(rows, k // BLOCK, BLOCK)
  x8[:, :, 0] = 448.0
  return (x8 * 2.0 ** rng.integers(-12, 4, (rows, k // BLOCK, 1))).reshape(rows, k)


def _within_float32_sums(y, exact, x32, w32):
  # Products of e4m3 values are exact in float32; the error is the float32 sums' and the
  # output's rounding (float32 here).
  bound = 2.0 ** -20 * np.abs(exact) + 1e-6 * (np.abs(x32) @ np.abs(w32).T)
  return (np.abs(y - exact) <= bound).all()


# (rows, K, N, K slices): one row tile and a partial one; a row count past the decode kernel's
# 64 that pads to one tile; column tiles of two scale rows; K of three blocks; slices of K.
@pytest.mark.parametrize("rows, k, n, splits", [(130, 256, 256, 1), (65, 384, 128, 1),
                                                (256, 128, 384, 1), (100, 512, 256, 4)])
@pytest.mark.parametrize("warp_specialized", [False, True])
def test_prefill_matmul_equals_the_dequantized_product(rows, k, n, splits, warp_specialized):
  rng = np.random.default_rng([RUN_SEED, rows, k, n])
  x32 = _exactly_quantizable(rng, rows, k)
  w8, scale = _fp8_weight(rng, n, k)
  y = np.asarray(fp8_prefill_matmul(jnp.asarray(x32), jnp.asarray(w8), jnp.asarray(scale),
                                    splits=splits, warp_specialized=warp_specialized))
  w32 = _dequantized(w8, scale)
  exact = x32 @ w32.T
  assert y.shape == (rows, n) and np.isfinite(y).all()  # interpret mode fills with NaN
  assert _within_float32_sums(y, exact, x32, w32)


def test_any_activations_are_quantized_as_deepseeks_act_quant():
  """Rows of very different magnitudes: each row and 128 columns gets its own scale, and the
  result is the product of what quantize_activations makes of x (tested against DeepSeek's
  act_quant in test_fp8_gemm)."""
  rng = np.random.default_rng([RUN_SEED, 1])
  rows, k, n = 100, 256, 128
  x = rng.standard_normal((rows, k)) * 10.0 ** rng.uniform(-4, 4, (rows, 1))
  x = jnp.asarray(x, jnp.float32)
  w8, scale = _fp8_weight(rng, n, k)
  y = np.asarray(fp8_prefill_matmul(x, jnp.asarray(w8), jnp.asarray(scale)))
  x8, x_scale = quantize_activations(x)
  xq = np.asarray(x8).astype(np.float32) * np.repeat(np.asarray(x_scale), BLOCK, axis=1)
  w32 = _dequantized(w8, scale)
  exact = xq @ w32.T
  assert _within_float32_sums(y, exact, xq, w32)
  # And against x itself: e4m3 keeps 4 significant bits, 2^-4 relative per element at most.
  x32 = np.asarray(x)
  assert (np.abs(y - x32 @ w32.T) <= 2.0 ** -4 * (np.abs(x32) @ np.abs(w32).T)).all()


def _slice_partials(x32, w32, splits: int):
  """The exact partial products of `splits` equal K slices: [splits, rows, N]."""
  return np.stack([xs @ ws.T for xs, ws in zip(np.split(x32, splits, axis=1),
                                                 np.split(w32, splits, axis=1))])


def _within_bf16_roundings(y, exact, partials):
  """One bf16 rounding of y, and one of each K slice's partial (the warp-specialized form
  stores its slices in the result's type; 2^-9 relative each), with room for float32 sums."""
  bound = 2.0 ** -8 * np.abs(exact) + 2.0 ** -8 * np.abs(partials).sum(axis=0)
  return (np.abs(y - exact) <= bound + 1e-6 * np.abs(exact).max()).all()


@pytest.mark.parametrize("form", [dict(splits=1), dict(splits=2),
                                  dict(warp_specialized=True),
                                  dict(warp_specialized=True, splits=2),
                                  dict(warp_specialized=True, splits=4)])
def test_bf16_rows_give_bf16(form):
  # Items: one slice stored transposed from the kernel in bf16, two as float32 partials summed
  # after. Warp-specialized (two warpgroups' halves of 128-column tiles): every slice stored
  # transposed in bf16, the slices summed in float32 after.
  rng = np.random.default_rng([RUN_SEED, 2])
  x32 = _exactly_quantizable(rng, 200, 512)
  w8, scale = _fp8_weight(rng, 384, 512)
  splits = form.get("splits", 1)
  y = fp8_prefill_matmul(jnp.asarray(x32, jnp.bfloat16), jnp.asarray(w8), jnp.asarray(scale),
                         warp_specialized=form.get("warp_specialized", False),
                         splits=form.get("splits"))
  assert y.dtype == jnp.bfloat16
  w32 = _dequantized(w8, scale)
  exact = x32 @ w32.T
  partials = _slice_partials(x32, w32, splits) if form.get("warp_specialized") else exact[None]
  assert _within_bf16_roundings(np.asarray(y, np.float32), exact, partials)


def test_prefill_matmul_refuses_what_it_cannot_take():
  x = jnp.ones((100, 256), jnp.bfloat16)
  w8 = jnp.ones((128, 256), jnp.float8_e4m3fn)
  scale = jnp.ones((1, 2), jnp.float32)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    fp8_prefill_matmul(x, w8.astype(jnp.bfloat16), scale)
  with pytest.raises(ValueError, match="scales"):
    fp8_prefill_matmul(x, w8, jnp.ones((2, 2), jnp.float32))
  with pytest.raises(ValueError, match="slices"):
    fp8_prefill_matmul(x, w8, scale, splits=4)
  assert not fp8_prefill.fits_kernel(256, 192, (128, 128))
  assert not fp8_prefill.fits_kernel(256, 256, (64, 64))


def test_the_form_for_the_result_type():
  assert fp8_prefill.uses_warp_specialized(jnp.bfloat16)
  assert fp8_prefill.uses_warp_specialized(jnp.float16)
  assert not fp8_prefill.uses_warp_specialized(jnp.float32)


def test_k_slices_only_for_products_of_few_items():
  # 396 programs (an H200's 132 SMs, three each). Qwen3-8B's fused gate/up at 256 rows: 768
  # items, no slices; its down projection (K = 96 blocks): 128 items, 4 slices of 24 steps;
  # 4096 x 1024 (32 blocks): 32 items, 4 slices of 8 (no slice shorter than 8 steps).
  assert fp8_prefill.choose_splits(768, 32, 396) == 1
  assert fp8_prefill.choose_splits(128, 96, 396) == 4
  assert fp8_prefill.choose_splits(32, 32, 396) == 4
  assert fp8_prefill.choose_splits(32, 24, 396) == 2   # 24 = 3 x 8: halved once
  # The warp-specialized form's 128 x 128 tiles, one wave of 132 programs: the down projection
  # (32 x 2 tiles) in 2 slices, q and o (32 x 2, K = 32 blocks) in 2, k and v (8 x 2) in 4 of 8
  # steps; the gate/up projection (192 x 2) in one.
  assert fp8_prefill.choose_tile_splits(64, 96, 132) == 2
  assert fp8_prefill.choose_tile_splits(64, 32, 132) == 2
  assert fp8_prefill.choose_tile_splits(16, 32, 132) == 4
  assert fp8_prefill.choose_tile_splits(384, 32, 132) == 1


@pytest.mark.parametrize("rows, kernel", [(64, "fp8_gemm"), (65, "fp8_prefill")])
def test_projection_takes_the_prefill_kernel_past_64_rows(rows, kernel, monkeypatch):
  """The model's FP8 product (projections.sharded_fp8_projection): float16 activations up to
  the decode kernel's 64 rows, e4m3 ones past them."""
  called = []
  for module, name in ((fp8_gemm, "fp8_matmul"), (fp8_prefill, "fp8_prefill_matmul")):
    original = getattr(module, name)
    monkeypatch.setattr(module, name,
                        lambda *a, _o=original, _m=module, **kw: called.append(_m) or _o(*a, **kw))
  rng = np.random.default_rng([RUN_SEED, 3, rows])
  x32 = _exactly_quantizable(rng, rows, 256)
  w8, scale = _fp8_weight(rng, 128, 256)
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("dp", "tp", "ep"))
  product = projections.sharded_fp8_projection(mesh, ShardingRules(), (BLOCK, BLOCK))
  y = np.asarray(product(jnp.asarray(x32).reshape(1, rows, 256), jnp.asarray(w8),
                         jnp.asarray(scale)))
  assert called == [{"fp8_gemm": fp8_gemm, "fp8_prefill": fp8_prefill}[kernel]]
  w32 = _dequantized(w8, scale)
  exact = x32 @ w32.T
  np.testing.assert_allclose(y.reshape(rows, 128), exact, rtol=2.0 ** -10,
                             atol=1e-6 * np.abs(exact).max())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [65, 256, 1000])
@pytest.mark.parametrize("k, n", [(4096, 4096), (12288, 4096), (4096, 1024)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("warp_specialized", [None, True])
def test_gpu_prefill_matmul_at_model_shapes(rows, k, n, dtype, warp_specialized):
  """The compiled kernel at Qwen3-8B's q/o, down and k/v shapes, in the form it picks (bf16:
  warp-specialized; float32: items) and in the warp-specialized one (with the K slices it
  picks)."""
  rng = np.random.default_rng([RUN_SEED, rows, k, n])
  x32 = _exactly_quantizable(rng, rows, k)
  assert (np.asarray(jnp.asarray(x32, dtype), np.float32) == x32).all()
  w8, scale = _fp8_weight(rng, n, k)
  y = np.asarray(fp8_prefill_matmul(jnp.asarray(x32, dtype), jnp.asarray(w8),
                                    jnp.asarray(scale), warp_specialized=warp_specialized),
                 np.float32)
  w32 = _dequantized(w8, scale)
  exact = x32 @ w32.T
  assert np.isfinite(y).all()
  # Hopper's FP8 tensor cores keep about 14 significant bits while they sum a wgmma's products
  # (DeepSeek-V3's report, section 3.3.2; its reason to scale and add each 128-K block's sum in
  # float32, as this kernel does): each block's sum is within ~2^-13 of its sum of |x| |w|.
  # A bf16 result adds its rounding, 2^-9 relative.
  # In bf16 the warp-specialized form also rounds each K slice's partial (_within_bf16_roundings).
  rounding = 2.0 ** -18 if dtype == jnp.float32 else 2.0 ** -8
  bound = rounding * np.abs(exact) + 2.0 ** -12 * (np.abs(x32) @ np.abs(w32).T)
  if dtype == jnp.bfloat16:
    tiles = -(-rows // fp8_prefill.ROW_TILE) * (n // BLOCK)
    splits = fp8_prefill.choose_tile_splits(tiles, k // BLOCK, platform.num_sms())
    bound += 2.0 ** -8 * np.abs(_slice_partials(x32, w32, splits)).sum(axis=0)
  assert (np.abs(y - exact) <= bound).all()
