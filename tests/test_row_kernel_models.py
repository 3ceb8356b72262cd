"""Whole models through the row kernels (LLM(norm_backend), jspec.models.row_kernels): which
steps take the residual add + RMSNorm and the q / k norm + RoPE kernels, and their tokens
against XLA's path, on one device and on meshes. The kernels run in interpret mode here; their
own checks against the published formulas are tests/test_row_norms.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jspec
from jspec.models import layers, row_kernels
from jspec.models.caches import KVCache
from jspec.models.moe import MoE
from jspec.models.tree_attention import TreeLayout, tree_layout
from jspec.pallas_kernels import fp8_gemm, platform
from tests.helpers import fixture_dir, greedy_token_ids

PROMPTS = [[5, 9, 2, 7, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 9, 1, 0]]


def _llm(name, backend, **kwargs):
  return jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=128, max_num_seqs=4,
                   norm_backend=backend, **kwargs)


def test_backend_resolves_and_refuses():
  llm = _llm("qwen3_dense", "auto")
  assert llm.norm_backend == ("pallas" if platform.on_gpu() else "xla")
  with pytest.raises(ValueError, match="norm_backend='cuda'"):
    _llm("qwen3_dense", "cuda")


def test_the_steps_run_the_kernels_where_the_backend_sets_them():
  llm, plain = _llm("qwen3_dense", "pallas"), _llm("qwen3_dense", "xla")
  layer, plain_layer = llm.target.layers[0], plain.target.layers[0]
  assert layer.attn.qk_kernel is not None and layer.post_attn_norm.row_kernel is not None
  assert layer.attn.kv_write is not None and llm.target.final_norm.row_kernel is not None
  assert layer.attn.fused_qkv and layer.attn.qkv_kernel is not None
  assert plain_layer.attn.qk_kernel is None and plain_layer.post_attn_norm.row_kernel is None
  assert plain_layer.attn.qkv_kernel is None
  assert plain_layer.attn.kv_write is None
  assert layer.attn.q_norm.row_kernel is None  # q / k norms run inside qk_norm_rope
  d = llm.config.hidden_size
  x = jnp.ones((2, 3, d), jnp.float32)
  step = str(jax.make_jaxpr(lambda x: layer.post_attn_norm.add_and_norm(x, x))(x))
  assert "add_rms_norm" in step
  prefill = jnp.ones((2, 200, d), jnp.float32)  # more rows than MAX_ROWS: XLA's fusions
  assert "rms_norm" not in str(jax.make_jaxpr(layer.post_attn_norm)(prefill))
  # The fused q / k / v product's q and k go to qkv_norm_rope whole, not sliced first.
  positions = jnp.zeros((2, 3), jnp.int32)
  project = str(jax.make_jaxpr(layer.attn._project_rotated)(x, positions))
  assert "qkv_norm_rope" in project and "qk_norm_rope" not in project.replace("qkv_norm", "")


def test_the_q_k_v_kernel_writes_the_cache_where_nothing_reads_k_and_v_apart(monkeypatch):
  """A decode or verify step's keys and values go into the cache from the q / k / v kernel
  (no KV write kernel), a one-row step on one device too; with layers.FUSED_KV_WRITE off,
  and in a token tree's step (its own slots), the KV write kernel writes them. A single
  sequence's greedy tokens (one-row steps) equal XLA's path's; the tests below check the
  others (vanilla, MTP, meshes, K slices)."""
  llm = _llm("qwen3_dense", "pallas")
  attn = llm.target.layers[0].attn
  b, t = 2, 3
  x = jnp.ones((b, t, attn.qkv_proj.shape[0]), jnp.float32)
  zeros = jnp.zeros((b, attn.num_kv_heads, 64, attn.head_dim), jnp.float32)
  cache = KVCache(zeros, zeros)
  # a new function each time: make_jaxpr keeps a function's trace
  trace = lambda: str(jax.make_jaxpr(lambda x, c: attn(x, jnp.zeros((b, t), jnp.int32), c,
                                                       64))(x, cache))
  fused = trace()
  assert "qkv_norm_rope" in fused and "write_kv" not in fused
  chain = TreeLayout((0, 1, 2), ((True, False, False), (True, True, False), (True,) * 3))
  with tree_layout(chain):  # a tree's window of t tokens
    assert "write_kv" in trace()
  one_row = jnp.ones((1, 1, x.shape[-1]), jnp.float32)
  ones = KVCache(zeros[:1], zeros[:1])
  one_step = str(jax.make_jaxpr(
      lambda x, c: attn(x, jnp.zeros((1, 1), jnp.int32), c, 64))(one_row, ones))
  assert "qkv_norm_rope" in one_step and "write_kv" not in one_step
  assert (greedy_token_ids(llm, PROMPTS[:1], 6)
          == greedy_token_ids(_llm("qwen3_dense", "xla"), PROMPTS[:1], 6))
  monkeypatch.setattr(layers, "FUSED_KV_WRITE", False)
  assert "write_kv" in trace()


@pytest.mark.parametrize("name", ["qwen3_dense", "qwen3_5_text", "qwen3_moe"])
def test_greedy_tokens_through_the_kernels_equal_xla(name):
  """Vanilla and MTP decoding through the kernels give XLA's path's tokens (float32: the two
  differ only in the order of float32 sums). Qwen3.5 has (1 + w) norms and partial RoPE, so
  its attention keeps XLA's q / k path and its norms take the kernel's zero-centred form.
  Qwen3-MoE's layers route their step's tokens through the router kernels."""
  want = greedy_token_ids(_llm(name, "xla"), PROMPTS, 6)
  kernels = _llm(name, "pallas")
  moe_layers = [n for _, n in nnx.iter_graph(kernels.target) if isinstance(n, MoE)]
  assert all(n.router_kernel is not None for n in moe_layers)
  assert bool(moe_layers) == (name == "qwen3_moe")
  assert greedy_token_ids(kernels, PROMPTS, 6) == want
  spec = _llm(name, "pallas", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
  assert greedy_token_ids(spec, PROMPTS, 6) == want


@pytest.mark.parametrize("tp", [4, 2])
def test_greedy_tokens_through_the_kernels_on_a_mesh_equal_one_device(tp):
  """dp = 2 splits the rows, tp the query heads. At tp = 4 the fixture's 2 KV heads are
  computed whole on every tp shard (kv_replicas = 2: q, k and v apart), so the keys enter the
  kernel unsplit; at tp = 2 each shard holds one KV head's fused q / k / v product."""
  want = greedy_token_ids(_llm("qwen3_dense", "xla"), PROMPTS, 5)
  meshed = _llm("qwen3_dense", "pallas", mesh=jspec.MeshConfig(dp=2, tp=tp))
  attn = meshed.target.layers[0].attn
  assert attn.qk_kernel is not None and attn.kv_write is not None
  assert attn.kv_replicas == tp // 2 and (attn.qkv_kernel is not None) == (tp == 2)
  assert greedy_token_ids(meshed, PROMPTS, 5) == want


