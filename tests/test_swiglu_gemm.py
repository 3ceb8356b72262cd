"""SwiGLU's gate / up product and activation in one kernel (jspec.pallas_kernels.swiglu_gemm):
against a float64 NumPy reference of silu(x @ gate) * (x @ up), and whole models' tokens with
the kernel on (jspec.models.mlp.SWIGLU_KERNEL) against XLA's product and activation, on one
device and on a mesh that splits the MLP over tp. Interpret mode here; the compiled kernel at
Qwen3-8B's shapes on a GPU (marked gpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jspec
from jspec.models import mlp
from jspec.models.mlp import MLP
from jspec.models.row_kernels import sharded_swiglu
from jspec.pallas_kernels import platform
from jspec.pallas_kernels import swiglu_gemm as kernel_lib
from jspec.pallas_kernels.swiglu_gemm import (MAX_F, MAX_ROWS, MIN_F, blocks, fits, shared_memory,
                                              stages_that_fit, swiglu_gemm)
from jspec.sharding.rules import ShardingRules
from tests.helpers import fixture_dir, greedy_token_ids

RUN_SEED = 20261130
PROMPTS = [[5, 9, 2, 7, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 9, 1, 0]]


def _reference(x_MK, w_KCF):
  """float64 silu(x @ w[:, 0]) * (x @ w[:, 1])."""
  gate = x_MK.astype(np.float64) @ w_KCF[:, 0].astype(np.float64)
  up = x_MK.astype(np.float64) @ w_KCF[:, 1].astype(np.float64)
  return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.parametrize("case", range(6))
def test_kernel_equals_the_float64_reference(case):
  """Seeded shapes: 1 to 64 rows (Triton's 16 reached by masked rows, and past it), K and F
  in the default blocks and in blocks `blocks` shrinks to divide them, given blocks too."""
  rng = np.random.default_rng(RUN_SEED + case)
  rows = int(rng.choice([1, 3, 8, 16, 17, 64]))
  k = int(rng.choice([64, 128, 384]))
  f = int(rng.choice([32, 64, 192]))
  given = {} if case % 2 else {"block_k": 32, "block_n": 16}
  x = rng.standard_normal((rows, k)).astype(np.float32)
  w = (rng.standard_normal((k, 2, f)) / np.sqrt(k)).astype(np.float32)
  got = np.asarray(swiglu_gemm(jnp.asarray(x), jnp.asarray(w), **given))
  assert got.shape == (rows, f) and got.dtype == np.float32
  np.testing.assert_allclose(got, _reference(x, w), rtol=1e-5, atol=1e-5)


def test_bfloat16_rounds_once_from_float32_sums():
  """In bf16 the activation is the float32 result rounded once: within a bf16 ulp of it."""
  rng = np.random.default_rng(RUN_SEED)
  x = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((128, 2, 64)) / 11.0, jnp.bfloat16)
  got = np.asarray(swiglu_gemm(x, w), np.float32)
  want = _reference(np.asarray(x, np.float32), np.asarray(w, np.float32))
  np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-4)


def test_blocks_fit_and_refusals():
  assert blocks(4096, 12288) == (128, 64) and blocks(64, 128) == (64, 64)
  assert fits(64, 4096, 6144) and not fits(65, 4096, 6144) and not fits(1, 4096, 8)
  # The shard widths it was measured faster at, not wider or narrower ones
  assert fits(1, 4096, MIN_F) and fits(1, 4096, MAX_F) and not fits(1, 4096, 12288)
  assert not fits(1, 4096, MIN_F - 64) and not fits(1, 4096, MAX_F + 64)
  # Shared memory: what an H200 asked for a float32 x of 64 rows at 4 and 3 stages (and
  # refused), and the stages each dtype gets; a tiling that fits at no stage count is refused
  assert shared_memory(64, 128, 64, 4, 4) == 360448 and shared_memory(64, 128, 64, 4, 3) == 262144
  assert stages_that_fit(64, 128, 64, 4, 4) == 2 and stages_that_fit(64, 128, 64, 2, 4) == 4
  assert stages_that_fit(1, 512, 256, 2, 4) == 0 and not fits(64, 4096, 6144, itemsize=8)
  x = jnp.ones((2, 64), jnp.float32)
  with pytest.raises(ValueError, match="shared memory"):
    swiglu_gemm(jnp.ones((2, 512), jnp.float32), jnp.ones((512, 2, 256), jnp.float32),
                block_k=512, block_n=256)
  with pytest.raises(ValueError, match="one dtype"):
    swiglu_gemm(x, jnp.ones((64, 2, 32), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"\[K, 2, F\]"):
    swiglu_gemm(x, jnp.ones((64, 3, 32), jnp.float32))
  with pytest.raises(ValueError, match="1 to 64 rows"):
    swiglu_gemm(jnp.ones((65, 64), jnp.float32), jnp.ones((64, 2, 32), jnp.float32))
  with pytest.raises(ValueError, match="must divide"):
    swiglu_gemm(x, jnp.ones((64, 2, 32), jnp.float32), block_n=24)


def _llm(**kwargs):
  return jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=128,
                   max_num_seqs=4, norm_backend="pallas", **kwargs)


@pytest.mark.parametrize("mesh", [None, jspec.MeshConfig(dp=2, tp=2)])
def test_models_take_the_kernel_with_xla_tokens(monkeypatch, mesh):
  """With the kernel taking the fixture's narrow F, every dense MLP of a decode step runs it
  (one shard of F each at tp = 2), and vanilla and MTP greedy tokens equal XLA's path's
  (float32: the two differ in the order of the float32 sums and the activation's one
  rounding)."""
  monkeypatch.setattr(mlp, "SWIGLU_KERNEL", False)
  want = greedy_token_ids(_llm(), PROMPTS, 6)
  monkeypatch.setattr(mlp, "SWIGLU_KERNEL", True)
  monkeypatch.setattr(kernel_lib, "MIN_F", 16)
  llm = _llm(mesh=mesh)
  mlps = [n for _, n in nnx.iter_graph(llm.target) if isinstance(n, MLP)]
  assert mlps and all(n.swiglu_kernel is not None for n in mlps)
  step = jnp.ones((2, 3, llm.config.hidden_size), jnp.float32)
  assert "swiglu_gemm" in str(jax.make_jaxpr(mlps[0])(step))
  assert greedy_token_ids(llm, PROMPTS, 6) == want
  spec = _llm(mesh=mesh, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
  assert greedy_token_ids(spec, PROMPTS, 6) == want


def test_on_by_default_and_never_under_xla_norms(monkeypatch):
  """On by default where the row kernels run and a shard's F lies in MIN_F .. MAX_F (the
  fixture's narrower F keeps the MLP's own product: no kernel set, none in its step), off with
  SWIGLU_KERNEL off, and never where the norm backend is XLA's."""
  assert mlp.SWIGLU_KERNEL
  mlps = lambda llm: [n for _, n in nnx.iter_graph(llm.target) if isinstance(n, MLP)]
  llm = _llm()
  assert mlps(llm) and all(n.swiglu_kernel is None for n in mlps(llm))
  step = jnp.ones((2, 3, llm.config.hidden_size), jnp.float32)
  assert "swiglu_gemm" not in str(jax.make_jaxpr(mlps(llm)[0])(step))
  monkeypatch.setattr(kernel_lib, "MIN_F", 16)
  assert all(n.swiglu_kernel is not None for n in mlps(_llm()))
  monkeypatch.setattr(mlp, "SWIGLU_KERNEL", False)
  assert all(n.swiglu_kernel is None for n in mlps(_llm()))
  monkeypatch.setattr(mlp, "SWIGLU_KERNEL", True)
  xla = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=128,
                  max_num_seqs=4, norm_backend="xla")
  assert mlps(xla) and all(n.swiglu_kernel is None for n in mlps(xla))


