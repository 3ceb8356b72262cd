"""The row kernels (jspec.pallas_kernels.row_norms and residual_norm): residual add + RMSNorm
and q / k norms + RoPE, each against a float64 NumPy reference of the published formulas
(whole models through them: tests/test_row_kernel_models.py). The kernels run in interpret mode here; the compiled ones
are checked on a GPU (marked gpu)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.layers import rope
from jspec.models.norms import RMSNorm, ZeroCenteredRMSNorm
from jspec.pallas_kernels.kv_write import write_kv
from jspec.pallas_kernels.residual_norm import fits_kernel, rms_norm, row_chunk
from jspec.pallas_kernels.row_norms import (fits_heads, inv_frequencies, qk_norm_rope,
                                            qkv_norm_rope, qkv_partials_norm_rope)

EPS = 1e-6


def rms_norm_reference(x, scale, residual=None, zero_centered=False):
  """float64 (h, RMSNorm(h)) of float32 rows: transformers' Qwen3RMSNorm / Qwen3NextRMSNorm."""
  h = x.astype(np.float64) + (0 if residual is None else residual.astype(np.float64))
  normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS)
  return h, normed * ((1.0 + scale) if zero_centered else scale).astype(np.float64)


@pytest.mark.parametrize("seed", range(6))
def test_rms_norm_matches_the_formula_in_float32(seed):
  rng = np.random.default_rng(seed)
  rows = int(rng.integers(1, 6))
  width = int(rng.choice([64, 256, 1536, 4096, 7168]))  # 1536, 7168: rows read in pieces
  x = rng.standard_normal((rows, width)).astype(np.float32) * rng.uniform(0.1, 30)
  residual = rng.standard_normal((rows, width)).astype(np.float32)
  scale = (1 + 0.2 * rng.standard_normal(width)).astype(np.float32)
  for zero_centered in (False, True):
    want_h, want = rms_norm_reference(x, scale, residual, zero_centered)
    h, got = rms_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(residual), eps=EPS,
                      zero_centered=zero_centered)
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    _, want_plain = rms_norm_reference(x, scale, zero_centered=zero_centered)
    got_plain = rms_norm(jnp.asarray(x), jnp.asarray(scale), eps=EPS,
                         zero_centered=zero_centered)
    np.testing.assert_allclose(np.asarray(got_plain), want_plain, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("norm_cls", [RMSNorm, ZeroCenteredRMSNorm])
def test_rms_norm_rounds_as_the_modules_do_in_bfloat16(norm_cls):
  """The kernel rounds where the module does (the sum, the cast before the scale): at most one
  bfloat16 step apart, from the order of the float32 sums only."""
  rng = np.random.default_rng(7)
  width = 4096
  norm = norm_cls(width, EPS, jnp.bfloat16)
  norm.scale[...] = jnp.asarray(0.3 * rng.standard_normal(width), jnp.bfloat16)
  for rows in (1, 3, 8):
    x = jnp.asarray(rng.standard_normal((1, rows, width)) * 4, jnp.bfloat16)
    delta = jnp.asarray(rng.standard_normal((1, rows, width)), jnp.bfloat16)
    h_want = x + delta
    want = norm(h_want)
    h, got = rms_norm(x[0], norm.scale[...], delta[0], eps=EPS,
                      zero_centered=norm.zero_centered)
    assert np.array_equal(np.asarray(h, np.float32), np.asarray(h_want[0], np.float32))
    got, want = np.asarray(got, np.float32), np.asarray(want[0], np.float32)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)  # one bf16 ulp
    assert np.all(np.abs(got - want) <= step), np.max(np.abs(got - want) / step)


def rope_reference(x, positions, theta):
  """float64 rotate-half RoPE at the float32 angles transformers computes: the float32
  frequencies (jspec's, checked against the formula below: one float32 step of a frequency
  moves the angle at position 40000 by 2e-3, so the reference takes the same ones) times the
  position, rounded to float32."""
  half = x.shape[-1] // 2
  inv_freq = np.asarray(inv_frequencies(x.shape[-1], theta))
  angle = (positions.astype(np.float32)[:, None] * inv_freq[None, :])
  cos, sin = np.cos(angle.astype(np.float64))[:, None], np.sin(angle.astype(np.float64))[:, None]
  a, b = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


