"""Tensor-parallel layers written shard by shard (jspec.sharding.tensor_parallel) and the
one-shot all-reduce kernels (jspec.pallas_kernels.workspace_all_reduce, the layers' kernel, and
jspec.pallas_kernels.all_reduce, the remote_ref form): the products equal one device's einsum
on every mesh layout, a row product is reduced by exactly one all-reduce, a model keeps one
device's greedy tokens, the kernels build for Hopper without a GPU, the workspace's block plan
and address table are right, "auto" resolves as documented, and bad options are refused. The
kernels' sums against psum's, and the workspace's flags, run on 2 GPUs (`gpu` marker)."""

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
from jspec.models.layers import Attention
from jspec.models.mlp import MLP
from jspec.pallas_kernels import all_reduce, workspace_all_reduce as wsar
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


# The workspace kernel (jspec.pallas_kernels.workspace_all_reduce): its plan, its address
# table and its lowering on the CPU; its sums and its flags on 2 GPUs.

def test_the_workspace_kernel_takes_small_float_and_int32_messages_of_whole_tiles():
  assert wsar.fits((1, 1, 4096), jnp.bfloat16)           # a batch-1 row: 8 KB, 4 tiles
  assert wsar.fits((32, 1, 4096), jnp.bfloat16)          # 256 KB: the limit
  assert not wsar.fits((33, 1, 4096), jnp.bfloat16)
  assert not wsar.fits((1, 1000), jnp.bfloat16)
  assert wsar.fits((1, 4096), jnp.int32)                 # words gathered as sums (sharding.moe)
  assert not wsar.fits((1, 4096), jnp.int8) and not wsar.fits((1, 4096), jnp.uint32)
  with pytest.raises(ValueError, match="whole 2048-byte tiles"):
    wsar.workspace_all_reduce(jnp.zeros((3, 100), jnp.bfloat16), jnp.zeros(5, jnp.int32), 2)


