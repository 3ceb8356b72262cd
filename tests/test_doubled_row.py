"""A batch-1 tp step's one row taken by o_proj's K-slice partials as two equal rows, written
twice by the short-context attention kernel instead of concatenated after it
(Attention._doubles_row): the kernel's copies, their layout per shard, the partials and row
products they give, and which layers ask for them. Interpret mode here; on GPUs (`gpu`
marker) the compiled kernel's copies and a tp = 2 model's tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.bench.presets import PRESETS
from jspec.models import layers as layers_module
from jspec.models.decode_attention import sharded_short_attention
from jspec.pallas_kernels import short_attention as short_lib
from jspec.sharding import tensor_parallel
from jspec.sharding.rules import ShardingRules
from tests.helpers import fixture_dir

RUN_SEED = 20261130

# (batch, tokens, kv heads, group, slots, head_dim, copies)
ATTENTION_CASES = [(1, 1, 4, 2, 64, 32, 2), (1, 1, 2, 4, 128, 64, 3), (3, 2, 2, 2, 64, 32, 2),
                   (2, 1, 1, 8, 32, 16, 2), (1, 3, 4, 1, 48, 32, 2), (4, 1, 2, 2, 64, 16, 1)]


@pytest.mark.parametrize("seed", range(len(ATTENTION_CASES)))
def test_the_attention_kernel_writes_its_output_copies_times(seed):
  """Output rows c x B + b are row b's output, bit for bit, for every copy c."""
  b, t, kv_heads, group, slots, h, copies = ATTENTION_CASES[seed]
  rng = np.random.default_rng(RUN_SEED + seed)
  q = jnp.asarray(rng.standard_normal((b, kv_heads * t * group, h)), jnp.float32)
  keys, values = (jnp.asarray(rng.standard_normal((b, kv_heads, slots, h)), jnp.float32)
                  for _ in range(2))
  start = jnp.asarray(rng.integers(0, slots - t + 1, b), jnp.int32)
  once = short_lib.short_attention(q, keys, values, start, group=group, scale=h ** -0.5,
                                   interpret=True)
  twice = short_lib.short_attention(q, keys, values, start, group=group, scale=h ** -0.5,
                                    copies=copies, interpret=True)
  assert twice.shape == (copies * b, *q.shape[1:])
  for c in range(copies):
    np.testing.assert_array_equal(np.asarray(twice[c * b:(c + 1) * b]), np.asarray(once))
  with pytest.raises(ValueError, match="copies"):
    short_lib.short_attention(q, keys, values, start, group=group, scale=1.0, copies=0,
                              interpret=True)


