"""The all-reduce + residual add + RMSNorm kernel (jspec.pallas_kernels.workspace_norm) and the
row products that leave it their sums (jspec.sharding.tensor_parallel.PartialSum).

On the CPU: the shapes it takes, bad inputs refused, its module built for Hopper, a deferred
row product reaching the norm as one fused call, a tp model through that path keeping one
device's tokens (the kernel stood in for by psum and the row norm, which it must equal), and
the lowering for CUDA holding the kernel and no all-reduce. On 2 GPUs (`gpu` marker): its
outputs against a NumPy reference and the unfused kernels, both devices alike, its flags back
at zero, long chains mixed with the plain all-reduce, and a model's tokens with and without
the fusion."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jspec
from helpers import fixture_dir, greedy
from jspec.models.norms import RMSNorm, ZeroCenteredRMSNorm
from jspec.pallas_kernels import platform, residual_norm, workspace_all_reduce as wsar
from jspec.pallas_kernels import workspace_norm
from jspec.sharding.rules import MeshConfig, ShardingRules
from jspec.sharding.tensor_parallel import PartialSum, TensorParallelProducts


@pytest.mark.parametrize("shape, dtype, takes", [
    ((1, 4096), jnp.bfloat16, True), ((32, 2048), jnp.bfloat16, True),
    ((8, 7168), jnp.bfloat16, True), ((4, 4096), jnp.float32, True),
    ((33, 4096), jnp.bfloat16, False),      # more rows than the region has slots
    ((1, 8192 + 1024), jnp.bfloat16, False),  # a row past 16 KB
    ((2, 4096 + 64), jnp.bfloat16, False),  # not whole 2 KB tiles
    ((1, 4096), jnp.int32, False), ((4096,), jnp.bfloat16, False)])
def test_the_norm_kernel_takes_rows_of_whole_tiles_within_its_slots(shape, dtype, takes):
  assert workspace_norm.fits(shape, dtype) == takes


def test_bad_inputs_are_refused():
  x = jnp.zeros((2, 1024), jnp.bfloat16)
  row = jnp.zeros(5, jnp.int32)
  with pytest.raises(ValueError, match="rows \\[M, D\\]"):
    workspace_norm.workspace_add_norm(x[:, :1000], x[:, :1000], x[0, :1000], row, 2, eps=1e-6)
  with pytest.raises(ValueError, match="residual must match"):
    workspace_norm.workspace_add_norm(x, x.astype(jnp.float32), x[0], row, 2, eps=1e-6)
  with pytest.raises(ValueError, match="scale: expected"):
    workspace_norm.workspace_add_norm(x, x, x[0, :512], row, 2, eps=1e-6)
  with pytest.raises(ValueError, match="row: expected 5"):
    workspace_norm.workspace_add_norm(x, x, x[0], row[:3], 2, eps=1e-6)
  parts = jnp.zeros((4, 2, 1024), jnp.float32)
  with pytest.raises(ValueError, match="R >= the residual's 3 rows"):
    workspace_norm.workspace_add_norm(parts, jnp.zeros((3, 1024), jnp.bfloat16), x[0], row, 2,
                                      eps=1e-6)
  with pytest.raises(ValueError, match="must be float32"):
    workspace_norm.workspace_add_norm(parts.astype(jnp.bfloat16), x, x[0], row, 2, eps=1e-6)


def test_the_norm_kernel_builds_for_hopper_without_a_gpu(monkeypatch):
  """Its Mosaic GPU module (exchange, sums, the warpgroup reduction, both norm forms) builds
  and verifies; its values are checked on GPUs (no interpreter runs raw Mosaic GPU)."""
  from jax.experimental.mosaic.gpu import utils as mosaic_utils
  monkeypatch.setattr(mosaic_utils, "_infer_arch", lambda: (9, 0))
  for rows, width, dtype, size, zero_centered in [(1, 4096, jnp.bfloat16, 2, False),
                                                  (32, 2048, jnp.float32, 4, True),
                                                  (8, 7168, jnp.float16, 8, False)]:
    assert callable(workspace_norm._build(rows, width, jnp.dtype(dtype), size, 1e-6,
                                          zero_centered))
  for rows, slicing in [(1, (4, 2)), (8, (4, 8)), (3, (2, 3))]:  # K-slice partials
    assert callable(workspace_norm._build(rows, 4096, jnp.dtype(jnp.bfloat16), 2, 1e-6, False,
                                          "lamport", True, slicing))


def test_the_norm_region_lies_past_the_all_reduces_and_inside_the_workspace():
  for size in (2, 4, 8):
    norm = wsar.norm_region(size)
    assert norm.offset == wsar.SUM_REGION.end(size)
    assert norm.flags_offset < norm.counters_offset < norm.data_offset
    assert norm.data_offset % 4096 == 0
    assert norm.end(size) == wsar.lamport_sum_region(size).offset  # the Lamport regions next


def _reference_add_norm(partial, residual, scale, row, size, *, eps, zero_centered):
  """What the kernel must equal: psum, then the row kernel's residual add + RMSNorm; K-slice
  partials [S, R, D] summed over the slices in order in float32 first, their first M rows
  rounded to the residual's dtype."""
  del row, size
  if partial.ndim == 3:
    total = partial[0]
    for part in partial[1:]:
      total = total + part
    partial = total[:residual.shape[0]].astype(residual.dtype)
  delta = jax.lax.psum(partial, "tp")
  return residual_norm.rms_norm(residual, scale, delta, eps=eps, zero_centered=zero_centered,
                                interpret=True)


