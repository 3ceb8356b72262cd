"""An FP8 product's K-slice partials summed by the residual add and RMSNorm that read them
(o_proj's, down_proj's): the few-row kernel's partials stored rows first
(fp8_block_kernel.partials(rows_first=True)), residual_norm.add_partials_rms_norm, and a model
whose o_proj and down_proj go through them (backends.FP8_PARTIALS_IN_NORM)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.linear import SlicedFp8Product, project_to_norm
from jspec.pallas_kernels import fp8_block_kernel, fp8_gemm, platform
from jspec.pallas_kernels.residual_norm import add_partials_rms_norm, rms_norm

EPS = 1e-6


def _fp8_case(rng, k, ns):
  """(weights [N, K] e4m3, their block scales' lanes): distinct power-of-two scales a block."""
  weights = [jnp.asarray(rng.standard_normal((n, k)), jnp.float8_e4m3fn) for n in ns]
  scales = [jnp.asarray(2.0 ** rng.integers(-3, 3, (n // 128, k // 128)), jnp.float32)
            for n in ns]
  return weights, [fp8_gemm.scale_lanes(s) for s in scales]


@pytest.mark.parametrize("seed", range(4))
def test_rows_first_partials_are_the_rows_last_ones_transposed(seed):
  """Each tile stored transposed: the same float32 partials, [S, R, N] for [S, N, R], for
  K slices, balanced runs and several weights in one call."""
  rng = np.random.default_rng(900 + seed)
  rows = int(rng.integers(1, 9))
  k = 128 * int(rng.choice([2, 4]))
  ns = [128 * int(rng.integers(1, 3)) for _ in range(1 + seed % 2)]
  balanced = seed >= 2
  splits = 1 if balanced else int(rng.choice([1, 2]))
  weights, lanes = _fp8_case(rng, k, ns)
  x = fp8_gemm.bfloat16_rows(jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16))
  call = functools.partial(fp8_block_kernel.partials, x, tuple(weights), tuple(lanes), None,
                           splits, fp8_gemm.default_tiling(rows), balanced)
  rows_last, rows_first = np.asarray(call()), np.asarray(call(rows_first=True))
  assert rows_first.shape == (rows_last.shape[0], rows_last.shape[2], rows_last.shape[1])
  np.testing.assert_array_equal(rows_first, np.swapaxes(rows_last, 1, 2))


@pytest.mark.usefixtures("fresh_traces")
@pytest.mark.parametrize("seed", range(3))
def test_the_products_sums_read_rows_first_partials_from_two_rows(monkeypatch, seed):
  """fp8_gemm's products of several rows have XLA sum their K slices over rows-first partials
  (ROWS_FIRST_SUMS), one row over rows-last ones; the products bit for bit those of the
  rows-last layout, sums apart or fused, one weight or several."""
  rng = np.random.default_rng(950 + seed)
  rows = [1, 3, 8][seed]
  k, ns = 512, [256, 128][:1 + seed % 2]
  weights, _ = _fp8_case(rng, k, ns)
  scales = [jnp.asarray(2.0 ** rng.integers(-3, 3, (n // 128, k // 128)), jnp.float32)
            for n in ns]
  x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
  layouts, partials = [], fp8_gemm.partials

  def spy(*args, **kwargs):
    layouts.append(args[7] if len(args) > 7 else kwargs.get("rows_first", False))
    return partials(*args, **kwargs)

  monkeypatch.setattr(fp8_gemm, "partials", spy)
  outs = {}
  for rows_first_sums in (True, False):
    monkeypatch.setattr(fp8_gemm, "ROWS_FIRST_SUMS", rows_first_sums)
    jax.clear_caches()
    layouts.clear()
    outs[rows_first_sums] = [
        fp8_gemm.fp8_matmul_many(x, tuple(weights), tuple(scales), splits=2, sum_apart=apart)
        for apart in (True, False)]
    assert layouts and all(layout == (rows_first_sums and rows > 1) for layout in layouts)
  for got, want in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def summed_rows_first(parts_SRD, rows, row_scale_M, dtype):
  """fp8_gemm's sum of an FP8 call's K-slice partials, rows first: [M, D] in `dtype`."""
  out = parts_SRD[0, :rows]
  for part in parts_SRD[1:]:
    out = out + part[:rows]
  return (out if row_scale_M is None else out * row_scale_M[:, None]).astype(dtype)


@pytest.mark.parametrize("seed", range(8))
def test_add_partials_rms_norm_is_rms_norm_of_the_summed_product(seed):
  """The residual add and RMSNorm with the delta given as one FP8 call's K-slice partials
  [S, R, D]: bit for bit rms_norm with the summed product (times the row scales where given,
  cast to the product's dtype) as its residual; the padded rows past M are never read."""
  rng = np.random.default_rng(400 + seed)
  rows, splits = int(rng.integers(1, 7)), int(rng.choice([1, 2, 3, 4, 8]))
  width = int(rng.choice([64, 128, 384, 2048]))
  padded = rows + int(rng.integers(0, 4))
  dtype = [jnp.float32, jnp.bfloat16][seed % 2]
  zero_centered = seed % 4 >= 2
  parts = rng.standard_normal((splits, padded, width)) * 2
  parts[:, rows:] = np.nan  # padding: a read of it would show
  parts = jnp.asarray(parts, jnp.float32)
  row_scale = None if seed % 3 == 0 else jnp.asarray(2.0 ** rng.integers(-3, 4, rows),
                                                      jnp.float32)
  x = jnp.asarray(rng.standard_normal((rows, width)), dtype)
  scale = jnp.asarray(1 + 0.2 * rng.standard_normal(width), dtype)
  h, normed = add_partials_rms_norm(x, parts, scale, row_scale, dtype=dtype, eps=EPS,
                                    zero_centered=zero_centered)
  want_h, want = rms_norm(x, scale, summed_rows_first(parts, rows, row_scale, dtype), eps=EPS,
                          zero_centered=zero_centered)
  assert h.dtype == normed.dtype == dtype
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
  np.testing.assert_array_equal(np.asarray(normed, np.float32), np.asarray(want, np.float32))


def test_add_partials_rms_norm_refuses_partials_it_cannot_read():
  x, scale = jnp.ones((2, 128)), jnp.ones(128)
  call = functools.partial(add_partials_rms_norm, eps=EPS, dtype=jnp.float32)
  with pytest.raises(ValueError, match="R >= M"):
    call(x, jnp.ones((2, 1, 128)), scale)  # fewer partial rows than rows
  with pytest.raises(ValueError, match=r"\(2, 2, 64\)"):
    call(x, jnp.ones((2, 2, 64)), scale)  # partials of another width
  with pytest.raises(ValueError, match="float32 partials"):
    call(x, jnp.ones((2, 2, 128), jnp.bfloat16), scale)
  with pytest.raises(ValueError, match="row scales"):
    call(x, jnp.ones((2, 2, 128)), scale, jnp.ones(3))


def _fp8_llms(monkeypatch):
  """A tiny FP8 Qwen3 twice, both as a Hopper GPU runs it (interpreted): o_proj's and
  down_proj's partials summed apart, and summed in the norm's kernel."""
  from jspec import backends
  from tests.test_fp8_gpu_configuration import _qwen3_llm
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)
    # the activations as they are (the e4m3 rows have tests of their own: test_e4m3_rows.py)
    patch.setattr(backends, "FP8_E4M3_ROWS", False)
    patch.setattr(backends, "FP8_PARTIALS_IN_NORM", False)
    apart = _qwen3_llm(norm_backend="pallas")
    patch.setattr(backends, "FP8_PARTIALS_IN_NORM", True)
    fused = _qwen3_llm(norm_backend="pallas")
  return apart, fused


def test_o_and_down_partials_go_to_the_norm_kernel_with_the_same_tokens(monkeypatch):
  """With the setting on, o_proj's and the MLP's down_proj's partials go straight into the
  residual add and RMSNorm after them (no sum of XLA's between), and the model's decode and
  n-gram verify steps give the same logits and greedy tokens as with the sums apart; `+` on
  the unsummed product sums first."""
  from tests.test_fp8_gpu_configuration import _assert_same_outputs
  apart, fused = _fp8_llms(monkeypatch)
  layer = fused.target.layers[0]
  assert layer.attn.fp8_add_norm is not None and layer.mlp.fp8_add_norm is not None
  assert apart.target.layers[0].attn.fp8_add_norm is None
  heads = layer.attn.o_proj.shape[:2]
  out_BTNH = jnp.ones((2, 1, *heads), jnp.float32)
  act_BTF = jnp.ones((2, 1, layer.mlp.down_proj.shape[1]), jnp.float32)
  x_BTD = jnp.ones((2, 1, layer.attn.o_proj.shape[2]), jnp.float32)
  attn_out = project_to_norm(layer.attn, out_BTNH, "o_proj", "btnh,nhd->btd", 2)
  assert isinstance(attn_out, SlicedFp8Product)

  def summed_products(*args, **kwargs):
    raise AssertionError("o_proj's or down_proj's partials were summed before the norm")

  with monkeypatch.context() as patch:
    patch.setattr(fp8_gemm, "_products", summed_products)
    for delta in (lambda: project_to_norm(layer.attn, out_BTNH, "o_proj", "btnh,nhd->btd", 2),
                  lambda: project_to_norm(layer.mlp, act_BTF, "down_proj", "btf,fd->btd")):
      text = str(jax.make_jaxpr(lambda h: layer.post_attn_norm.add_and_norm(h, delta()))(x_BTD))
      assert "add_partials_rms_norm" in text
  down = project_to_norm(layer.mlp, act_BTF, "down_proj", "btf,fd->btd")
  np.testing.assert_array_equal(np.asarray(x_BTD + down), np.asarray(
      x_BTD + layer.mlp._dense(act_BTF, "down_proj", "btf,fd->btd")))
  _assert_same_outputs(apart, fused, max_tokens=4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width, splits", [(1, 2048, 8), (1, 4096, 4), (8, 4096, 4),
                                                 (32, 7168, 2)])
def test_gpu_add_partials_rms_norm_at_model_shapes(rows, width, splits):
  """Compiled (Triton): against rms_norm with the same partials summed first in float32, as
  the models run them (o_proj of Qwen3-30B-A3B, Qwen3-8B's o and down, DeepSeek-V3's width).
  Both sum in the same order here, so the outputs are equal."""
  rng = np.random.default_rng(rows * splits + width)
  parts = jnp.asarray(rng.standard_normal((splits, max(rows, 8), width)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
  scale = jnp.asarray(1 + 0.2 * rng.standard_normal(width), jnp.bfloat16)
  got = add_partials_rms_norm(x, parts, scale, dtype=jnp.bfloat16, eps=EPS)
  want = rms_norm(x, scale, summed_rows_first(parts, rows, None, jnp.bfloat16), eps=EPS)
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    top = np.abs(w).max(axis=1, keepdims=True)
    assert np.all(np.abs(g - w) <= top * 2.0 ** -7) and np.mean(g == w) > 0.98


@pytest.mark.gpu
@pytest.mark.parametrize("rows, k, n", [(1, 4096, 4096), (1, 12288, 4096), (8, 4096, 4096)])
def test_gpu_rows_first_partials_at_model_shapes(rows, k, n):
  """Compiled (Mosaic GPU): the rows-first partials are the rows-last ones transposed, at
  Qwen3-8B's o and down shapes, with the library's K slices or balanced runs."""
  rng = np.random.default_rng(rows + k + n)
  weights, lanes = _fp8_case(rng, k, [n])
  x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
  scale = jnp.asarray(2.0 ** rng.integers(-3, 3, (n // 128, k // 128)), jnp.float32)
  call = functools.partial(fp8_gemm.fp8_partials_many, x, tuple(weights), (scale,),
                           tuple(lanes))
  rows_last, _ = call()
  rows_first, _ = call(rows_first=True)
  np.testing.assert_array_equal(np.asarray(rows_first), np.swapaxes(np.asarray(rows_last), 1, 2))


@pytest.mark.parametrize("dp, tp", [(2, 1), (2, 2), (1, 4)])
def test_the_sharded_call_on_a_mesh_equals_one_device(monkeypatch, dp, tp):
  """fp8_row_kernels.sharded_fp8_add_rms_norm on a mesh (the rows over dp, the weight whole on
  every shard): each shard's rows give what one device gives, bit for bit. The FP8 call's
  partials are XLA's product of the scaled weight in two K slices, rows first (the Mosaic GPU
  interpreter runs on one device)."""
  import jspec
  from jspec.models import fp8_row_kernels
  from jspec.sharding.rules import ShardingRules

  def two_slices(x_MK, w8s, scales, lanes, rows_first=False):
    assert rows_first
    (w8,), (scale,) = w8s, scales
    w = w8.astype(jnp.float32) * jnp.repeat(jnp.repeat(scale, 128, 0), 128, 1)
    half = x_MK.shape[1] // 2
    parts = [x_MK[:, s * half:(s + 1) * half] @ w[:, s * half:(s + 1) * half].T for s in (0, 1)]
    return jnp.stack(parts), None

  monkeypatch.setattr(fp8_gemm, "fp8_partials_many", two_slices)
  rng = np.random.default_rng(dp * 10 + tp)
  b, t, k, d = 4, 2, 256, 128
  x = jnp.asarray(rng.standard_normal((b, t, k)), jnp.float32)
  w8 = jnp.asarray(rng.standard_normal((d, k)), jnp.float8_e4m3fn)
  scale = jnp.asarray(2.0 ** rng.integers(-2, 2, (1, 2)), jnp.float32)
  residual = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  norm_scale = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)
  outs = []
  for mesh in (jspec.MeshConfig().make_mesh(), jspec.MeshConfig(dp=dp, tp=tp).make_mesh()):
    call = fp8_row_kernels.sharded_fp8_add_rms_norm(mesh, ShardingRules(), interpret=True)
    outs.append(call(x, w8, scale, None, residual, norm_scale, eps=EPS, zero_centered=False))
  for one, meshed in zip(*outs):
    np.testing.assert_array_equal(np.asarray(meshed), np.asarray(one))
