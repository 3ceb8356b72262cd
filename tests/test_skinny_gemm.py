"""A few rows against one weight matrix (jspec.pallas_kernels.skinny_gemm) and the attention
projections that use it (LLM(projection_backend=...)). The kernel runs in interpret mode here;
the same kernel tests run on the GPU under the `gpu` marker."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import fixture_dir, greedy
from jspec.pallas_kernels import platform, skinny_gemm
from jspec.pallas_kernels.skinny_gemm import (XLA_DOT_REDUCE_ELEMENTS, choose_splits, project,
                                              skinny_matmul, use_skinny)

# (rows, K, N, K slices): one row and a row count off every tile, N of one 64-wide block.
CASES = [(1, 256, 128, 2), (3, 512, 192, 4), (9, 128, 256, 1), (16, 384, 64, 2),
         (33, 256, 128, 4), (64, 128, 64, 2)]


def _bf16_bound(x, w):
  """A bound on |x @ w - exact| for bf16 inputs whose partial products are rounded to bf16
  before a float32 sum: a few units of bf16 rounding (2^-8) of |x| @ |w| per output."""
  return 4 * 2.0 ** -8 * (np.abs(x) @ np.abs(w)) + 1e-6


@pytest.mark.parametrize("rows, k, n, splits", CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_skinny_matmul_equals_the_product(rows, k, n, splits, dtype):
  rng = np.random.default_rng(rows * 1000 + k + n)
  x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
  y = np.asarray(skinny_matmul(x, w, splits=splits), np.float32)
  x32, w32 = np.asarray(x, np.float32), np.asarray(w, np.float32)
  assert y.shape == (rows, n) and np.isfinite(y).all()  # interpret mode fills with NaN
  assert (np.abs(y - x32 @ w32) <= _bf16_bound(x32, w32)).all()


def test_skinny_matmul_refuses_shapes_off_the_kernel():
  x = jnp.ones((2, 96), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiples of 64"):
    skinny_matmul(x, jnp.ones((96, 64), jnp.bfloat16))
  with pytest.raises(ValueError, match="one dtype"):
    skinny_matmul(jnp.ones((2, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.float32))
  with pytest.raises(ValueError, match="M <= 64"):
    skinny_matmul(jnp.ones((65, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16))


def test_the_kernel_takes_what_xla_would_strength_reduce():
  bf16 = jnp.bfloat16
  # Qwen3-30B-A3B's q and o projections at batch 1: under XLA's 10 M threshold.
  assert use_skinny(1, 2048, 4096, bf16) and use_skinny(1, 4096, 2048, bf16)
  # From two rows on XLA runs a GEMM, as fast as the kernel.
  assert not use_skinny(2, 2048, 4096, bf16) and not use_skinny(4, 4096, 2048, bf16)
  # Qwen3-8B's q projection is a GEMM for XLA already; its k / v (4096 x 1024) and Qwen3-30B's
  # (2048 x 512) are small enough for XLA's reduction.
  assert 4096 * 4096 >= XLA_DOT_REDUCE_ELEMENTS and not use_skinny(1, 4096, 4096, bf16)
  assert not use_skinny(1, 4096, 1024, bf16) and not use_skinny(1, 2048, 512, bf16)
  # Prefill-sized row counts and 32-bit types stay with XLA.
  assert not use_skinny(128, 2048, 4096, bf16) and not use_skinny(1, 2048, 4096, jnp.float32)


def _dot_shapes(x, w) -> list[str]:
  """The output shapes of the dots `project` lowers x @ w to (from its StableHLO text)."""
  import re
  text = jax.jit(lambda x, w: project(x, w)).lower(x, w).as_text()  # traced anew: ONE_ROW
  return re.findall(r"stablehlo.dot_general.*-> tensor<([\dx]+)x[a-z]", text)


@pytest.mark.parametrize("mode", ["two_rows", "two_rows_all"])
def test_one_row_products_run_as_two_row_gemms(mode, monkeypatch):
  """ONE_ROW "two_rows" (the default): the one-row products use_skinny picks are a dot of two
  equal rows, the first kept; "two_rows_all" treats every product under XLA's threshold so.
  Either equals the product; anything else stays XLA's one-row dot."""
  monkeypatch.setattr(skinny_gemm, "ONE_ROW", mode)
  rng = np.random.default_rng(7)
  for k, n in [(2048, 4096), (4096, 2048), (256, 512)]:
    x = rng.standard_normal((1, 1, k), np.float32)
    w = rng.standard_normal((k, n), np.float32) / np.sqrt(k)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    y = np.asarray(project(xb, wb), np.float32)
    exact = np.asarray(xb, np.float32)[0] @ np.asarray(wb, np.float32)
    assert y.shape == (1, 1, n)
    assert np.all(np.abs(y[0] - exact) <= _bf16_bound(np.asarray(xb, np.float32)[0],
                                                      np.asarray(wb, np.float32)))
    picked = use_skinny(1, k, n, jnp.bfloat16) or mode == "two_rows_all"
    assert _dot_shapes(xb, wb) == ([f"2x{n}"] if picked else [f"1x1x{n}"]), (mode, k, n)