def _stand_ins(monkeypatch, calls):
  """psum for the all-reduce kernel, the reference for the norm kernel (counting its calls),
  and `fits` for every shape of few rows: the plumbing, not the kernels, is under test."""
  def add_norm(*args, **kwargs):
    calls.append(args[0].shape)
    return _reference_add_norm(*args, **kwargs)
  monkeypatch.setattr(wsar, "workspace_all_reduce", lambda x, row, size: jax.lax.psum(x, "tp"))
  monkeypatch.setattr(workspace_norm, "workspace_add_norm", add_norm)
  monkeypatch.setattr(workspace_norm, "fits", lambda shape, dtype: shape[0] <= wsar.NORM_ROWS)


def _kernel_products(monkeypatch, mesh):
  """Products with the workspace on (Hopper patched in while they are made; XLA's dots in the
  shards, as off Hopper)."""
  with monkeypatch.context() as hopper:
    hopper.setattr(platform, "on_hopper", lambda: True)
    products = TensorParallelProducts(mesh, ShardingRules(), "tp", custom_all_reduce=True)
  products._local = lambda x, w: jnp.einsum("...k,kn->...n", x, w)
  return products


@pytest.mark.parametrize("norm_class", [RMSNorm, ZeroCenteredRMSNorm])
@pytest.mark.parametrize("batch, seq", [(1, 1), (4, 3)])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_a_deferred_row_product_meets_its_norm_in_one_call(monkeypatch, norm_class, batch, seq,
                                                           head_dim):
  """row(defer=True) hands the norm a PartialSum, which the norm takes whole (one fused call)
  to the bits of the row product's sum followed by the residual add and the norm; `+` on it
  sums first. A shard's K of 256 (head_dim 128) goes as 4 K slices' float32 partials (a
  batched product; one row twice), which the kernel sums in float32: then within float32
  rounding of the unsliced sum, not its bits."""
  calls = []
  _stand_ins(monkeypatch, calls)
  mesh = MeshConfig(tp=2).make_mesh()
  products = _kernel_products(monkeypatch, mesh)
  rng = np.random.default_rng(batch * 10 + seq + head_dim)
  x = jnp.asarray(rng.standard_normal((batch, seq, 4, head_dim)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, head_dim, 64)) / 8, jnp.float32)
  residual = jnp.asarray(rng.standard_normal((batch, seq, 64)), jnp.float32)
  norm = norm_class(64, 1e-6, jnp.float32)
  norm.scale[...] = jnp.asarray(rng.standard_normal(64), jnp.float32)
  from jspec.models.row_kernels import sharded_rms_norm
  norm.row_kernel = sharded_rms_norm(mesh, ShardingRules(), 1e-6, norm.zero_centered, True)

  deferred = products.row(x, w, in_axes=2, defer=True)
  assert isinstance(deferred, PartialSum) and deferred.shape == (batch, seq, 64)
  h, normed = norm.add_and_norm(residual, deferred)
  sliced = head_dim == 128
  rows = 2 if batch * seq == 1 else batch * seq
  assert calls == [(4, rows, 64) if sliced else (batch * seq, 64)]
  summed = products.row(x, w, in_axes=2)
  want_h, want_normed = norm.add_and_norm(residual, summed)
  same = (functools.partial(np.testing.assert_allclose, rtol=2e-6, atol=2e-6) if sliced
          else np.testing.assert_array_equal)
  same(np.asarray(h), np.asarray(want_h))
  same(np.asarray(normed), np.asarray(want_normed))
  same(np.asarray(residual + deferred), np.asarray(residual + summed))
  same(np.asarray(deferred + residual), np.asarray(summed + residual))
  np.testing.assert_allclose(np.asarray(summed), np.einsum("btnh,nhd->btd", x, w), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("batch, seq, sliced", [(1, 1, True), (4, 8, True), (5, 8, False)])
def test_k_slices_only_for_rows_the_norm_kernel_takes(monkeypatch, batch, seq, sliced):
  """A decode or verify step's few rows go as 4 K slices' partials (one row twice); a prefill
  chunk's rows (more than wsar.NORM_ROWS a shard) as one product, their sum XLA's."""
  _stand_ins(monkeypatch, [])
  mesh = MeshConfig(tp=2).make_mesh()
  products = _kernel_products(monkeypatch, mesh)
  x = jnp.ones((batch, seq, 4, 128), jnp.float32)
  deferred = products.row(x, jnp.ones((4, 128, 64), jnp.float32), in_axes=2, defer=True)
  assert deferred.shape == (batch, seq, 64)
  if sliced:
    assert deferred.tokens == seq
    assert deferred.partials_ABTD.shape == (2 * 4, batch, 2 if batch * seq == 1 else seq, 64)
    assert deferred.partials_ABTD.dtype == jnp.float32
  else:
    assert deferred.tokens is None and deferred.partials_ABTD.shape == (2, batch, seq, 64)
  np.testing.assert_array_equal(np.asarray(deferred.reduced()), np.full((batch, seq, 64), 512.0))


PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8], [100, 3, 44, 9]]


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 2}])
def test_a_tp2_model_through_the_fused_path_keeps_one_devices_tokens(monkeypatch, spec):
  """Every attention and MLP output of a tp = 2 model reaches its norm as a PartialSum and is
  summed there (the stand-ins count the calls); greedy tokens (with MTP: drafts and verify
  windows too) are one device's."""
  calls = []
  kwargs = dict(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                max_num_seqs=4, norm_backend="pallas", speculative_config=spec)
  one = jspec.LLM(**kwargs).generate(PROMPTS, greedy(8, ignore_eos=True))
  llm = jspec.LLM(mesh=MeshConfig(tp=2), all_reduce_backend="xla", **kwargs)
  _stand_ins(monkeypatch, calls)
  workspace = wsar.PeerWorkspace(llm.mesh, "tp")
  modules = [m for m in (llm.target, llm.mtp) if m is not None]
  products = {id(n.tp_products): n.tp_products for _, n in nnx.iter_graph(modules)
              if getattr(n, "tp_products", None) is not None}
  assert products
  for p in products.values():
    p._workspace = workspace
  got = llm.generate(PROMPTS, greedy(8, ignore_eos=True))
  assert [o.token_ids for o in got] == [o.token_ids for o in one]
  # Each layer: the attention's sum into the post-attention norm, the MLP's into the next
  # layer's input norm (the last layer's into the final norm); once per traced program.
  assert len(calls) >= 2 * len(llm.target.layers)