@pytest.mark.parametrize("head_dim, theta", [(32, 1e4), (128, 1e6), (256, 1e7)])
def test_rope_frequencies_are_the_formula_in_float32(head_dim, theta):
  want = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  got = np.asarray(inv_frequencies(head_dim, theta))
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=4 * 2.0 ** -24)


@pytest.mark.parametrize("seed", range(6))
def test_qk_norm_rope_matches_the_formula_in_float32(seed):
  rng = np.random.default_rng(100 + seed)
  rows, q_heads, kv_heads = (int(rng.integers(1, n)) for n in (5, 9, 4))
  head_dim = int(rng.choice([32, 64, 128]))
  theta = float(rng.choice([1e4, 1e6]))
  positions = rng.integers(0, 40000, rows)
  positions[0] = int(rng.integers(0, 64))  # a row held to the tight bound
  q = rng.standard_normal((rows, q_heads, head_dim)).astype(np.float32) * 3
  k = rng.standard_normal((rows, kv_heads, head_dim)).astype(np.float32) * 3
  q_scale = (1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32)
  k_scale = (1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32)
  got_q, got_k = qk_norm_rope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(positions),
                              jnp.asarray(q_scale), jnp.asarray(k_scale), eps=EPS, theta=theta)
  for got, x, scale in ((got_q, q, q_scale), (got_k, k, k_scale)):
    want = rope_reference(rms_norm_reference(x, scale)[1], positions, theta)
    assert_rotated_close(got, want, positions)
  got_q, _ = qk_norm_rope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(positions), theta=theta)
  assert_rotated_close(got_q, rope_reference(q, positions, theta), positions)


@pytest.mark.parametrize("seed", range(4))
def test_qkv_norm_rope_on_the_fused_product_is_qk_norm_rope_of_its_slices(seed):
  """The fused q / k / v product [M, K, G + 2, H] (each KV head's G query heads, its key, its
  value): the same q and k as qk_norm_rope of the product's slices, bit for bit, and the
  value heads as they are."""
  rng = np.random.default_rng(200 + seed)
  rows, kv_heads, group = (int(rng.integers(1, n)) for n in (6, 4, 5))
  head_dim = int(rng.choice([32, 64, 128]))
  qkv = jnp.asarray(rng.standard_normal((rows, kv_heads, group + 2, head_dim)), jnp.float32)
  positions = jnp.asarray(rng.integers(0, 4000, rows))
  scales = [jnp.asarray(1 + 0.2 * rng.standard_normal(head_dim), jnp.float32) for _ in "qk"]
  for norm_scales in (scales, (None, None)):
    q, k, v = qkv_norm_rope(qkv, positions, *norm_scales, eps=EPS, theta=1e6)
    want_q, want_k = qk_norm_rope(qkv[:, :, :group].reshape(rows, kv_heads * group, head_dim),
                                  qkv[:, :, group], positions, *norm_scales, eps=EPS,
                                  theta=1e6)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(qkv[:, :, group + 1]))


def summed_partials(parts_SNR, rows, row_scale_M, dtype):
  """fp8_gemm's sum of an FP8 call's K-slice partials [S, N, R]: [M, N] in `dtype`."""
  out = jnp.sum(parts_SNR[:, :, :rows], axis=0).T
  return (out if row_scale_M is None else out * row_scale_M[:, None]).astype(dtype)


def partials_case(rng, rows, q_heads, kv_heads, head_dim, splits, padded):
  parts = rng.standard_normal((splits, (q_heads + 2 * kv_heads) * head_dim, padded)) * 2
  return jnp.asarray(parts, jnp.float32), jnp.asarray(rng.integers(0, 32768, rows))


