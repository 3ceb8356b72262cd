"""FP8 projections split over tp through the FP8 kernels shard by shard
(jspec.models.fp8_tensor_parallel): column and row products of weights as FP8 checkpoints
store them equal the dequantized NumPy product on every mesh layout (interpret mode), shares
that would cut a 128 x 128 block are left to the layer's own product, and tiny FP8 models
(Qwen3, DeepSeek-V3's MLA) at tp = 2 through the kernels keep the tokens of one device's XLA
path (weights scaled, then XLA's dot)."""

import collections
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jspec
from jspec.bench.presets import PRESETS
from jspec.models import fp8_tensor_parallel
from jspec.models.fp8_tensor_parallel import Fp8TensorParallel
from jspec.models.norms import RMSNorm
from jspec.models.row_kernels import sharded_rms_norm
from jspec.pallas_kernels import fp8_gemm, platform
from jspec.pallas_kernels import workspace_all_reduce as wsar
from jspec.sharding.rules import MeshConfig, ShardingRules
from jspec.sharding.tensor_parallel import PartialSum, tensor_parallel_products
from test_workspace_norm import _kernel_products, _stand_ins

BLOCK = 128
MESHES = [(1, 2, 1), (2, 2, 1), (1, 2, 2)]  # (dp, tp, ep)