def test_with_the_kernel_a_norm_after_a_row_product_lowers_to_the_fused_kernel(monkeypatch):
  """Hopper patched in, lowered for CUDA without a GPU: the row product's sum and the norm
  after it are one workspace_add_norm call; no all-reduce and no separate norm is left."""
  from jax.experimental.mosaic.gpu import utils as mosaic_utils
  monkeypatch.setattr(mosaic_utils, "_infer_arch", lambda: (9, 0))
  mesh = MeshConfig(dp=2, tp=2).make_mesh()
  products = _kernel_products(monkeypatch, mesh)
  norm = RMSNorm(1024, 1e-6, jnp.bfloat16)

  def must_not_run(*args):
    raise AssertionError("the separate norm kernel ran")
  norm.row_kernel = must_not_run
  lead = NamedSharding(mesh, P(("dp", "ep"), None, None))

  def step(x, w, residual):
    return norm.add_and_norm(residual, products.row(x, w, in_axes=2, defer=True))
  x = jax.ShapeDtypeStruct((2, 1, 8, 128), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(("dp", "ep"), None, "tp", None)))
  w = jax.ShapeDtypeStruct((8, 128, 1024), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("tp", None, None)))
  residual = jax.ShapeDtypeStruct((2, 1, 1024), jnp.bfloat16, sharding=lead)
  with monkeypatch.context() as hopper:
    hopper.setattr(platform, "on_hopper", lambda: True)
    text = jax.jit(step).trace(x, w, residual).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "workspace_add_norm" in text
  assert "stablehlo.all_reduce" not in text and "workspace_all_reduce\"" not in text


# ---- on 2 GPUs --------------------------------------------------------------------------------