@pytest.mark.parametrize("seed", range(6))
def test_qkv_partials_norm_rope_is_qk_norm_rope_of_the_summed_products(seed):
  """The K-slice partials of one FP8 call for q, k and v [S, (N + 2K) x H, R]: the kernel's
  q and k are, bit for bit, qk_norm_rope of the summed products (fp8_gemm's sum: times the
  row scales where given, cast), and v is the summed value heads."""
  rng = np.random.default_rng(300 + seed)
  rows, q_heads, kv_heads = (int(rng.integers(1, n)) for n in (6, 7, 4))
  head_dim, splits = int(rng.choice([32, 64, 128])), int(rng.choice([1, 2, 4, 8]))
  padded = rows + int(rng.integers(0, 4))  # the kernel's padded rows are never read
  parts, positions = partials_case(rng, rows, q_heads, kv_heads, head_dim, splits, padded)
  dtype = [jnp.float32, jnp.bfloat16][seed % 2]
  row_scale = None if seed % 3 == 0 else jnp.asarray(2.0 ** rng.integers(-3, 4, rows),
                                                      jnp.float32)
  scales = [jnp.asarray(1 + 0.2 * rng.standard_normal(head_dim), dtype) for _ in "qk"]
  summed = summed_partials(parts, rows, row_scale, dtype).reshape(rows, -1, head_dim)
  for norm_scales in (scales, (None, None)):
    q, k, v = qkv_partials_norm_rope(parts, positions, row_scale, *norm_scales,
                                     q_heads=q_heads, kv_heads=kv_heads, dtype=dtype, eps=EPS,
                                     theta=1e6)
    want_q, want_k = qk_norm_rope(summed[:, :q_heads], summed[:, q_heads:q_heads + kv_heads],
                                  positions, *norm_scales, eps=EPS, theta=1e6)
    assert q.dtype == k.dtype == v.dtype == dtype
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))
    np.testing.assert_array_equal(np.asarray(k, np.float32), np.asarray(want_k, np.float32))
    np.testing.assert_array_equal(np.asarray(v, np.float32),
                                  np.asarray(summed[:, q_heads + kv_heads:], np.float32))