@pytest.mark.parametrize("mesh", [None, jspec.MeshConfig(dp=2, tp=2)])
def test_fused_product_as_k_slices_partials_gives_xla_tokens(monkeypatch, mesh):
  """With K slices on (as on a GPU; the fixture's 64-wide hidden size cut into 4 slices of
  16), a decode or verify step's fused q / k / v product is 4 slices' float32 partials that
  the q / k kernel sums (one row too on one device); more rows a shard, or one row a tp
  shard, keep one product.
  Vanilla and MTP tokens equal XLA's path's (float32: only the order of the sums differs), on
  one device and at dp = 2 x tp = 2 (one KV head's product a shard)."""
  monkeypatch.setattr(row_kernels, "qkv_k_slices", lambda: 4)
  monkeypatch.setattr(row_kernels, "QKV_SLICE_K", 16)
  xla = _llm("qwen3_dense", "xla")
  want = greedy_token_ids(xla, PROMPTS, 6)
  llm = _llm("qwen3_dense", "pallas", mesh=mesh)
  attn = llm.target.layers[0].attn
  x = jnp.ones((2, 3, llm.config.hidden_size), jnp.float32)
  trace = lambda x: str(jax.make_jaxpr(attn._project_rotated)(x, jnp.zeros(x.shape[:2],
                                                                           jnp.int32)))
  assert "qkv_partials_norm_rope" in trace(x)
  many = jnp.ones((4, row_kernels.QKV_SLICE_ROWS, x.shape[-1]), jnp.float32)
  assert "qkv_partials_norm_rope" not in trace(many) and "qkv_norm_rope" in trace(many)
  # One row a shard: slices on one device, whose heads are whole; at tp = 2 (KV heads split)
  # the one-row product stays.
  one = jnp.ones((1 if mesh is None else 2, 1, x.shape[-1]), jnp.float32)
  if mesh is None:
    assert "qkv_partials_norm_rope" in trace(one)
    assert greedy_token_ids(llm, PROMPTS[:1], 6) == greedy_token_ids(xla, PROMPTS[:1], 6)
  else:
    assert "qkv_partials_norm_rope" not in trace(one) and "qkv_norm_rope" in trace(one)
  assert greedy_token_ids(llm, PROMPTS, 6) == want
  spec = _llm("qwen3_dense", "pallas", mesh=mesh,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
  assert greedy_token_ids(spec, PROMPTS, 6) == want


def test_one_row_a_shard_takes_the_k_slices_where_the_mesh_splits_no_kv_heads(monkeypatch):
  """dp = 2 (KV heads whole on every shard): a one-row-a-shard step's fused q / k / v product
  is K slices' partials, as on one device (QKV_SLICE_ONE_ROW_WHOLE_HEADS); switched off, it
  keeps its product."""
  monkeypatch.setattr(row_kernels, "qkv_k_slices", lambda: 4)
  monkeypatch.setattr(row_kernels, "QKV_SLICE_K", 16)
  for whole_heads, kernel in [(True, "qkv_partials_norm_rope"), (False, "qkv_norm_rope")]:
    monkeypatch.setattr(row_kernels, "QKV_SLICE_ONE_ROW_WHOLE_HEADS", whole_heads)
    llm = _llm("qwen3_dense", "pallas", mesh=jspec.MeshConfig(dp=2))
    attn = llm.target.layers[0].attn
    one = jnp.ones((2, 1, llm.config.hidden_size), jnp.float32)
    traced = str(jax.make_jaxpr(attn._project_rotated)(one, jnp.zeros((2, 1), jnp.int32)))
    assert kernel in traced and (whole_heads or "qkv_partials_norm_rope" not in traced)


def test_router_kernels_on_a_mesh_route_each_shards_tokens():
  """dp = 2 x ep = 2 x tp = 2: each batch shard routes its own tokens through the router
  kernels, the router whole on every shard; the tokens are one device's."""
  want = greedy_token_ids(_llm("qwen3_moe", "xla"), PROMPTS, 5)
  meshed = _llm("qwen3_moe", "pallas", mesh=jspec.MeshConfig(dp=2, tp=2, ep=2))
  assert all(n.router_kernel is not None
             for _, n in nnx.iter_graph(meshed.target) if isinstance(n, MoE))
  assert greedy_token_ids(meshed, PROMPTS, 5) == want


def test_fp8_attention_keeps_xla_for_few_rows_of_q_and_k(monkeypatch):
  """Where q and k of few rows come from one FP8 kernel call (the Hopper configuration,
  interpreted here) q / k and the cache writes keep XLA's fusions, into which that call's
  K-slice sum goes (the kernels measured no faster there). Steps of more rows than that kernel
  takes (prefill chunks, long verify windows) go to the q / k kernel as unquantized layers'
  do, with XLA's values; the hidden-size norms take the kernel."""
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)
    llm = _llm("qwen3_dense_fp8", "pallas")
  layer, cfg = llm.target.layers[0], llm.config
  attn = layer.attn
  assert attn.fp8_projection is not None and attn.qk_kernel_above == fp8_gemm.MAX_ROWS
  assert attn.kv_write is None and layer.post_attn_norm.row_kernel is not None
  rng = np.random.default_rng(7)

  def norm_and_rope(rows: int):
    q = jnp.asarray(rng.standard_normal((1, rows, cfg.num_heads, cfg.head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, rows, cfg.num_kv_heads, cfg.head_dim)),
                    jnp.float32)
    positions = jnp.asarray(rng.permutation(4 * rows)[:rows][None], jnp.int32)
    traced = str(jax.make_jaxpr(attn._norm_and_rope)(q, k, positions))
    return "qk_norm_rope" in traced, attn._norm_and_rope(q, k, positions), (q, k, positions)

  for rows in (1, fp8_gemm.MAX_ROWS, fp8_gemm.MAX_ROWS + 1, row_kernels.MAX_ROWS,
               row_kernels.MAX_ROWS + 1):
    took_kernel, got, args = norm_and_rope(rows)
    assert took_kernel == (fp8_gemm.MAX_ROWS < rows <= row_kernels.MAX_ROWS), rows
    kernel, attn.qk_kernel = attn.qk_kernel, None
    want = attn._norm_and_rope(*args)  # XLA's fusions
    attn.qk_kernel = kernel
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
  off_hopper = _llm("qwen3_dense_fp8", "pallas").target.layers[0].attn
  assert off_hopper.qk_kernel is not None and off_hopper.kv_write is not None
  assert off_hopper.qk_kernel_above == 0
