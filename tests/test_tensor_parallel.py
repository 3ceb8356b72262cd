"""Tensor-parallel layers written shard by shard (jspec.sharding.tensor_parallel) and the
one-shot all-reduce kernel (jspec.pallas_kernels.all_reduce): the products equal one device's
einsum on every mesh layout, a row product is reduced by exactly one all-reduce, a model keeps
one device's greedy tokens, the kernel lowers for Hopper without a GPU, and bad options are
refused. The kernel's sums against psum's run on 2 GPUs (`gpu` marker)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jspec
from conftest import has_gpu
from helpers import fixture_dir, greedy
from jspec.models.layers import MLP, Attention
from jspec.pallas_kernels import all_reduce
from jspec.sharding.rules import MeshConfig, ShardingRules
from jspec.sharding.tensor_parallel import TensorParallelProducts, tensor_parallel_products

MESHES = [(1, 2, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 4, 1)]  # (dp, tp, ep)


def _products(dp, tp, ep):
  mesh = MeshConfig(dp=dp, tp=tp, ep=ep).make_mesh()
  products = tensor_parallel_products(mesh, ShardingRules(), custom_all_reduce=False)
  assert isinstance(products, TensorParallelProducts) and products.axis == "tp"
  return mesh, products


def _place(mesh, array, spec):
  return jax.device_put(jnp.asarray(array), NamedSharding(mesh, spec))


@pytest.mark.parametrize("dp, tp, ep", MESHES)
def test_column_and_row_products_equal_the_einsum(dp, tp, ep):
  """q-like (split output heads), gate/up-like (split last axis) and o-like (two input axes,
  the first split) products on random float32 values, batch over dp x ep."""
  mesh, products = _products(dp, tp, ep)
  rng = np.random.default_rng(dp * 100 + tp * 10 + ep)
  b, t, d, n, h, f = 2 * dp * ep, 3, 16, 4 * tp, 8, 6 * tp
  batch = ("dp", "ep")
  x = rng.standard_normal((b, t, d)).astype(np.float32)
  w_q = rng.standard_normal((d, n, h)).astype(np.float32)
  w_gu = rng.standard_normal((d, 2, f)).astype(np.float32)
  w_o = rng.standard_normal((n, h, d)).astype(np.float32)
  x_d = _place(mesh, x, P(batch, None, None))
  q = products.column(x_d, _place(mesh, w_q, P(None, "tp", None)), split=1)
  np.testing.assert_allclose(np.asarray(q), np.einsum("btd,dnh->btnh", x, w_q), rtol=1e-5,
                             atol=1e-5)
  gu = products.column(x_d, _place(mesh, w_gu, P(None, None, "tp")), split=2)
  np.testing.assert_allclose(np.asarray(gu), np.einsum("btd,dcf->btcf", x, w_gu), rtol=1e-5,
                             atol=1e-5)
  heads = rng.standard_normal((b, t, n, h)).astype(np.float32)
  out = products.row(_place(mesh, heads, P(batch, None, "tp", None)),
                     _place(mesh, w_o, P("tp", None, None)), in_axes=2)
  np.testing.assert_allclose(np.asarray(out), np.einsum("btnh,nhd->btd", heads, w_o),
                             rtol=1e-5, atol=1e-4)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(batch, None, None)), 3)


def test_a_row_product_is_one_all_reduce_and_a_column_product_none():
  mesh, products = _products(2, 2, 1)
  x = jax.ShapeDtypeStruct((4, 1, 8, 16), jnp.float32,
                           sharding=NamedSharding(mesh, P(("dp", "ep"), None, "tp", None)))
  w = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32,
                           sharding=NamedSharding(mesh, P("tp", None, None)))
  row = jax.jit(functools.partial(products.row, in_axes=2)).lower(x, w).compile().as_text()
  assert row.count("all-reduce(") + row.count("all-reduce-start(") == 1
  x = jax.ShapeDtypeStruct((4, 1, 32), jnp.float32,
                           sharding=NamedSharding(mesh, P(("dp", "ep"), None, None)))
  w = jax.ShapeDtypeStruct((32, 8, 16), jnp.float32,
                           sharding=NamedSharding(mesh, P(None, "tp", None)))
  column = jax.jit(functools.partial(products.column, split=1)).lower(x, w).compile().as_text()
  assert not any(op in column for op in ("all-reduce", "all-gather", "all-to-all",
                                         "collective-permute"))


def test_products_only_where_the_mesh_splits_heads_and_mlp_over_one_axis():
  one = MeshConfig().make_mesh()
  assert tensor_parallel_products(one, ShardingRules(), False) is None
  dp = MeshConfig(dp=2).make_mesh()
  assert tensor_parallel_products(dp, ShardingRules(), False) is None
  tp = MeshConfig(tp=2).make_mesh()
  # The MLP whole but the heads split: no common axis to reduce over.
  assert tensor_parallel_products(tp, ShardingRules(mlp=None), False) is None
  # The hidden size split too: the products assume it whole on every shard.
  assert tensor_parallel_products(tp, ShardingRules(embed="tp", q_heads=None, kv_heads=None,
                                                    mlp=None), False) is None


def _llm(tp=1, dp=1, **kwargs):
  return jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                   max_num_seqs=4, mesh=MeshConfig(dp=dp, tp=tp), **kwargs)


PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8], [100, 3, 44, 9]]


@pytest.mark.parametrize("tp, dp, spec", [(2, 1, None), (4, 1, {"method": "mtp",
                                                               "num_speculative_tokens": 2}),
                                          (2, 2, {"method": "mtp", "num_speculative_tokens": 2})])
def test_a_model_with_written_out_products_keeps_one_devices_tokens(tp, dp, spec):
  """all_reduce_backend="xla": every GQA layer and MLP of the target takes the products, and
  greedy decoding (with MTP: drafts and verify windows too) emits what one device emits."""
  one = _llm(speculative_config=spec).generate(PROMPTS, greedy(8, ignore_eos=True))
  llm = _llm(tp=tp, dp=dp, speculative_config=spec, all_reduce_backend="xla")
  layers = [node for _, node in nnx.iter_graph(llm.target) if isinstance(node, (Attention, MLP))]
  assert len(layers) == 2 * len(llm.target.layers)
  assert all(node.tp_products is not None for node in layers)
  got = llm.generate(PROMPTS, greedy(8, ignore_eos=True))
  assert [o.token_ids for o in got] == [o.token_ids for o in one]


def test_the_default_leaves_tensor_parallel_layers_to_xla():
  llm = _llm(tp=2)
  assert llm.all_reduce_backend == "auto"
  assert llm.target.layers[0].attn.tp_products is None
  assert llm.target.layers[0].mlp.tp_products is None


def test_bad_all_reduce_backends_are_refused():
  with pytest.raises(ValueError, match="all_reduce_backend='nccl' is not supported"):
    _llm(tp=2, all_reduce_backend="nccl")
  with pytest.raises(ValueError, match="projection_backend='xla' leaves them to XLA"):
    _llm(tp=2, all_reduce_backend="xla", projection_backend="xla")
  if not has_gpu():
    with pytest.raises(ValueError, match="needs Hopper GPUs"):
      _llm(tp=2, all_reduce_backend="kernel")


def test_the_kernel_takes_small_float_messages_of_whole_tiles():
  assert all_reduce.tile_elements(jnp.bfloat16) == 1024
  assert all_reduce.tile_elements(jnp.float32) == 512
  assert all_reduce.fits_kernel((1, 1, 4096), jnp.bfloat16)          # a batch-1 row: 8 KB
  assert all_reduce.fits_kernel((8, 1, 4096), jnp.bfloat16)          # 64 KB
  assert all_reduce.fits_kernel((32, 1, 4096), jnp.bfloat16)         # 256 KB: the limit
  assert not all_reduce.fits_kernel((33, 1, 4096), jnp.bfloat16)     # past it
  assert not all_reduce.fits_kernel((1, 1, 1000), jnp.bfloat16)      # not whole tiles
  assert not all_reduce.fits_kernel((1, 4096), jnp.int32)
  with pytest.raises(ValueError, match="whole 1024-element tiles"):
    all_reduce.one_shot_all_reduce(jnp.zeros((3, 100), jnp.bfloat16), "tp", 2)


@pytest.mark.parametrize("mesh_shape, axis, size", [((2,), "tp", 2), ((2, 1, 4), "tp", 4)])
def test_the_kernel_lowers_for_hopper_without_a_gpu(monkeypatch, mesh_shape, axis, size):
  """Mosaic GPU lowering of the kernel under a shard_map (peer refs from XLA's collective
  metadata, one semaphore per block): no interpreter simulates peer memory, so the sums
  themselves are checked on GPUs."""
  monkeypatch.setattr(all_reduce.platform, "on_gpu", lambda: True)
  names = ("tp",) if len(mesh_shape) == 1 else ("dp", "ep", "tp")
  devices = np.asarray(jax.devices()[:int(np.prod(mesh_shape))]).reshape(mesh_shape)
  mesh = Mesh(devices, names)
  spec = P(*names)
  fn = jax.shard_map(lambda v: all_reduce.one_shot_all_reduce(v.reshape(-1), axis,
                                                              size).reshape(v.shape),
                     mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
  x = jax.ShapeDtypeStruct(tuple(mesh_shape[:-1]) + (size * 8192,), jnp.bfloat16)
  text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def _gpu_pair():
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if len(gpus) < 2:
    pytest.skip("needs 2 GPUs")
  return Mesh(np.asarray(gpus[:2]), ("tp",))


@pytest.mark.gpu
@pytest.mark.parametrize("elements, dtype, blocks", [(4096, jnp.bfloat16, 1),
                                                     (4096, jnp.bfloat16, 4),
                                                     (32768, jnp.bfloat16, 8),
                                                     (131072, jnp.bfloat16, 16),
                                                     (8192, jnp.float32, 4)])
def test_gpu_kernel_equals_psum_on_two_gpus(elements, dtype, blocks):
  """The one-shot kernel's sums on 2 GPUs equal psum's bit for bit (2 shards: one rounding
  of the same exact sum) and are equal on both shards."""
  mesh = _gpu_pair()
  rng = np.random.default_rng(elements + blocks)
  x = jax.device_put(jnp.asarray(rng.standard_normal((2, elements)), dtype),
                     NamedSharding(mesh, P("tp")))
  run = lambda fn: np.asarray(jax.jit(jax.shard_map(
      lambda v: fn(v[0])[None], mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
      check_vma=False))(x).astype(jnp.float32))
  got = run(lambda v: all_reduce.one_shot_all_reduce(v, "tp", 2, num_blocks=blocks))
  want = run(lambda v: jax.lax.psum(v, "tp"))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got[0], got[1])


@pytest.mark.gpu
def test_gpu_model_with_the_kernel_emits_the_xla_all_reduces_tokens():
  _gpu_pair()
  prompts = [[5, 6, 7, 8, 9], [1, 2]]
  kwargs = dict(model=fixture_dir("qwen3_dense"), dtype="bfloat16", max_model_len=64,
                max_num_seqs=2, mesh=MeshConfig(tp=2))
  xla = jspec.LLM(all_reduce_backend="xla", **kwargs).generate(prompts, greedy(8))
  kernel = jspec.LLM(all_reduce_backend="kernel", **kwargs).generate(prompts, greedy(8))
  assert [o.token_ids for o in kernel] == [o.token_ids for o in xla]