@pytest.mark.parametrize("seed", range(4))
def test_qkv_partials_in_the_fused_layout_are_qkv_norm_rope_of_the_summed_product(seed):
  """K-slice partials of a fused q / k / v product [S, K x (G + 2) x H, R] (each KV head's G
  query heads, its key, its value): bit for bit what qkv_norm_rope gives on their sum, cast."""
  rng = np.random.default_rng(400 + seed)
  rows, kv_heads, group = (int(rng.integers(1, n)) for n in (6, 4, 5))
  head_dim, splits = int(rng.choice([32, 64, 128])), int(rng.choice([1, 2, 4]))
  padded = rows + int(rng.integers(0, 4))
  parts = jnp.asarray(rng.standard_normal((splits, kv_heads * (group + 2) * head_dim,
                                           padded)) * 2, jnp.float32)
  positions = jnp.asarray(rng.integers(0, 32768, rows))
  dtype = [jnp.float32, jnp.bfloat16][seed % 2]
  summed = summed_partials(parts, rows, None, dtype).reshape(rows, kv_heads, group + 2,
                                                             head_dim)
  scales = [jnp.asarray(1 + 0.2 * rng.standard_normal(head_dim), dtype) for _ in "qk"]
  for norm_scales in (scales, (None, None)):
    got = qkv_partials_norm_rope(parts, positions, None, *norm_scales,
                                 q_heads=kv_heads * group, kv_heads=kv_heads, group=group,
                                 dtype=dtype, eps=EPS, theta=1e6)
    want = qkv_norm_rope(summed, positions, *norm_scales, eps=EPS, theta=1e6)
    for g, w in zip(got, want):
      assert g.dtype == dtype
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("seed", range(6))
def test_keys_and_values_written_into_the_caches_are_kv_writes(seed):
  """With `caches`, qkv_norm_rope (and its K-slice partials form) writes k and v into the KV
  caches at the rows' positions instead of returning them: bit for bit the caches kv_write
  gives with the arrays, positions outside the cache dropped, for decode (T = 1) and verify
  windows (T = 3), a bfloat16 cache of float32 rows included; q as without."""
  rng = np.random.default_rng(500 + seed)
  b, t = int(rng.integers(1, 4)), [1, 3][seed % 2]
  kv_heads, group, head_dim, slots = int(rng.integers(1, 4)), 2, 32, 24
  rows = b * t
  positions = rng.integers(0, slots, rows)
  positions[int(rng.integers(rows))] = [slots + 3, -1][seed % 2]  # an idle row: dropped
  positions = jnp.asarray(positions)
  cache_dtype = [jnp.float32, jnp.bfloat16][seed // 3]
  keys, values = (jnp.asarray(rng.standard_normal((b, kv_heads, slots, head_dim)), cache_dtype)
                  for _ in "kv")
  scales = [jnp.asarray(1 + 0.2 * rng.standard_normal(head_dim), jnp.float32) for _ in "qk"]
  splits = 2
  parts = jnp.asarray(rng.standard_normal((splits, kv_heads * (group + 2) * head_dim, rows)),
                      jnp.float32)
  summed = summed_partials(parts, rows, None, jnp.float32).reshape(rows, kv_heads, group + 2,
                                                                   head_dim)
  forms = [
      lambda **kw: qkv_norm_rope(summed, positions, *scales, eps=EPS, theta=1e6, **kw),
      lambda **kw: qkv_partials_norm_rope(parts, positions, None, *scales,
                                          q_heads=kv_heads * group, kv_heads=kv_heads,
                                          group=group, dtype=jnp.float32, eps=EPS, theta=1e6,
                                          **kw)]
  for form in forms:
    q, k, v = form()
    want = write_kv(keys, values, k.reshape(b, t, kv_heads, head_dim),
                    v.reshape(b, t, kv_heads, head_dim), positions.reshape(b, t))
    got_q, *got = form(caches=(keys, values))
    np.testing.assert_array_equal(np.asarray(got_q), np.asarray(q))
    for g, w in zip(got, want):
      assert g.dtype == cache_dtype
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  with pytest.raises(ValueError, match="writes keys and values into caches"):
    forms[0](caches=(keys[:, :, :, :16], values[:, :, :, :16]))


def test_qkv_partials_norm_rope_refuses_partials_it_cannot_read():
  parts, positions = partials_case(np.random.default_rng(0), 2, 4, 2, 64, 2, 2)
  call = functools.partial(qkv_partials_norm_rope, theta=1e6, dtype=jnp.float32)
  with pytest.raises(ValueError, match="N=3, K=2"):  # 8 x 64 columns are not (3 + 4) heads
    call(parts, positions, q_heads=3, kv_heads=2)
  with pytest.raises(ValueError, match="R >= M"):  # more positions than partial rows
    call(parts, jnp.zeros(3, jnp.int32), q_heads=4, kv_heads=2)
  with pytest.raises(ValueError, match="power of two"):
    call(jnp.concatenate([parts, parts[:1]]), positions, q_heads=4, kv_heads=2)
  with pytest.raises(ValueError, match="row scales"):
    call(parts, positions, jnp.ones(3), q_heads=4, kv_heads=2)
  with pytest.raises(ValueError, match="G=3"):  # 2 KV heads of 3 query heads are not 4
    call(parts, positions, q_heads=4, kv_heads=2, group=3)


def assert_rotated_close(got, want, positions):
  """Row by row: within 1e-5 of the largest value, plus what float32 cos / sin lose on large
  angles (XLA reduces an angle of a rad to within pi in float32, about a * 2^-24 off; the
  largest angle of a row is its position)."""
  got = np.asarray(got, np.float64)
  for row, position in enumerate(positions):
    top = np.abs(want[row]).max()
    np.testing.assert_allclose(got[row], want[row], rtol=0,
                               atol=top * (1e-5 + 4 * float(position) * 2.0 ** -24))


def test_qk_norm_rope_equals_the_layers_rope_at_position_zero_and_stays_near_it():
  """jspec.models.layers.rope is what the kernel stands in for: equal where no angle rounds
  (position 0), and within the float32 angle's rounding elsewhere."""
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((4, 6, 128)), jnp.float32)
  k = q[:, :2]
  positions = jnp.asarray([0, 1, 300, 8191])
  got_q, got_k = qk_norm_rope(q, k, positions, theta=1e6)
  want_q = rope(q[None], positions[None], 1e6)[0]
  assert np.array_equal(np.asarray(got_q[0]), np.asarray(want_q[0]))
  # d(angle) <= position * 2^-24 relative: |error| <= |x| * position * 2^-23.
  bound = float(jnp.abs(q).max()) * 8191 * 2.0 ** -23
  assert float(jnp.abs(got_q - want_q).max()) <= bound
  assert np.array_equal(np.asarray(got_k), np.asarray(got_q[:, :2]))