def _gpu_pair():
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if len(gpus) < 2:
    pytest.skip("needs 2 GPUs")
  return Mesh(np.asarray(gpus[:2]), ("tp",))


def _numpy_add_norm(partials, residual, scale, eps, zero_centered, dtype):
  """The reference, in NumPy: the float32 sum rounded to `dtype`, the add rounded, the norm."""
  cast = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(dtype).astype(jnp.float32))
  delta = cast(partials.astype(np.float32).sum(0))
  h = cast(residual.astype(np.float32) + delta)
  normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
  scale = scale.astype(np.float32)
  out = normed * (1 + scale) if zero_centered else scale * cast(normed)
  return h, cast(out)


def _run_add_norm(mesh, partials, residual, scale, eps, zero_centered):
  workspace = wsar.workspace_for(mesh, "tp")
  fn = jax.jit(jax.shard_map(
      lambda p, r, s, row: tuple(o[None] for o in workspace_norm.workspace_add_norm(
          p[0], r, s, row, 2, eps=eps, zero_centered=zero_centered)),
      mesh=mesh, in_specs=(P("tp"), P(), P(), workspace.row_spec), out_specs=(P("tp"), P("tp")),
      check_vma=False))
  h, normed = fn(partials, residual, scale, workspace.rows)
  return np.asarray(h.astype(jnp.float32)), np.asarray(normed.astype(jnp.float32)), workspace


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width, dtype, zero_centered", [
    (1, 4096, jnp.bfloat16, False), (8, 4096, jnp.bfloat16, False), (32, 2048, jnp.bfloat16, True),
    (3, 7168, jnp.bfloat16, False), (2, 1024, jnp.float32, True), (4, 4096, jnp.float16, False)])
def test_gpu_norm_kernel_equals_the_sum_the_add_and_the_norm(rows, width, dtype, zero_centered):
  """h bit for bit as the unfused steps round it, the norm within one rounding of the NumPy
  reference (the float32 sum of squares is ordered differently), both devices alike, and the
  flags at zero afterwards."""
  mesh = _gpu_pair()
  rng = np.random.default_rng(rows * width)
  partials = jnp.asarray(rng.standard_normal((2, rows, width)), dtype)
  residual = jnp.asarray(rng.standard_normal((rows, width)) * 4, dtype)
  scale = jnp.asarray(rng.standard_normal(width), dtype)
  h, normed, workspace = _run_add_norm(
      mesh, jax.device_put(partials, NamedSharding(mesh, P("tp"))), residual, scale, 1e-6,
      zero_centered)
  want_h, want_normed = _numpy_add_norm(np.asarray(partials.astype(jnp.float32)),
                                        np.asarray(residual.astype(jnp.float32)),
                                        np.asarray(scale.astype(jnp.float32)), 1e-6,
                                        zero_centered, dtype)
  for device in range(2):
    np.testing.assert_array_equal(h[device], want_h)
    ulp = np.abs(want_normed) * float(jnp.finfo(dtype).eps) + 1e-6
    assert np.all(np.abs(normed[device] - want_normed) <= 2 * ulp)
  np.testing.assert_array_equal(normed[0], normed[1])
  assert all(not f.any() for f in workspace.flags().values())
  assert all(workspace.lamport_idle().values())