def _fp8(rng, shape, in_axes: int = 1):
  """(e4m3 weight stored output-first, its float32 block scales over the same axes, the last
  output and last input axis in blocks, and the dequantized float32 weight)."""
  w8 = np.clip(rng.standard_normal(shape) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  grid = list(shape)
  grid[-1] //= BLOCK
  grid[-in_axes - 1] //= BLOCK
  scale = rng.uniform(1e-4, 1e-2, grid).astype(np.float32)
  full = scale
  for axis in (-1, -in_axes - 1):
    full = np.repeat(full, BLOCK, axis=axis)
  return w8, scale, w8.astype(np.float32) * full


def _bound(x32, w32, want):
  """One bf16 output rounding plus float32 sums' error (as test_fp8_gemm's)."""
  return 2.0 ** -8 * np.abs(want) + 1e-5 * (np.abs(x32) @ np.abs(w32).T)


@pytest.mark.usefixtures("interpreted_on_every_device", "fresh_traces")
@pytest.mark.parametrize("dp, tp, ep", MESHES)
def test_column_and_row_products_equal_the_dequantized_product(dp, tp, ep):
  """q / k / v in one call (heads split), gate / up (F split) and o_proj (heads split, two
  input axes) / down_proj (F split, one) with their partial sums reduced over tp: each within
  one bf16 rounding of the float32 product of the dequantized weights."""
  mesh = MeshConfig(dp=dp, tp=tp, ep=ep).make_mesh()
  # the scales' kernel lanes made beforehand (as the loop makes them) on two meshes of three
  _check_products(mesh, dp * ep, 3, 256, 2 * tp, tp, 256 * tp, custom=False,
                  rng=np.random.default_rng([dp, tp, ep]), with_lanes=dp * ep > 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_products_at_qwen3_8b_shapes_on_two_gpus(rows):
  """Compiled on 2 GPUs at Qwen3-8B's shapes (32 heads, 8 KV heads, F = 12288), the row
  products reduced by the workspace kernel: as the interpreted test."""
  if sum(d.platform == "gpu" for d in jax.devices()) < 2:
    pytest.skip("needs 2 GPUs")
  assert wsar.fits((rows, 1, 4096), jnp.bfloat16)  # the row products' all-reduce: the kernel
  mesh = MeshConfig(tp=2).make_mesh()
  _check_products(mesh, rows, 1, 4096, 32, 8, 12288, custom=True,
                  rng=np.random.default_rng(rows), with_lanes=True)


def _check_products(mesh, b, t, d, heads, kv, f, custom: bool, rng, with_lanes: bool):
  """Each product of Fp8TensorParallel at these sizes against the dequantized NumPy product,
  every share taken by the few-row FP8 kernel; `with_lanes`: the scales' lanes passed."""
  tp = mesh.shape["tp"]
  products = tensor_parallel_products(mesh, ShardingRules(), custom)
  fp8 = Fp8TensorParallel(products, (BLOCK,) * 2)
  h = 128
  for n, k in ((heads * h // tp, d), (2 * f // tp, d), (d, heads * h // tp), (d, f // tp)):
    assert fp8_gemm.fits_kernel(b * t, k, n, (BLOCK, BLOCK))  # no XLA fallback
  lanes = lambda scales, spec: (tuple(put(fp8_gemm.scale_lanes(s), spec) for s in scales)
                                if with_lanes else None)
  x = rng.standard_normal((b, t, d)).astype(ml_dtypes.bfloat16)
  x32 = x.astype(np.float32).reshape(b * t, d)
  put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
  x_d = put(x, P(("dp", "ep"), None, None))
  qkv = [_fp8(rng, (n, h, d)) for n in (heads, kv, kv)]
  outs = fp8.column(x_d, [(put(w8, P("tp")), put(s, P("tp"))) for w8, s, _ in qkv], 0,
                    lanes([s for _, s, _ in qkv], P("tp")))
  for out, (_, _, w32) in zip(outs, qkv):
    assert out.shape == (b, t, *w32.shape[:-1]) and out.dtype == jnp.bfloat16
    want = x32 @ w32.reshape(-1, d).T
    got = np.asarray(out, np.float32).reshape(b * t, -1)
    assert (np.abs(got - want) <= _bound(x32, w32.reshape(-1, d), want)).all()
  w8, s, w32 = _fp8(rng, (2, f, d))
  (gate_up,) = fp8.column(x_d, [(put(w8, P(None, "tp")), put(s, P(None, "tp")))], 1,
                          lanes([s], P(None, "tp")))
  want = x32 @ w32.reshape(-1, d).T
  got = np.asarray(gate_up, np.float32).reshape(b * t, -1)
  assert gate_up.shape == (b, t, 2, f)
  assert (np.abs(got - want) <= _bound(x32, w32.reshape(-1, d), want)).all()
  for in_shape, in_axes in (((heads, h), 2), ((f,), 1)):
    xi = rng.standard_normal((b, t, *in_shape)).astype(ml_dtypes.bfloat16)
    w8, s, w32 = _fp8(rng, (d, *in_shape), in_axes)
    split = P(None, "tp", *(None,) * (in_axes - 1))
    out = fp8.row(put(xi, P(("dp", "ep"), None, "tp", *(None,) * (in_axes - 1))),
                  put(w8, split), put(s, split), in_axes=in_axes,
                  lanes=(lanes([s], split) or (None,))[0])
    xi32 = xi.astype(np.float32).reshape(b * t, -1)
    w32 = w32.reshape(d, -1)
    want = xi32 @ w32.T
    got = np.asarray(out, np.float32).reshape(b * t, d)
    # each shard's partial is rounded to bf16 before the all-reduce, whose sum rounds again
    share = w32.shape[1] // tp
    partials = [xi32[:, i * share:(i + 1) * share] @ w32[:, i * share:(i + 1) * share].T
                for i in range(tp)]
    bound = _bound(xi32, w32, want) + sum(2.0 ** -8 * np.abs(p) for p in partials)
    assert out.shape == (b, t, d)
    assert (np.abs(got - want) <= bound).all()


def test_shares_that_would_cut_a_block_are_refused():
  """`takes`: a split axis (and its scales) that the shards divide, into shares whose inner
  output axis and last input axis are whole blocks."""
  mesh = MeshConfig(tp=2).make_mesh()
  fp8 = Fp8TensorParallel(tensor_parallel_products(mesh, ShardingRules(), False), (BLOCK,) * 2)
  w = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn)
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  assert fp8.takes([(w(4, 128, 256), s(4, 1, 2))], 0)           # heads split, whole heads
  assert not fp8.takes([(w(3, 128, 256), s(3, 1, 2))], 0)       # 3 heads over 2 shards
  assert fp8.takes([(w(2, 512, 256), s(2, 4, 2))], 1)           # F = 512: 256 a shard
  assert not fp8.takes([(w(2, 384, 256), s(2, 3, 2))], 1)       # 192 a shard: a cut block
  assert fp8.takes([(w(256, 4, 128), s(2, 4, 1))], 1, in_axes=2)
  assert fp8.takes([(w(256, 512), s(2, 4))], 1)                 # down: F = 512 split
  assert not fp8.takes([(w(256, 128), s(2, 1))], 1)             # K = 128: 64 a shard
  assert not fp8.takes([(w(4, 64, 256), s(4, 1, 2))], 0)        # heads of 64: a block holds 2
  # a refused share leaves the product to the layer (None), a bf16 projection too
  e4m3 = lambda *shape: np.zeros(shape, ml_dtypes.float8_e4m3fn)
  layer = types.SimpleNamespace(q_proj=e4m3(3, 128, 256), q_proj_scale=np.ones((3, 1, 2)),
                                o_proj=e4m3(256, 3, 128), o_proj_scale=np.ones((2, 3, 1)),
                                k_proj=np.zeros((2, 128, 256)), k_proj_scale=None)
  x = np.zeros((1, 1, 256), np.float32)
  assert fp8.layer_column(layer, x, ("q_proj",), 0) is None
  assert fp8.layer_column(layer, x, ("q_proj", "k_proj"), 0) is None
  assert fp8.layer_row(layer, np.zeros((1, 1, 3, 128), np.float32), "o_proj", in_axes=2) is None


@pytest.mark.parametrize("on_gpu, hopper", [(False, False), (True, False), (True, True)])
def test_which_devices_and_backends_take_the_tp_products(monkeypatch, on_gpu, hopper):
  """block_for: "xla" never; "pallas" on Hopper or interpreted off a GPU, never on another GPU
  (the kernels need wgmma and the TMA); "auto" on Hopper while ON_HOPPER is on."""
  monkeypatch.setattr(platform, "on_gpu", lambda: on_gpu)
  monkeypatch.setattr(platform, "on_hopper", lambda: hopper)
  block = (BLOCK, BLOCK)
  assert fp8_tensor_parallel.block_for(block, "xla") is None
  assert fp8_tensor_parallel.block_for(None, "pallas") is None
  assert fp8_tensor_parallel.block_for(block, "pallas") == (block if hopper or not on_gpu
                                                            else None)
  assert fp8_tensor_parallel.block_for(block, "auto") == (block if hopper else None)
  monkeypatch.setattr(fp8_tensor_parallel, "ON_HOPPER", False)
  assert fp8_tensor_parallel.block_for(block, "auto") is None
  assert fp8_tensor_parallel.block_for(block, "pallas") == (block if hopper or not on_gpu
                                                            else None)


# Tiny FP8 models whose split projections keep whole 128 x 128 blocks at tp = 2, and the layers
# whose products (column, row, whole) go through Fp8TensorParallel: Qwen3 (4 heads of 128, 2 KV
# heads, F = 512); DeepSeek-V3 (MLA: q_b_proj and o_proj over 4 heads, q_a and kv_a whole on
# each shard, a dense first layer's MLP, then MoE layers, whose experts keep their own backend).
TINY_FP8 = {
    "qwen3": (PRESETS["qwen3-8b"].replace(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=128, fp8_block=(BLOCK, BLOCK)),
        {("Attention", "column"), ("Attention", "row"), ("MLP", "column"), ("MLP", "row")}),
    "deepseek_v3": (PRESETS["deepseek-v3"].replace(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
        num_kv_heads=4, head_dim=64, max_position_embeddings=4096, fp8_block=(BLOCK, BLOCK),
        moe=dict(num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                 intermediate_size=256, first_k_dense_replace=1),
        mla=dict(q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128)),
        {("MLAttention", "column"), ("MLAttention", "row"), ("MLAttention", "whole"),
         ("MLP", "column"), ("MLP", "row")}),
}


@pytest.mark.usefixtures("interpreted_on_every_device", "fresh_traces")
@pytest.mark.parametrize("family", sorted(TINY_FP8))
def test_a_tiny_fp8_model_at_tp_2_through_the_kernels_keeps_one_devices_tokens(monkeypatch,
                                                                               family):
  """A tiny FP8 model in float32 at tp = 2 with the projections through the kernels shard by
  shard (projection_backend "pallas"; on a Hopper GPU, "auto"): every split FP8 projection of
  its attention (GQA's q / k / v and o_proj, MLA's q_b_proj and o_proj) and dense MLPs, and
  MLA's q_a / kv_a whole on each shard, go through Fp8TensorParallel, the loop's steps with
  their scales' lanes made before the loop; the greedy tokens and top-3 logprobs of prompts
  and decode steps equal one device's XLA path (weights scaled, then XLA's dot) within the
  kernel's float16 route for float32 activations."""
  layers, prepared = set(), []  # prepared: the scales' kernel lanes made before the loop
  for name in ("layer_column", "layer_row", "layer_whole"):
    real = getattr(Fp8TensorParallel, name)

    def layer_spy(self, layer, *args, real=real, name=name, **kwargs):
      out = real(self, layer, *args, **kwargs)
      if out is not None:
        layers.add((type(layer).__name__, name.removeprefix("layer_")))
        lanes = self._lanes(layer, (args[1],) if name == "layer_row" else args[1])
        prepared.append(all(l is not None for l in lanes))
      return out
    monkeypatch.setattr(fp8_tensor_parallel.Fp8TensorParallel, name, layer_spy)
  config, expected = TINY_FP8[family]
  params = jspec.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
  prompts = [[5, 17, 42, 8, 99, 3], [7, 7, 300, 12]]
  outputs = []
  for tp in (1, 2):
    llm = jspec.LLM.from_random(config, dtype="float32", seed=4, max_model_len=64,
                                max_num_seqs=2, projection_backend="pallas",
                                all_reduce_backend="xla", mesh=jspec.MeshConfig(tp=tp))
    outputs.append(llm.generate(prompts, params, use_tqdm=False))
    assert layers == (set() if tp == 1 else expected)
    assert (tp == 1) or any(prepared)  # the loop's steps read lanes made before it
  for one, two in zip(*outputs):
    assert one.token_ids == two.token_ids
    for step_one, step_two in zip(one.logprobs, two.logprobs):
      assert step_one.keys() == step_two.keys()
      for token, entry in step_one.items():
        assert abs(entry.logprob - step_two[token].logprob) < 3e-3


@pytest.mark.usefixtures("interpreted_on_every_device", "fresh_traces")
@pytest.mark.parametrize("b, t, in_axes", [(1, 1, 2), (3, 2, 1)])
def test_a_deferred_fp8_row_product_meets_its_norm_in_one_call(monkeypatch, b, t, in_axes):
  """With the workspace kernel on (stand-ins: psum and the row kernel's add + norm), row(...,
  defer=True) hands the norm a PartialSum of the shards' partials, which the norm takes whole
  in one call: the bits of the summed product followed by the residual add and the norm; `+`
  and `reduced()` sum first."""
  calls = []
  _stand_ins(monkeypatch, calls)
  mesh = MeshConfig(tp=2).make_mesh()
  fp8 = Fp8TensorParallel(_kernel_products(monkeypatch, mesh), (BLOCK,) * 2)
  rng = np.random.default_rng([b, t, in_axes])
  d, in_shape = 256, ((4, 128) if in_axes == 2 else (512,))
  x = jnp.asarray(rng.standard_normal((b, t, *in_shape)), jnp.bfloat16)
  w8, s, _ = _fp8(rng, (d, *in_shape), in_axes)
  w8, s = jnp.asarray(w8), jnp.asarray(s)
  residual = jnp.asarray(rng.standard_normal((b, t, d)), jnp.bfloat16)
  norm = RMSNorm(d, 1e-6, jnp.bfloat16)
  norm.scale[...] = jnp.asarray(rng.standard_normal(d), jnp.bfloat16)
  norm.row_kernel = sharded_rms_norm(mesh, ShardingRules(), 1e-6, False, True)
  deferred = fp8.row(x, w8, s, in_axes=in_axes, defer=True)
  assert isinstance(deferred, PartialSum) and deferred.shape == (b, t, d)
  assert deferred.partials_ABTD.shape == (2, b, t, d)
  h, normed = norm.add_and_norm(residual, deferred)
  assert calls == [(b * t, d)]  # one fused call, no all-reduce before it
  summed = fp8.row(x, w8, s, in_axes=in_axes)
  want_h, want_normed = norm.add_and_norm(residual, summed)
  for got, want in ((h, want_h), (normed, want_normed), (deferred.reduced(), summed),
                    (residual + deferred, residual + summed)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # A norm that writes e4m3 rows for an FP8 product sums it first and keeps its own kernel.
  calls.clear()
  got_q, want_q = (norm.add_and_norm(residual, delta, quantize=True)
                   for delta in (deferred, summed))
  assert calls == []
  for got, want in zip(jax.tree.leaves(got_q), jax.tree.leaves(want_q)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.usefixtures("interpreted_on_every_device", "fresh_traces")
@pytest.mark.parametrize("family, fused_per_program", [("qwen3", 4), ("deepseek_v3", 3)])
def test_a_tiny_fp8_model_at_tp_2_sums_its_row_products_in_the_norms(monkeypatch, family,
                                                                     fused_per_program):
  """With the workspace kernel on (stand-ins), each FP8 row product that a residual add and norm
  read next reaches that norm as a PartialSum, summed there (Qwen3: o_proj and down_proj of
  both layers; DeepSeek-V3: both layers' o_proj and the dense layer's down_proj, the MoE
  layer's experts summed as they were): greedy tokens equal one device's."""
  config, _ = TINY_FP8[family]
  kwargs = dict(dtype="float32", seed=4, max_model_len=64, max_num_seqs=2,
                projection_backend="pallas", norm_backend="pallas")
  prompts = [[5, 17, 42, 8, 99, 3], [7, 7, 300, 12]]
  params = jspec.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
  one = jspec.LLM.from_random(config, **kwargs).generate(prompts, params, use_tqdm=False)
  llm = jspec.LLM.from_random(config, mesh=jspec.MeshConfig(tp=2), all_reduce_backend="xla",
                              **kwargs)
  calls = []
  _stand_ins(monkeypatch, calls)
  workspace = wsar.PeerWorkspace(llm.mesh, "tp")
  fp8_nodes = [n.fp8_tp for _, n in nnx.iter_graph(llm.target)
               if getattr(n, "fp8_tp", None) is not None]
  assert fp8_nodes
  for node in fp8_nodes:
    node.products._workspace = workspace
  got = llm.generate(prompts, params, use_tqdm=False)
  assert [o.token_ids for o in got] == [o.token_ids for o in one]
  # each traced program's calls share its rows: fused_per_program of each shape per program
  by_shape = collections.Counter(calls)
  assert by_shape and all(n % fused_per_program == 0 for n in by_shape.values()), by_shape