def test_kernels_refuse_shapes_they_do_not_take():
  assert row_chunk(7168) == 1024 and row_chunk(4096) == 4096 and row_chunk(8192) == 4096
  assert fits_kernel(1536) and not fits_kernel(100) and not fits_kernel(0)
  assert fits_heads(128) and fits_heads(32) and not fits_heads(96) and not fits_heads(16)
  with pytest.raises(ValueError, match="D=100"):
    rms_norm(jnp.ones((1, 100)), jnp.ones(100), eps=EPS)
  with pytest.raises(ValueError, match="scale"):
    rms_norm(jnp.ones((1, 128)), jnp.ones(64), eps=EPS)
  with pytest.raises(ValueError, match="head_dim"):
    qk_norm_rope(jnp.ones((1, 2, 96)), jnp.ones((1, 1, 96)), jnp.zeros(1, jnp.int32), theta=1e4)
  with pytest.raises(ValueError, match="both norm scales"):
    qk_norm_rope(jnp.ones((1, 2, 64)), jnp.ones((1, 1, 64)), jnp.zeros(1, jnp.int32),
                 jnp.ones(64), theta=1e4)


# ---- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows, width", [(1, 4096), (8, 4096), (3, 7168), (1, 7168), (2, 5120),
                                         (1, 8192), (64, 2048)])
def test_gpu_rms_norm_at_model_shapes(rows, width):
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, width)) * 4, jnp.bfloat16)
  delta = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
  norm = RMSNorm(width, EPS, jnp.bfloat16)
  norm.scale[...] = jnp.asarray(1 + 0.2 * rng.standard_normal(width), jnp.bfloat16)
  h, got = rms_norm(x, norm.scale[...], delta, eps=EPS)
  want_h = x + delta
  assert np.array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
  want = np.asarray(jax.jit(norm._xla)(want_h), np.float32)
  step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
  assert np.all(np.abs(np.asarray(got, np.float32) - want) <= step)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, q_heads, kv_heads", [(1, 32, 8), (8, 32, 8), (32, 16, 4)])
def test_gpu_qk_norm_rope_at_model_shapes(rows, q_heads, kv_heads):
  rng = np.random.default_rng(rows)
  q = rng.standard_normal((rows, q_heads, 128)).astype(np.float32) * 3
  k = rng.standard_normal((rows, kv_heads, 128)).astype(np.float32) * 3
  positions = rng.integers(0, 32768, rows)
  scale = (1 + 0.2 * rng.standard_normal(128)).astype(np.float32)
  got_q, got_k = qk_norm_rope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(positions),
                              jnp.asarray(scale), jnp.asarray(scale), eps=EPS, theta=1e6)
  for got, x in ((got_q, q), (got_k, k)):
    assert_rotated_close(got, rope_reference(rms_norm_reference(x, scale)[1], positions, 1e6),
                         positions)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, kv_heads, group", [(1, 8, 4), (8, 8, 4), (32, 4, 4)])
def test_gpu_qkv_norm_rope_at_model_shapes(rows, kv_heads, group):
  """Compiled: the fused product's q and k as qk_norm_rope gives them from its slices, bf16
  as the models run it, and v as it is."""
  rng = np.random.default_rng(rows)
  qkv = jnp.asarray(rng.standard_normal((rows, kv_heads, group + 2, 128)) * 3, jnp.bfloat16)
  positions = jnp.asarray(rng.integers(0, 32768, rows))
  scale = jnp.asarray(1 + 0.2 * rng.standard_normal(128), jnp.bfloat16)
  q, k, v = qkv_norm_rope(qkv, positions, scale, scale, eps=EPS, theta=1e6)
  want_q, want_k = qk_norm_rope(qkv[:, :, :group].reshape(rows, kv_heads * group, 128),
                                qkv[:, :, group], positions, scale, scale, eps=EPS, theta=1e6)
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))
  np.testing.assert_array_equal(np.asarray(k, np.float32), np.asarray(want_k, np.float32))
  np.testing.assert_array_equal(np.asarray(v, np.float32),
                                np.asarray(qkv[:, :, group + 1], np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, q_heads, kv_heads, splits", [(1, 32, 8, 8), (1, 32, 4, 8),
                                                             (8, 32, 8, 4), (32, 16, 4, 2)])