@pytest.mark.parametrize("k, n, sms", [(2048, 4096, 132), (4096, 2048, 132), (2048, 4096, 16),
                                       (192, 4096, 132), (64, 64, 1)])
def test_splits_fill_the_sms_without_overflowing_them(k, n, sms):
  splits = choose_splits(k, n, sms)
  col_blocks = n // (128 if n % 128 == 0 else 64)
  assert k % (splits * 64) == 0 and splits * col_blocks <= max(sms, col_blocks)
  # One more doubling would overflow the SMs or leave a slice off the tile.
  assert 2 * splits * col_blocks > sms or k % (2 * splits * 64)


def _llm(backend, **kwargs):
  return jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="bfloat16", max_model_len=128,
                   max_num_seqs=4, projection_backend=backend, **kwargs)


def test_attention_projections_through_the_kernel_match_xla():
  pallas, xla = _llm("pallas"), _llm("xla")
  assert pallas.projection_backend == "pallas" and xla.projection_backend == "xla"
  attn, plain = pallas.target.layers[0].attn, xla.target.layers[0].attn
  assert attn.projection is not None and plain.projection is None
  # q, k and v, one matrix (jspec.models.qkv_fusion), run the kernel (named moe_decode_down)
  # once, under one shard_map.
  assert attn.fused_qkv and plain.fused_qkv
  x = jnp.ones((1, 1, 64), jnp.bfloat16)
  traced, untouched = (str(jax.make_jaxpr(a._project)(x)) for a in (attn, plain))
  assert traced.count("shard_map") == 1 and "moe_decode_down" in traced
  assert "shard_map" not in untouched and "moe_decode_down" not in untouched
  rng = np.random.default_rng(3)
  for b, t in ((1, 1), (2, 4), (3, 5)):
    x = jnp.asarray(rng.standard_normal((b, t, 64)), jnp.bfloat16)
    for got, want in zip(jax.jit(attn._project)(x)[:3], jax.jit(plain._project)(x)[:3]):
      got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
      assert got.shape == want.shape
      np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())


def test_speculative_greedy_equals_vanilla_through_the_kernel():
  """Decode, verify and draft steps all project through the kernel, row by row the same.
  (6 tokens: several decode steps and, at k = 2, drafts and at least two verify steps; each
  further step only adds interpreted kernel calls.)"""
  prompts = [[5, 9, 2, 7, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 9, 1, 0]]
  vanilla = _llm("pallas").generate(prompts, greedy(6, ignore_eos=True))
  spec = _llm("pallas", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
  assert [o.token_ids for o in spec.generate(prompts, greedy(6, ignore_eos=True))] == \
      [o.token_ids for o in vanilla]


def test_backends_resolve_and_refuse():
  assert _llm("auto").projection_backend == ("pallas" if platform.on_hopper() else "xla")
  with pytest.raises(ValueError, match="projection_backend='cuda'"):
    _llm("cuda")
  # tp = 2: each shard's products through the kernel (jspec.sharding.tensor_parallel) ...
  split = _llm("pallas", mesh=jspec.MeshConfig(tp=2, num_devices=2))
  assert split.projection_backend == "pallas"
  assert split.target.layers[0].attn.tp_products is not None
  # ... unless the heads and the MLP are split over different axes: no products then.
  with pytest.raises(ValueError, match="splits them over tp"):
    _llm("pallas", mesh=jspec.MeshConfig(tp=2, num_devices=2),
         sharding_rules=jspec.ShardingRules(mlp=None))
  # "auto" with tp keeps XLA's dot.
  assert _llm("auto", mesh=jspec.MeshConfig(tp=2, num_devices=2)).projection_backend == "xla"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 13])
def test_gpu_skinny_matmul_at_model_shapes(rows):
  """The kernel compiled with Mosaic GPU at Qwen3-30B-A3B's q and o shapes."""
  rng = np.random.default_rng(rows)
  for k, n in ((2048, 4096), (4096, 2048)):
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    y = np.asarray(skinny_matmul(x, w), np.float32)
    x32, w32 = np.asarray(x, np.float32), np.asarray(w, np.float32)
    assert (np.abs(y - x32 @ w32) <= _bf16_bound(x32, w32)).all()