def test_the_window_is_a_shards_width(monkeypatch):
  """MIN_F at the fixture's whole F: one device's MLPs take the kernel, a tp = 2 mesh's (half
  of F a shard) keep their own product."""
  monkeypatch.setattr(kernel_lib, "MIN_F", 128)
  mlps = lambda llm: [n for _, n in nnx.iter_graph(llm.target) if isinstance(n, MLP)]
  whole, halves = mlps(_llm()), mlps(_llm(mesh=jspec.MeshConfig(tp=2)))
  assert whole[0].gate_up_proj.shape[2] == 128
  assert all(n.swiglu_kernel is not None for n in whole)
  assert halves and all(n.swiglu_kernel is None for n in halves)


@pytest.mark.parametrize("hopper", [False, True])
def test_on_gpus_only_hoppers_take_it(monkeypatch, hopper):
  """On a GPU (as the LLM's build sees it) the MLPs take the kernel only on Hopper: its tiling
  and its shared-memory bound are Hopper's."""
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(platform, "on_hopper", lambda: hopper)
  monkeypatch.setattr(kernel_lib, "MIN_F", 16)
  mlps = [n for _, n in nnx.iter_graph(_llm().target) if isinstance(n, MLP)]
  assert mlps and all((n.swiglu_kernel is not None) == hopper for n in mlps)


def test_a_shard_past_the_kernels_rows_gets_the_xla_activation(monkeypatch):
  """sharded_swiglu hands a shard of more than MAX_ROWS rows (a prefill chunk) to XLA's
  product and activation: the same values, within float32 rounding."""
  monkeypatch.setattr(kernel_lib, "MIN_F", 16)
  mesh = jspec.MeshConfig().make_mesh()
  swiglu = sharded_swiglu(mesh, ShardingRules(), interpret=True)
  rng = np.random.default_rng(RUN_SEED)
  for rows in (MAX_ROWS, MAX_ROWS + 1):
    x = rng.standard_normal((1, rows, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 2, 32)) / 8.0).astype(np.float32)
    traced = str(jax.make_jaxpr(swiglu)(x, w))
    assert ("swiglu_gemm" in traced) == (rows <= MAX_ROWS)
    np.testing.assert_allclose(np.asarray(swiglu(x, w))[0], _reference(x[0], w), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, f", [(1, 12288), (8, 12288), (8, 6144), (32, 6144)])
def test_gpu_kernel_at_qwen3_8b_shapes(rows, f):
  """Qwen3-8B's gate / up (4096 x 2 x 12288, a tp = 2 shard's 6144), compiled, bf16, against
  float64 NumPy on the same values."""
  assert jax.devices()[0].platform == "gpu"
  rng = np.random.default_rng(RUN_SEED + rows)
  x = jnp.asarray(rng.standard_normal((rows, 4096)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4096, 2, f)) / 64.0, jnp.bfloat16)
  got = np.asarray(swiglu_gemm(x, w), np.float32)
  want = _reference(np.asarray(x, np.float32), np.asarray(w, np.float32))
  np.testing.assert_allclose(got, want, rtol=0.02, atol=0.02)