def test_gpu_qkv_partials_norm_rope_at_model_shapes(rows, q_heads, kv_heads, splits):
  """Compiled (Triton): against qk_norm_rope of XLA's sum of the same partials in bf16, as
  the models run them. The two sum the partials in their own orders, so a value may round to
  the neighbouring bf16 number: each within one bf16 step of its row's largest, and nearly
  all equal."""
  rng = np.random.default_rng(rows + splits)
  parts, positions = partials_case(rng, rows, q_heads, kv_heads, 128, splits,
                                   max(rows, 8))
  scale = jnp.asarray(1 + 0.2 * rng.standard_normal(128), jnp.bfloat16)
  got = qkv_partials_norm_rope(parts, positions, None, scale, scale, q_heads=q_heads,
                               kv_heads=kv_heads, dtype=jnp.bfloat16, eps=EPS, theta=1e6)
  summed = summed_partials(parts, rows, None, jnp.bfloat16).reshape(rows, -1, 128)
  want = (*qk_norm_rope(summed[:, :q_heads], summed[:, q_heads:q_heads + kv_heads], positions,
                        scale, scale, eps=EPS, theta=1e6), summed[:, q_heads + kv_heads:])
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    top = np.abs(w).max(axis=(1, 2), keepdims=True)
    assert np.all(np.abs(g - w) <= top * 2.0 ** -7) and np.mean(g == w) > 0.98


@pytest.mark.gpu
@pytest.mark.parametrize("rows, kv_heads, group", [(1, 8, 4), (8, 8, 4), (32, 4, 4)])
def test_gpu_qkv_partials_in_the_fused_layout_at_model_shapes(rows, kv_heads, group):
  """Compiled: a fused product's 4 K slices' partials (Qwen3-8B's and a tp = 2 shard's KV
  heads) against qkv_norm_rope of XLA's sum in bf16: each value within one bf16 step of its
  row's largest (the two sum in their own orders), nearly all equal."""
  rng = np.random.default_rng(rows + kv_heads)
  parts = jnp.asarray(rng.standard_normal((4, kv_heads * (group + 2) * 128, max(rows, 2))),
                      jnp.float32)
  positions = jnp.asarray(rng.integers(0, 32768, rows))
  scale = jnp.asarray(1 + 0.2 * rng.standard_normal(128), jnp.bfloat16)
  got = qkv_partials_norm_rope(parts, positions, None, scale, scale, q_heads=kv_heads * group,
                               kv_heads=kv_heads, group=group, dtype=jnp.bfloat16, eps=EPS,
                               theta=1e6)
  summed = summed_partials(parts, rows, None, jnp.bfloat16).reshape(rows, kv_heads, group + 2,
                                                                    128)
  want = qkv_norm_rope(summed, positions, scale, scale, eps=EPS, theta=1e6)
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    top = np.abs(w).max(axis=(1, 2), keepdims=True)
    assert np.all(np.abs(g - w) <= top * 2.0 ** -7) and np.mean(g == w) > 0.98


@pytest.mark.gpu
@pytest.mark.parametrize("b, t, kv_heads", [(1, 1, 8), (8, 1, 4), (2, 4, 8)])
def test_gpu_keys_and_values_written_into_bfloat16_caches_are_kv_writes(b, t, kv_heads):
  """Compiled: the K-slice partials form at Qwen3-8B's heads (a tp = 2 shard's at batch 8)
  writing k and v into 640-slot bf16 caches gives, bit for bit, the caches kv_write gives
  with its k and v, and the same q."""
  rng = np.random.default_rng(b * 10 + t)
  rows, group = b * t, 4
  parts = jnp.asarray(rng.standard_normal((4, kv_heads * (group + 2) * 128, max(rows, 2))),
                      jnp.float32)
  positions = jnp.asarray(rng.integers(0, 640, rows))
  scale = jnp.asarray(1 + 0.2 * rng.standard_normal(128), jnp.bfloat16)
  caches = tuple(jnp.asarray(rng.standard_normal((b, kv_heads, 640, 128)), jnp.bfloat16)
                 for _ in "kv")
  call = functools.partial(qkv_partials_norm_rope, parts, positions, None, scale, scale,
                           q_heads=kv_heads * group, kv_heads=kv_heads, group=group,
                           dtype=jnp.bfloat16, eps=EPS, theta=1e6)
  q, k, v = call()
  want = write_kv(*caches, k.reshape(b, t, kv_heads, 128), v.reshape(b, t, kv_heads, 128),
                  positions.reshape(b, t))
  got_q, *got = call(caches=caches)
  np.testing.assert_array_equal(np.asarray(got_q, np.float32), np.asarray(q, np.float32))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