@pytest.mark.gpu
def test_gpu_chains_of_sums_and_norms_keep_their_flags_in_step():
  """The flag protocol (tests/test_lamport_exchange.py has the Lamport one): 150 rounds of a
  plain all-reduce (8 blocks), a norm of one row and a norm of eight rows in turn: both devices
  end alike and near the psum + NumPy-order chain, the flags at zero, the same per-slot call
  counts on both."""
  mesh = _gpu_pair()
  rng = np.random.default_rng(11)
  partials = jax.device_put(jnp.asarray(rng.standard_normal((2, 8, 2048)), jnp.bfloat16),
                            NamedSharding(mesh, P("tp")))
  scale = jnp.asarray(rng.standard_normal(2048), jnp.bfloat16)

  def chain(add_norm, reduce):
    def fn(p, scale, row):
      def step(_, h):
        summed = reduce(p[0] * 0.5, row)
        h1, n1 = add_norm(summed[:1] * 0.1, h[:1] * 0.5, scale, row)
        h8, n8 = add_norm(p[0] * 0.1 + n1, h * 0.5, scale, row)
        return (h8 + n8 * 0.01).at[:1].add(h1 * 0.01)
      # The residual stream is the same on every device, as in a model: start from a sum.
      return jax.lax.fori_loop(0, 150, step, reduce(p[0], row))[None]
    return fn

  workspace = wsar.workspace_for(mesh, "tp")
  run = lambda fn: np.asarray(jax.jit(jax.shard_map(
      fn, mesh=mesh, in_specs=(P("tp"), P(), workspace.row_spec), out_specs=P("tp"),
      check_vma=False))(partials, scale, workspace.rows).astype(jnp.float32))
  got = run(chain(lambda p, r, s, row: workspace_norm.workspace_add_norm(
                      p, r, s, row, 2, eps=1e-6, protocol="flags"),
                  lambda x, row: wsar.workspace_all_reduce(x, row, 2, protocol="flags")))
  want = run(chain(lambda p, r, s, row: residual_norm.rms_norm(r, s, jax.lax.psum(p, "tp"),
                                                               eps=1e-6),
                   lambda x, row: jax.lax.psum(x, "tp")))
  np.testing.assert_array_equal(got[0], got[1])
  np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)
  assert all(not f.any() for f in workspace.flags().values())
  counters = list(workspace.counters().values())
  np.testing.assert_array_equal(counters[0], counters[1])
  # Rows of 2048 bf16 are two 2 KB chunks: row r's in slots 8 r and 8 r + 1. Row 0 runs in
  # both norms (300 calls), row 7 in the eight-row one (150); other tests of the process may
  # have used any slot before.
  norm_slots = counters[0][wsar.MAX_BLOCKS:].reshape(wsar.NORM_ROWS, wsar.NORM_ROW_SLOTS)
  assert (norm_slots[0, :2] >= 300).all() and (norm_slots[7, :2] >= 150).all()


@pytest.mark.gpu
def test_gpu_model_tokens_with_and_without_the_fusion():
  """A float32 model of 4096-wide rows at tp = 2: the kernel path (sums fused into the norms,
  o / down as K slices' partials or as one product each) emits the tokens of the same path
  with the norms apart."""
  _gpu_pair()
  import dataclasses
  from jspec.bench.presets import PRESETS
  config = dataclasses.replace(PRESETS["qwen3-8b"], num_layers=2, vocab_size=4096)
  prompts = [[5, 6, 7, 8, 9], [1, 2]]
  outputs = []
  for defer, slices in ((True, 4), (True, 0), (False, 4)):
    llm = jspec.LLM.from_random(config, mesh=MeshConfig(tp=2), dtype="float32",
                                max_model_len=64, max_num_seqs=2, all_reduce_backend="kernel")
    layers = [n for _, n in nnx.iter_graph(llm.target) if getattr(n, "tp_products", None)]
    assert layers
    for node in layers:
      node.tp_products.defer_sums = defer
      node.tp_products.k_slices = slices
    outputs.append([o.token_ids for o in llm.generate(prompts, greedy(12, ignore_eos=True))])
  assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, part_rows, slices", [(1, 2, 4), (8, 8, 4), (3, 3, 2)])
def test_gpu_norm_kernel_sums_k_slice_partials_before_the_exchange(rows, part_rows, slices):
  """K slices' float32 partials [S, R, D]: each device's slices summed in order in float32 and
  rounded to bf16 (the first M of R rows), then as bf16 partials: h bit for bit, the norm
  within one rounding, both devices alike."""
  mesh = _gpu_pair()
  width, dtype = 4096, jnp.bfloat16
  rng = np.random.default_rng(rows * 100 + slices)
  parts = rng.standard_normal((2, slices, part_rows, width)).astype(np.float32)
  residual = jnp.asarray(rng.standard_normal((rows, width)) * 4, dtype)
  scale = jnp.asarray(rng.standard_normal(width), dtype)
  h, normed, workspace = _run_add_norm(
      mesh, jax.device_put(jnp.asarray(parts), NamedSharding(mesh, P("tp"))), residual, scale,
      1e-6, False)
  per_device = parts[:, 0]
  for s in range(1, slices):
    per_device = per_device + parts[:, s]  # float32, in the kernel's order
  rounded = np.asarray(jnp.asarray(per_device[:, :rows]).astype(dtype).astype(jnp.float32))
  want_h, want_normed = _numpy_add_norm(rounded, np.asarray(residual.astype(jnp.float32)),
                                        np.asarray(scale.astype(jnp.float32)), 1e-6, False, dtype)
  for device in range(2):
    np.testing.assert_array_equal(h[device], want_h)
    ulp = np.abs(want_normed) * float(jnp.finfo(dtype).eps) + 1e-6
    assert np.all(np.abs(normed[device] - want_normed) <= 2 * ulp)
  assert all(workspace.lamport_idle().values())