def test_the_sharded_kernel_lays_the_copies_out_along_the_tokens(monkeypatch):
  """sharded_short_attention(copies=2) over tp = 2 heads: [B, 2 T, N, H], tokens T .. 2 T - 1
  the copy of tokens 0 .. T - 1, each equal to the one-copy call's, with q and the output
  token by token through the kernel (decode_attention.TOKEN_MAJOR) or regrouped around it,
  both giving the same outputs."""
  from jspec.models import decode_attention
  mesh = jspec.MeshConfig(tp=2).make_mesh()
  rng = np.random.default_rng(RUN_SEED + 20)
  for b, t in ((1, 1), (2, 3)):
    q = jnp.asarray(rng.standard_normal((b, t, 8, 16)), jnp.float32)
    keys, values = (jnp.asarray(rng.standard_normal((b, 4, 32, 16)), jnp.float32)
                    for _ in range(2))
    start = jnp.asarray(rng.integers(0, 32 - t + 1, b), jnp.int32)
    outs = []
    for token_major in (True, False):
      monkeypatch.setattr(decode_attention, "TOKEN_MAJOR", token_major)
      call = sharded_short_attention(mesh, ShardingRules(), interpret=True)
      once = np.asarray(call(q, keys, values, start))
      twice = np.asarray(call(q, keys, values, start, copies=2))
      assert once.shape == (b, t, 8, 16) and twice.shape == (b, 2 * t, 8, 16)
      np.testing.assert_array_equal(twice[:, :t], once)
      np.testing.assert_array_equal(twice[:, t:], once)
      outs.append(once)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_k_slice_partials_of_the_two_rows_are_those_of_the_one_row():
  """The partials of [1, 2, K] (the row and its copy) are bit for bit those of [1, 1, K],
  which k_slice_partials doubles itself."""
  rng = np.random.default_rng(RUN_SEED + 30)
  x = jnp.asarray(rng.standard_normal((1, 1, 512)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((512, 96)), jnp.float32)
  one = tensor_parallel._k_slice_partials(x, w, 4)
  two = tensor_parallel._k_slice_partials(jnp.concatenate([x, x], axis=1), w, 4)
  assert one.shape == two.shape == (4, 1, 2, 96)
  np.testing.assert_array_equal(np.asarray(two), np.asarray(one))


@pytest.mark.parametrize("rows_last", [False, True])
def test_one_row_goes_twice_as_a_broadcast_and_its_partials_are_its_own(rows_last):
  """k_slice_partials of one row: each slice's partial, for both copies, is that slice's
  product of the row alone (float32 NumPy, random shapes); the copy is a broadcast in the
  lowered program (which XLA's GEMM fusion reads in place on GPUs), no concatenate (a
  kernel of its own there)."""
  rng = np.random.default_rng(RUN_SEED + 35 + rows_last)
  for slices, k, n in ((4, 512, 96), (2, 256, 40), (8, 1024, 16)):
    x = rng.standard_normal((1, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    got = np.asarray(tensor_parallel.k_slice_partials(jnp.asarray(x), jnp.asarray(w), slices,
                                                      rows_last=rows_last))
    step = k // slices
    want_SN = np.stack([x[0, s * step:(s + 1) * step] @ w[s * step:(s + 1) * step]
                        for s in range(slices)])
    assert got.shape == ((slices, n, 2) if rows_last else (slices, 2, n))
    for copy in range(2):
      np.testing.assert_allclose(got[..., copy] if rows_last else got[:, copy], want_SN,
                                 rtol=1e-5, atol=1e-4)
  text = jax.jit(tensor_parallel.k_slice_partials, static_argnums=(2, 3)).lower(
      jnp.zeros((1, 512)), jnp.zeros((512, 96)), 4, rows_last).as_text()
  assert "broadcast_in_dim" in text and "concatenate" not in text


def test_a_row_product_of_a_doubled_row_is_the_one_rows():
  """tp = 2 without the workspace kernel (psum: no K-slice partials): row(..., tokens=1) of the
  two rows multiplies the first, as the one row; a doubled row of more than one token or
  sequence is refused."""
  mesh = jspec.MeshConfig(tp=2).make_mesh()
  products = tensor_parallel.tensor_parallel_products(mesh, ShardingRules(),
                                                      custom_all_reduce=False)
  assert not products.takes_doubled_row(512)
  rng = np.random.default_rng(RUN_SEED + 40)
  heads = jnp.asarray(rng.standard_normal((1, 1, 8, 64)), jnp.float32)
  w_o = jnp.asarray(rng.standard_normal((8, 64, 32)), jnp.float32)
  want = products.row(heads, w_o, in_axes=2, defer=True)
  got = products.row(jnp.concatenate([heads, heads], axis=1), w_o, in_axes=2, defer=True,
                     tokens=1)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="doubled row"):
    products.row(jnp.zeros((2, 2, 8, 64)), w_o, in_axes=2, defer=True, tokens=1)


class _Products:
  def __init__(self, takes: bool):
    self.takes, self.asked = takes, []

  def takes_doubled_row(self, k):
    self.asked.append(k)
    return self.takes


def test_only_a_one_row_tp_step_with_the_short_kernel_and_k_slices_doubles():
  """Attention._doubles_row: one row, the short-context kernel set, tp products whose o_proj
  makes K-slice partials (asked with o_proj's K), an unquantized o_proj without a bias."""
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                  max_num_seqs=1, attention_backend="xla")
  layer = llm.target.layers[0].attn
  n, h, _ = layer.o_proj.shape
  one_row = jnp.zeros((1, 1, n, h), jnp.float32)
  assert layer.short_attention is None and layer.tp_products is None
  assert not layer._doubles_row(one_row)
  layer.short_attention = lambda *a, **k: None  # as "auto" on Hopper sets it
  assert not layer._doubles_row(one_row)  # one GPU: no tp products
  layer.tp_products = _Products(True)
  assert layer._doubles_row(one_row) and layer.tp_products.asked == [n * h]
  assert not layer._doubles_row(jnp.zeros((2, 1, n, h), jnp.float32))
  assert not layer._doubles_row(jnp.zeros((1, 2, n, h), jnp.float32))
  layers_module.DOUBLED_ROW = False
  try:
    assert not layer._doubles_row(one_row)
  finally:
    layers_module.DOUBLED_ROW = True
  layer.tp_products = _Products(False)
  assert not layer._doubles_row(one_row)


@pytest.mark.gpu
def test_gpu_the_compiled_kernel_writes_its_copies():
  """Qwen3-30B-A3B's heads (32 query heads over 4 KV heads of 128), bf16, a 640-slot cache:
  both copies of the compiled kernel's output equal its one-copy output."""
  assert jax.devices()[0].platform == "gpu"
  rng = np.random.default_rng(RUN_SEED)
  q = jnp.asarray(rng.standard_normal((1, 32, 128)), jnp.bfloat16)
  keys, values = (jnp.asarray(rng.standard_normal((1, 4, 640, 128)), jnp.bfloat16)
                  for _ in range(2))
  start = jnp.asarray([517], jnp.int32)
  once = short_lib.short_attention(q, keys, values, start, group=8, scale=128 ** -0.5)
  twice = short_lib.short_attention(q, keys, values, start, group=8, scale=128 ** -0.5,
                                    copies=2)
  for c in range(2):
    np.testing.assert_array_equal(np.asarray(twice[c:c + 1], np.float32),
                                  np.asarray(once, np.float32))


@pytest.mark.gpu
def test_gpu_tp2_k_slices_take_the_doubled_row(monkeypatch):
  """tp = 2 on 2 GPUs with the workspace kernel, batch 1, two layers in Qwen3-8B's shapes
  (random weights): o_proj's K-slice partials take the attention kernel's two rows (no
  concatenate), with the tokens of the concatenated row."""
  if len([d for d in jax.devices() if d.platform == "gpu"]) < 2:
    pytest.skip("needs 2 GPUs")
  copies = []
  kernel = short_lib.short_attention
  monkeypatch.setattr(short_lib, "short_attention",
                      lambda *a, **k: (copies.append(k.get("copies", 1)), kernel(*a, **k))[1])
  config = dataclasses.replace(PRESETS["qwen3-8b"], num_layers=2)
  llm = jspec.LLM.from_random(config, None, max_model_len=256, max_num_seqs=1,
                              mesh=jspec.MeshConfig(tp=2))
  prompt = np.random.default_rng(RUN_SEED).integers(0, config.vocab_size, 40).tolist()
  params = jspec.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
  want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
  assert 2 in copies, "no tp step's attention wrote its row twice"
  copies.clear()
  with monkeypatch.context() as patch:
    patch.setattr(layers_module, "DOUBLED_ROW", False)
    llm = jspec.LLM.from_random(config, None, max_model_len=256, max_num_seqs=1,
                                mesh=jspec.MeshConfig(tp=2))
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
  assert 2 not in copies
  assert got == want
