"""A batch-1 step's o_proj on one GPU as K slices' float32 partials of the row the attention
kernel wrote twice, summed by the MoE layer's residual add + norm + router kernel
(jspec.models.slice_sum): the partials against the product, where the LLM sets it up, and a
Qwen3-MoE model's greedy tokens with it against those without (float32, interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import fixture_dir, greedy_token_ids
from jspec import build
from jspec.models import slice_sum
from jspec.pallas_kernels import norm_router

RUN_SEED = 20261202


@pytest.mark.parametrize("case", range(4))
def test_the_partials_of_the_row_twice_sum_to_the_rows_product(case):
  """[1, 2, N, H] (a row and its copy) by o_proj [N, H, D] in S slices: SliceSum of shape
  [1, 1, D] in x's dtype, whose partials [S, 1, 2, D] are each slice's product of both rows
  and whose sum is the one row's product (float64 NumPy)."""
  rng = np.random.default_rng([RUN_SEED, case])
  n, h, d, slices = [(4, 32, 48, 2), (8, 64, 96, 4), (2, 128, 64, 4), (4, 64, 32, 2)][case]
  row = rng.standard_normal((1, 1, n, h)).astype(np.float32)
  w = rng.standard_normal((n, h, d)).astype(np.float32)
  out = slice_sum.row_twice_product(jnp.asarray(np.concatenate([row, row], axis=1)),
                                    jnp.asarray(w), 2, slices)
  assert out.shape == (1, 1, d) and out.dtype == jnp.float32 and out.tokens == 1
  assert out.partials_SBTD.shape == (slices, 1, 2, d)
  want = row.reshape(1, -1).astype(np.float64) @ w.reshape(-1, d)
  np.testing.assert_allclose(np.asarray(out.reduced()).reshape(1, d), want, rtol=1e-5,
                             atol=1e-4)
  parts = np.asarray(out.partials_SBTD)
  np.testing.assert_array_equal(parts[:, :, 0], parts[:, :, 1])
  # `+` sums first, either side
  np.testing.assert_allclose(np.asarray(out + 1.0), np.asarray(out.reduced()) + 1.0)
  np.testing.assert_allclose(np.asarray(1.0 + out), np.asarray(out.reduced()) + 1.0)


def test_only_one_row_written_twice_is_taken():
  w = jnp.zeros((4, 32, 8), jnp.float32)
  for shape in [(1, 1, 4, 32), (2, 2, 4, 32), (1, 4, 4, 32)]:
    with pytest.raises(ValueError, match="one row written twice"):
      slice_sum.row_twice_product(jnp.zeros(shape, jnp.float32), w, 2, 2)
  assert slice_sum.takes(128, 2) and not slice_sum.takes(128, 4) and not slice_sum.takes(128, 1)
  if jax.devices()[0].platform != "gpu":
    assert slice_sum.o_slices() == 0  # XLA's GPU rule only


def _moe_llm(monkeypatch, slices):
  """The fixture as "auto" builds it on Hopper: decode steps through the short-context
  attention kernel (interpreted here), the norms, router and experts through theirs."""
  monkeypatch.setattr(slice_sum, "o_slices", lambda: slices)
  as_auto = build.use_pallas_attention
  monkeypatch.setattr(build, "use_pallas_attention",
                      lambda mesh, pairs, explicit=True: as_auto(mesh, pairs, explicit=False))
  llm = jspec.LLM(model=fixture_dir("qwen3_moe"), dtype="float32", max_model_len=64,
                  max_num_seqs=1, norm_backend="pallas", moe_backend="pallas",
                  attention_backend="pallas")
  assert all(layer.attn.short_attention is not None for layer in llm.target.layers)
  return llm


def test_a_moe_model_leaves_o_proj_sums_to_the_norm_router_kernel(monkeypatch):
  """Qwen3-MoE with the row, router and expert kernels and o_slices 2 (its 4 x 32 heads cut
  into 2 slices of 64): every attention before a MoE layer gets them, the one before its
  dense layer none; batch-1 decode steps' norm + router kernel reads o_proj's partials of the
  row written twice; the greedy tokens
  equal those with one product (float32: only the order of the sums differs)."""
  deltas = []
  fused = norm_router.add_norm_route_softmax
  monkeypatch.setattr(norm_router, "add_norm_route_softmax",
                      lambda x, delta, *a, **k: (deltas.append(delta.shape),
                                                 fused(x, delta, *a, **k))[1])
  prompts = [[5, 9, 2, 7, 7, 1], [3, 3, 8, 11, 4], [1, 2, 3, 4]]
  llm = _moe_llm(monkeypatch, 2)
  layers = llm.target.layers
  assert any(layer.is_moe for layer in layers) and not all(layer.is_moe for layer in layers)
  assert all(layer.attn.o_slices == (2 if layer.is_moe else 0) for layer in layers)
  sliced = [greedy_token_ids(llm, [p], 6) for p in prompts]
  assert any(len(shape) == 3 and shape[1:] == (2, llm.config.hidden_size)
             for shape in deltas), deltas
  deltas.clear()
  llm = _moe_llm(monkeypatch, 0)
  assert [greedy_token_ids(llm, [p], 6) for p in prompts] == sliced
  assert deltas and all(len(shape) == 2 for shape in deltas)


def test_dense_layers_keep_one_product(monkeypatch):
  """Attention before a dense MLP (no norm + router kernel to sum them) gets no slices."""
  monkeypatch.setattr(slice_sum, "o_slices", lambda: 2)
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                  max_num_seqs=1, norm_backend="pallas")
  assert all(layer.attn.o_slices == 0 for layer in llm.target.layers)