@pytest.mark.parametrize("nbytes", [2048 * k for k in (1, 2, 3, 4, 5, 7, 16, 24, 64, 96, 128)])
@pytest.mark.parametrize("max_blocks", [1, 4, 32, 64])
def test_the_block_plan_splits_the_tiles_evenly_within_a_blocks_slot(nbytes, max_blocks):
  tiles, per_max = nbytes // wsar.TILE_BYTES, wsar.BLOCK_BYTES // wsar.TILE_BYTES
  if not any(tiles % g == 0 and tiles // g <= per_max for g in range(1, max_blocks + 1)):
    with pytest.raises(ValueError, match="no even split"):
      wsar.plan_blocks(nbytes, max_blocks)
    assert not wsar.fits((nbytes // 2,), jnp.bfloat16, max_blocks)
    return
  assert wsar.fits((nbytes // 2,), jnp.bfloat16, max_blocks)
  blocks, per_block = wsar.plan_blocks(nbytes, max_blocks)
  assert blocks * per_block * wsar.TILE_BYTES == nbytes
  assert 1 <= blocks <= min(max_blocks, wsar.MAX_BLOCKS)
  assert per_block * wsar.TILE_BYTES <= wsar.BLOCK_BYTES
  # the most such blocks: no larger divisor fits
  assert not any(tiles % g == 0 and tiles // g <= per_max
                 for g in range(blocks + 1, min(max_blocks, wsar.MAX_BLOCKS) + 1))


def test_a_plan_that_needs_more_blocks_than_there_are_is_refused():
  with pytest.raises(ValueError, match="no even split"):
    wsar.plan_blocks(128 * 2048, max_blocks=8)   # 128 tiles, at most 4 a block
  assert not wsar.fits((127 * 1024,), jnp.bfloat16)  # 127 tiles: prime, more than 32 blocks
  with pytest.raises(ValueError, match="not a whole number"):
    wsar.plan_blocks(3000)


@pytest.mark.parametrize("shape, axis", [((2,), 0), ((2, 4), 1), ((2, 4), 0), ((2, 1, 4), 2)])
def test_each_devices_row_names_its_groups_workspaces_in_axis_order_and_its_rank(shape, axis):
  rng = np.random.default_rng(sum(shape) + axis)
  ids = rng.permutation(int(np.prod(shape))).reshape(shape)
  addresses = {int(d): int(rng.integers(1, 2**47)) * 256 for d in ids.flat}
  rows = wsar.group_rows(ids, axis, addresses)
  size = shape[axis]
  assert rows.shape == (*shape, 2 * size + 1) and rows.dtype == np.int32
  for index in np.ndindex(shape):
    row = rows[index].view(np.uint32).astype(np.uint64)
    group = [ids[index[:axis] + (r,) + index[axis + 1:]] for r in range(size)]
    got = [int(row[2 * r]) | (int(row[2 * r + 1]) << 32) for r in range(size)]
    assert got == [addresses[int(d)] for d in group]
    assert int(row[-1]) == index[axis]


def test_the_workspace_hands_each_device_its_own_row_inside_a_shard_map():
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
  workspace = wsar.PeerWorkspace(mesh, "tp")
  seen = jax.jit(jax.shard_map(lambda row: row.reshape(1, 1, -1), mesh=mesh,
                               in_specs=workspace.row_spec, out_specs=workspace.row_spec))(
                                   workspace.rows)
  seen = np.asarray(seen)
  for i, j in np.ndindex(2, 4):
    assert seen[i, j, -1] == j          # its rank along tp
    assert np.array_equal(seen[i, j, :-1], seen[i, 0, :-1])   # one table per dp group
  assert not np.array_equal(seen[0, 0, :-1], seen[1, 0, :-1])
  # Every device its own buffer: 8 distinct addresses (each two int32 words).
  addresses = {tuple(seen[i, 0, 2 * j:2 * j + 2]) for i, j in np.ndindex(2, 4)}
  assert len(addresses) == 8, addresses
  assert all(not f.any() for f in workspace.flags().values())
  with pytest.raises(ValueError, match="2 to 8 devices"):
    wsar.PeerWorkspace(Mesh(np.asarray(jax.devices()[:1]), ("tp",)), "tp")


def test_the_workspace_kernel_builds_for_hopper_without_a_gpu(monkeypatch):
  """The kernel's Mosaic GPU module (its address arithmetic, flags and sums) builds and
  verifies; its sums are checked on GPUs, since no interpreter runs raw Mosaic GPU."""
  from jax.experimental.mosaic.gpu import utils as mosaic_utils
  monkeypatch.setattr(mosaic_utils, "_infer_arch", lambda: (9, 0))
  for n, dtype, size, blocks, per in [(4096, jnp.bfloat16, 2, 4, 1), (65536, jnp.float32, 4, 32, 4)]:
    kernel = wsar._build(n, jnp.dtype(dtype), size, blocks, per)
    assert callable(kernel)


def _gpu_workspace_run(mesh, fn, x):
  workspace = wsar.workspace_for(mesh, "tp")
  program = jax.jit(jax.shard_map(lambda v, row: fn(v[0], row)[None], mesh=mesh,
                                  in_specs=(P("tp"), workspace.row_spec), out_specs=P("tp"),
                                  check_vma=False))
  return np.asarray(program(x, workspace.rows).astype(jnp.float32)), workspace


@pytest.mark.gpu
@pytest.mark.parametrize("elements, dtype, max_blocks", [(1024, jnp.bfloat16, 32),
                                                         (4096, jnp.bfloat16, 1),
                                                         (4096, jnp.bfloat16, 32),
                                                         (32768, jnp.bfloat16, 32),
                                                         (131072, jnp.bfloat16, 32),
                                                         (4096, jnp.float16, 8),
                                                         (8192, jnp.float32, 4),
                                                         (65536, jnp.float32, 64)])
def test_gpu_workspace_kernel_equals_psum_on_two_gpus(elements, dtype, max_blocks):
  """On 2 GPUs the workspace kernel's sums equal psum's bit for bit (one rounding of the same
  exact sum) on both devices, and its flags are all zero again after the call."""
  mesh = _gpu_pair()
  rng = np.random.default_rng(elements + max_blocks)
  x = jax.device_put(jnp.asarray(rng.standard_normal((2, elements)), dtype),
                     NamedSharding(mesh, P("tp")))
  got, workspace = _gpu_workspace_run(
      mesh, lambda v, row: wsar.workspace_all_reduce(v, row, 2, max_blocks=max_blocks), x)
  want, _ = _gpu_workspace_run(mesh, lambda v, row: jax.lax.psum(v, "tp"), x)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got[0], got[1])
  assert all(not f.any() for f in workspace.flags().values())
  assert all(workspace.lamport_idle().values())


@pytest.mark.gpu
def test_gpu_workspace_kernel_chains_of_mixed_messages_keep_their_flags_in_step():
  """The flag protocol: hundreds of dependent calls in a loop, three message sizes (1, 8 and
  32 blocks) in turn, as a decode loop makes them: every value equals the same chain through
  psum, the flags are zero afterwards, and both devices count the same calls per block."""
  mesh = _gpu_pair()
  rng = np.random.default_rng(7)
  x = jax.device_put(jnp.asarray(rng.standard_normal((2, 65536)), jnp.bfloat16),
                     NamedSharding(mesh, P("tp")))

  def chain(reduce):
    def fn(v, row):
      def step(_, v):
        small = reduce(v[:1024] * 0.5, row)                 # 2 KB: 1 block
        mid = reduce(v[:8192] * 0.25, row)                  # 16 KB: 8 blocks
        big = reduce(v * 0.125, row)                        # 128 KB: 32 blocks
        return big.at[:8192].add(mid).at[:1024].add(small) * 0.3
      return jax.lax.fori_loop(0, 150, step, v)
    return fn

  got, workspace = _gpu_workspace_run(
      mesh, chain(lambda v, row: wsar.workspace_all_reduce(v, row, 2, protocol="flags")), x)
  want, _ = _gpu_workspace_run(mesh, chain(lambda v, row: jax.lax.psum(v, "tp")), x)
  np.testing.assert_array_equal(got, want)
  assert all(not f.any() for f in workspace.flags().values())
  counters = list(workspace.counters().values())
  np.testing.assert_array_equal(counters[0], counters[1])
  assert counters[0][0] >= 450 and counters[0][31] >= 150


def test_auto_means_the_kernel_on_hopper_gpus_of_one_process_and_the_partitioner_elsewhere(
    monkeypatch):
  from jspec.pallas_kernels import platform
  from jspec.sharding.tensor_parallel import resolve_all_reduce_backend
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",))
  assert resolve_all_reduce_backend("auto", "auto", mesh) == (
      "kernel" if platform.on_hopper() else "partitioner")
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  assert resolve_all_reduce_backend("auto", "auto", mesh) == "kernel"
  assert resolve_all_reduce_backend("auto", "pallas", mesh) == "kernel"
  assert resolve_all_reduce_backend("auto", "xla", mesh) == "partitioner"
  for name in ("partitioner", "xla", "kernel"):
    assert resolve_all_reduce_backend(name, "auto", mesh) == name
  # PCIe boards may lack peer access, and another process's GPUs have no address here.
  import types
  board = lambda kind, process: types.SimpleNamespace(device_kind=kind, process_index=process)
  stand_in = lambda *devices: types.SimpleNamespace(devices=np.asarray(devices, dtype=object))
  here = jax.process_index()
  assert resolve_all_reduce_backend("auto", "auto", stand_in(
      board("NVIDIA H100 80GB HBM3", here), board("NVIDIA H100 80GB HBM3", here))) == "kernel"
  assert resolve_all_reduce_backend("auto", "auto", stand_in(
      board("NVIDIA H100 PCIe", here), board("NVIDIA H100 PCIe", here))) == "partitioner"
  assert resolve_all_reduce_backend("auto", "auto", stand_in(
      board("NVIDIA H200", here), board("NVIDIA H200", here + 1))) == "partitioner"


def test_the_partitioner_with_pallas_projections_is_refused():
  with pytest.raises(ValueError, match="projection_backend='pallas' writes them shard by shard"):
    _llm(tp=2, all_reduce_backend="partitioner", projection_backend="pallas")


def test_with_the_kernel_a_row_product_lowers_to_the_workspace_kernel_on_every_tp_group(
    monkeypatch):
  """dp = 2 x tp = 2 with the kernel on (Hopper patched in, lowered for CUDA without a GPU):
  the row product's sum is the workspace kernel, each device handed its own group's row of
  the address table, and no all-reduce is left; a row past the kernel's 256 KB keeps psum."""
  from jax.experimental.mosaic.gpu import utils as mosaic_utils
  from jspec.pallas_kernels import platform
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  monkeypatch.setattr(mosaic_utils, "_infer_arch", lambda: (9, 0))
  mesh = MeshConfig(dp=2, tp=2).make_mesh()
  products = TensorParallelProducts(mesh, ShardingRules(), "tp", custom_all_reduce=True)
  for rows, kernel in [(2, True), (2 * 256, False)]:   # 2 KB and 512 KB a shard
    x = jax.ShapeDtypeStruct((rows, 1, 8, 128), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(("dp", "ep"), None, "tp", None)))
    w = jax.ShapeDtypeStruct((8, 128, 1024), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("tp", None, None)))
    text = jax.jit(functools.partial(products.row, in_axes=2)).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert ("workspace_all_reduce" in text) == kernel
    assert ("stablehlo.all_reduce" in text) != kernel
