"""A norm's output quantized to e4m3 by the norm's own kernel for the FP8 products after it
(backends.FP8_E4M3_ROWS): residual_norm's `quantize` forms (add_partials_rms_norm's and
rms_norm's), the few-row FP8 kernel taking those rows and their scales as they are (fp8_gemm's
act_lanes_X), and a model whose q / k / v and gate / up read them (a MoE model's:
test_moe_e4m3), against the same products with the activations quantized by XLA
(fp8_gemm.quantize_activations, the e4m3 route's own pass)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import backends
from jspec.models.linear import E4m3Rows
from jspec.pallas_kernels import decode_routing, fp8_gemm, platform
from jspec.pallas_kernels.residual_norm import add_partials_rms_norm, rms_norm

EPS = 1e-6


def _f32(a):
  return np.asarray(a, np.float32)


@pytest.mark.parametrize("seed", range(8))
def test_the_norm_kernel_quantizes_its_output_as_quantize_activations(seed):
  """quantize=True: the same h and norm(h) as without, bit for bit, and norm(h) in e4m3 with
  its scales laid out in the FP8 kernel's lanes exactly as fp8_gemm.quantize_activations and
  act_lanes give them for the unquantized output (zeros in the lanes past the rows)."""
  rng = np.random.default_rng(1700 + seed)
  rows = int(rng.choice([1, 2, 3, 5, 8, 12, 16, 33]))
  width = 128 * int(rng.choice([1, 2, 3, 8, 32]))
  splits = int(rng.choice([1, 2, 4, 8]))
  dtype = [jnp.float32, jnp.bfloat16][seed % 2]
  zero_centered = seed % 4 >= 2
  # Rows of very different sizes: each group's scale must be its own.
  parts = rng.standard_normal((splits, decode_routing.padded_tokens(rows), width))
  parts *= 2.0 ** rng.integers(-6, 6, (1, parts.shape[1], 1))
  parts = jnp.asarray(parts, jnp.float32)
  x = jnp.asarray(rng.standard_normal((rows, width)), dtype)
  scale = jnp.asarray(1 + 0.3 * rng.standard_normal(width), dtype)
  call = functools.partial(add_partials_rms_norm, x, parts, scale, dtype=dtype, eps=EPS,
                           zero_centered=zero_centered)
  h, normed, x8, lanes = call(quantize=True)
  want_h, want = call()
  np.testing.assert_array_equal(_f32(h), _f32(want_h))
  np.testing.assert_array_equal(_f32(normed), _f32(want))
  check_quantized(want, x8, lanes, rows, width)


def check_quantized(normed, x8, lanes, rows, width):
  """x8 and lanes are quantize_activations' and act_lanes' of `normed`, lanes past the rows 0."""
  want_x8, want_scale = fp8_gemm.quantize_activations(normed)
  assert x8.dtype == jnp.float8_e4m3fn and x8.shape == (rows, width)
  np.testing.assert_array_equal(_f32(x8), _f32(want_x8))
  np.testing.assert_array_equal(np.asarray(lanes), np.asarray(fp8_gemm.act_lanes(want_scale)))
  lanes_GL = np.asarray(lanes).reshape(width // 128, -1)
  assert lanes_GL.shape[1] >= max(rows, fp8_gemm.SCALE_LANES)
  assert np.all(lanes_GL[:, rows:] == 0) and np.all(lanes_GL[:, :rows] > 0)


@pytest.mark.parametrize("seed", range(8))
def test_the_plain_norm_kernel_quantizes_its_output_as_quantize_activations(seed):
  """rms_norm(quantize=True), with a residual (a MoE layer's output before the next layer's
  q / k / v) and without (a first layer's input): h and norm(h) bit for bit as without
  `quantize`, norm(h)'s e4m3 form and lanes those quantize_activations and act_lanes give,
  over widths of 1 to 56 groups (rows cut into 1 to 7 pieces)."""
  rng = np.random.default_rng(1900 + seed)
  rows = int(rng.choice([1, 2, 3, 5, 8, 16, 33, 64]))
  width = 128 * int(rng.choice([1, 3, 4, 8, 16, 56]))
  dtype = [jnp.float32, jnp.bfloat16][seed % 2]
  zero_centered = seed % 4 >= 2
  x = jnp.asarray(rng.standard_normal((rows, width))
                  * 2.0 ** rng.integers(-6, 6, (rows, 1)), dtype)
  residual = jnp.asarray(rng.standard_normal((rows, width)), dtype)
  scale = jnp.asarray(1 + 0.3 * rng.standard_normal(width), dtype)
  for res in (residual, None):
    call = functools.partial(rms_norm, x, scale, res, eps=EPS, zero_centered=zero_centered)
    got, want = call(quantize=True), call()
    want = (want,) if res is None else want
    *plain, x8, lanes = got
    for a, b in zip(plain, want, strict=True):
      np.testing.assert_array_equal(_f32(a), _f32(b))
    check_quantized(want[-1], x8, lanes, rows, width)


def test_the_quantize_form_refuses_what_it_cannot_lay_out():
  call = functools.partial(add_partials_rms_norm, dtype=jnp.float32, eps=EPS, quantize=True)
  with pytest.raises(ValueError, match="whole 128-groups"):
    call(jnp.ones((2, 192)), jnp.ones((1, 8, 192)), jnp.ones(192))  # 192: 1.5 groups
  with pytest.raises(ValueError, match="up to 64 rows"):
    call(jnp.ones((65, 128)), jnp.ones((1, 65, 128)), jnp.ones(128))
  with pytest.raises(ValueError, match="whole 128-groups"):
    rms_norm(jnp.ones((2, 192)), jnp.ones(192), eps=EPS, quantize=True)
  with pytest.raises(ValueError, match="up to 64 rows"):
    rms_norm(jnp.ones((65, 128)), jnp.ones(128), jnp.ones((65, 128)), eps=EPS, quantize=True)


def _fp8_weights(rng, k, ns):
  weights = tuple(jnp.asarray(rng.standard_normal((n, k)), jnp.float8_e4m3fn) for n in ns)
  scales = tuple(jnp.asarray(2.0 ** rng.integers(-3, 3, (n // 128, k // 128)), jnp.float32)
                 for n in ns)
  return weights, scales


@pytest.mark.parametrize("seed", range(4))
def test_the_fp8_kernel_takes_quantized_rows_as_they_are(seed):
  """fp8_partials_many and fp8_matmul given e4m3 rows and their lanes (act_lanes_X): the
  products of the e4m3 route that quantizes x itself, bit for bit (rows last and first,
  several weights in one call, balanced runs where they are chosen)."""
  rng = np.random.default_rng(1800 + seed)
  rows = int(rng.choice([1, 3, 8, 12]))
  k = 128 * int(rng.choice([2, 4]))
  ns = [128 * int(rng.integers(1, 3)) for _ in range(1 + seed % 2)]
  weights, scales = _fp8_weights(rng, k, ns)
  x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
  x8, x_scale = fp8_gemm.quantize_activations(x)
  lanes = fp8_gemm.act_lanes(x_scale)
  for rows_first in (False, True):
    want, _ = fp8_gemm.fp8_partials_many(x, weights, scales, activations="e4m3",
                                         rows_first=rows_first)
    got, row_scale = fp8_gemm.fp8_partials_many(x8, weights, scales, rows_first=rows_first,
                                                act_lanes_X=lanes)
    assert row_scale is None
    real = (slice(None), slice(0, rows)) if rows_first else (..., slice(0, rows))
    np.testing.assert_array_equal(np.asarray(got)[real], np.asarray(want)[real])
  want = fp8_gemm.fp8_matmul(x, weights[0], scales[0], activations="e4m3")
  got = fp8_gemm.fp8_matmul(x8, weights[0], scales[0], act_lanes_X=lanes, out_dtype=x.dtype)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_fp8_kernel_refuses_e4m3_rows_without_their_scales():
  rng = np.random.default_rng(0)
  weights, scales = _fp8_weights(rng, 256, [128])
  x8, x_scale = fp8_gemm.quantize_activations(jnp.ones((2, 256)))
  lanes = fp8_gemm.act_lanes(x_scale)
  with pytest.raises(ValueError, match="e4m3 x with its act_lanes_X"):
    fp8_gemm.fp8_partials_many(x8, weights, scales)
  with pytest.raises(ValueError, match="e4m3 x with its act_lanes_X"):
    fp8_gemm.fp8_partials_many(jnp.ones((2, 256)), weights, scales, act_lanes_X=lanes)
  with pytest.raises(ValueError, match=r"act_lanes_X has shape \(32,\)"):
    fp8_gemm.fp8_partials_many(x8, weights, scales, act_lanes_X=lanes[:32])
  with pytest.raises(ValueError, match="not 'bfloat16'"):
    fp8_gemm.fp8_partials_many(x8, weights, scales, activations="bfloat16", act_lanes_X=lanes)
  with pytest.raises(ValueError, match="names its out_dtype"):
    fp8_gemm.fp8_matmul(x8, weights[0], scales[0], act_lanes_X=lanes)


def _qwen3(monkeypatch, e4m3_rows: bool, activations=None, mesh=None):
  """The tiny FP8 Qwen3 of test_fp8_gpu_configuration as a Hopper GPU runs it (interpreted),
  the norm's e4m3 rows on or off, and the few-row kernel's route for the activations of the
  calls that name none (fp8_gemm.DEFAULT_ACTIVATIONS) set while it is traced."""
  from tests.test_fp8_gpu_configuration import _qwen3_llm
  monkeypatch.setattr(fp8_gemm, "DEFAULT_ACTIVATIONS", activations)
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)
    patch.setattr(backends, "FP8_E4M3_ROWS", e4m3_rows)
    return _qwen3_llm(norm_backend="pallas", mesh=mesh or jspec.MeshConfig())


def _same_logits_and_tokens(reference, candidate):
  from tests.test_fp8_gpu_configuration import PROMPTS
  np.testing.assert_array_equal(candidate.compute_logits(PROMPTS[:1])[0],
                                reference.compute_logits(PROMPTS[:1])[0])
  params = jspec.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
  tokens = [[o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            for llm in (reference, candidate)]  # decode and the n-gram verify windows
  assert tokens[0] == tokens[1]


@pytest.mark.usefixtures("fresh_traces")
def test_q_k_v_and_gate_up_read_the_norms_e4m3_rows(monkeypatch):
  """With the setting on, every layer's gate / up and q / k / v (the first layer's from its
  input norm's plain form, which sums no FP8 product) take the e4m3 rows their norm's kernel
  wrote, and down_proj those of the SwiGLU kernel (FP8_E4M3_SWIGLU), with no quantizing pass
  of XLA's; the logits and greedy tokens (decode and n-gram verify) equal those of the same
  model with those activations quantized by XLA (the kernel's own e4m3 route for every
  product), bit for bit."""
  calls = []
  partials_many, matmul = fp8_gemm.fp8_partials_many, fp8_gemm.fp8_matmul

  def spy(fn):
    def call(x, *args, act_lanes_X=None, **kwargs):
      calls.append((fn.__name__, x.shape[-1], act_lanes_X is not None, x.dtype))
      return fn(x, *args, act_lanes_X=act_lanes_X, **kwargs)
    return call

  monkeypatch.setattr(fp8_gemm, "fp8_partials_many", spy(partials_many))
  monkeypatch.setattr(fp8_gemm, "fp8_matmul", spy(matmul))
  rows = _qwen3(monkeypatch, e4m3_rows=True, activations="e4m3")
  layers = rows.target.layers
  assert all(layer.mlp.fp8_e4m3_rows and layer.attn.fp8_e4m3_rows for layer in layers)

  def quantized_by_xla(x):
    raise AssertionError("a quantizing pass of XLA's ran for an FP8 product of e4m3 rows")

  x = jnp.ones((2, 1, layers[0].attn.o_proj.shape[2]), jnp.float32)
  normed = layers[1].input_norm.add_and_norm(x, layers[0].mlp(x, sum_later=True),
                                             quantize=True)[1]
  assert isinstance(normed, E4m3Rows)
  with monkeypatch.context() as patch:
    patch.setattr(fp8_gemm, "quantize_activations", quantized_by_xla)
    calls.clear()
    jax.eval_shape(lambda: layers[0].mlp._activation(normed, None))
    assert calls[0][2] and calls[0][3] == jnp.float8_e4m3fn  # gate / up: the norm's rows
  xla_quantized = _qwen3(monkeypatch, e4m3_rows=False, activations="e4m3")
  calls.clear()
  _same_logits_and_tokens(xla_quantized, rows)
  taken = {(name, width) for name, width, lanes, _ in calls if lanes}
  hidden, ffn = layers[0].attn.o_proj.shape[2], layers[0].mlp.down_proj.shape[1]
  # q / k / v and gate / up on the norms' rows, down_proj on the SwiGLU kernel's
  assert {("fp8_partials_many", hidden), ("fp8_partials_many", ffn)} <= taken
  assert all(layer.mlp.fp8_swiglu is not None for layer in layers)


@pytest.mark.usefixtures("fresh_traces")
def test_the_e4m3_rows_off_keep_the_activations_as_they_are(monkeypatch):
  """Off, the norms give arrays and every FP8 product multiplies the activations as they are:
  the logits differ from the setting on's by the e4m3 rounding of q / k / v's, gate / up's
  and down's inputs alone (within 5% of the largest logit here; the FP8 tensor cores' route
  for prefill rounds the same way)."""
  off = _qwen3(monkeypatch, e4m3_rows=False)
  on = _qwen3(monkeypatch, e4m3_rows=True)
  assert not off.target.layers[0].mlp.fp8_e4m3_rows
  from tests.test_fp8_gpu_configuration import PROMPTS
  want, got = off.compute_logits(PROMPTS[:1])[0], on.compute_logits(PROMPTS[:1])[0]
  assert not np.array_equal(got, want)  # the rows went in e4m3
  np.testing.assert_allclose(got, want, rtol=0, atol=0.05 * np.abs(want).max())


@pytest.mark.usefixtures("fresh_traces")
def test_a_dense_mlp_and_experts_after_latent_attention_read_its_norms_e4m3_rows(monkeypatch):
  """The tiny FP8 DeepSeek-V3 of test_fp8_gpu_configuration: its dense first layer's gate / up
  and its sigmoid-routed experts' take the e4m3 rows of the norm after latent attention (whose
  output is an array: the norm's plain form), and its logits equal, bit for bit, those with
  those rows quantized by XLA."""
  from jspec.pallas_kernels import fp8_experts
  from tests.test_fp8_gpu_configuration import PROMPTS, _llm
  monkeypatch.setattr(fp8_gemm, "DEFAULT_ACTIVATIONS", "e4m3")
  monkeypatch.setattr(fp8_experts, "X_E4M3", True)
  expert_rows, decode = [], fp8_experts.experts_fp8_decode

  def expert_spy(*args, x_e4m3=None, **kwargs):
    expert_rows.append(x_e4m3 is not None)
    return decode(*args, x_e4m3=x_e4m3, **kwargs)

  monkeypatch.setattr(fp8_experts, "experts_fp8_decode", expert_spy)
  given_rows = []
  for name in ("fp8_partials_many", "fp8_matmul"):
    def spy(x, *args, act_lanes_X=None, fn=getattr(fp8_gemm, name), **kwargs):
      given_rows.append(act_lanes_X is not None)
      return fn(x, *args, act_lanes_X=act_lanes_X, **kwargs)
    monkeypatch.setattr(fp8_gemm, name, spy)
  logits = []
  for e4m3_rows in (False, True):
    with monkeypatch.context() as patch:
      patch.setattr(platform, "on_hopper", lambda: True)
      patch.setattr(backends, "FP8_E4M3_ROWS", e4m3_rows)
      llm = _llm(norm_backend="pallas")
    assert llm.target.layers[0].mlp.fp8_e4m3_rows == e4m3_rows
    assert llm.target.layers[1].mlp.fp8_e4m3_rows == e4m3_rows  # the MoE layer
    given_rows.clear()
    expert_rows.clear()
    logits.append(llm.compute_logits(PROMPTS[:1])[0])
    assert any(given_rows) == e4m3_rows  # on: gate / up took the norm's rows
    assert expert_rows and all(expert_rows) == e4m3_rows  # the experts' too
  np.testing.assert_array_equal(logits[1], logits[0])


def _stand_ins(monkeypatch):
  """XLA's products in place of the few-row FP8 kernel, whose Mosaic GPU interpreter runs on
  one device: o_proj's partials in two K slices, rows first, and gate / up's product of e4m3
  rows read through their lanes (each row times its groups' scales)."""
  def dequantized(w8, scale):
    return w8.astype(jnp.float32) * jnp.repeat(jnp.repeat(scale, 128, 0), 128, 1)

  def two_slices(x_MK, w8s, scales, lanes, rows_first=False):
    assert rows_first
    w = dequantized(w8s[0], scales[0])
    half = x_MK.shape[1] // 2
    return jnp.stack([x_MK[:, s * half:(s + 1) * half] @ w[:, s * half:(s + 1) * half].T
                      for s in (0, 1)]), None

  def e4m3_product(x8_MK, w8, scale, lanes_NbX=None, sum_apart=True, act_lanes_X=None,
                   out_dtype=None):
    m, k = x8_MK.shape
    scale_MKb = act_lanes_X.reshape(k // 128, -1)[:, :m].T
    x = x8_MK.astype(jnp.float32) * jnp.repeat(scale_MKb, 128, axis=1)
    return (x @ dequantized(w8, scale).T).astype(out_dtype)

  monkeypatch.setattr(fp8_gemm, "fp8_partials_many", two_slices)
  monkeypatch.setattr(fp8_gemm, "fp8_matmul", e4m3_product)


def _e4m3_weight(rng, n: int, k: int):
  """(e4m3 [N, K], power-of-two block scales [N/128, K/128])."""
  return (jnp.asarray(rng.standard_normal((n, k)), jnp.float8_e4m3fn),
          jnp.asarray(2.0 ** rng.integers(-2, 2, (n // 128, k // 128)), jnp.float32))


def _meshed_norm_rows(mesh, rng, b: int = 4, t: int = 2, k: int = 256, d: int = 256):
  """(h, norm(h) as E4m3Rows) of o_proj's partials (x [B, T, K] times an e4m3 [D, K]) added to a
  residual whose rows' scales span 2^-4 .. 2^3, through the sharded norm kernel on `mesh`: each
  batch shard's rows with their own scales (one row of lanes a shard)."""
  from jspec.models import fp8_row_kernels
  from jspec.sharding.rules import ShardingRules
  x = jnp.asarray(rng.standard_normal((b, t, k)), jnp.float32)
  w_o, s_o = _e4m3_weight(rng, d, k)
  residual = jnp.asarray(rng.standard_normal((b, t, d)) * 2.0 ** rng.integers(-4, 4, (b, 1, 1)),
                         jnp.float32)
  norm_scale = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)
  norm = fp8_row_kernels.sharded_fp8_add_rms_norm(mesh, ShardingRules(), interpret=True)
  h, rows = norm(x, w_o, s_o, None, residual, norm_scale, eps=EPS, zero_centered=False,
                 quantize=True)
  assert isinstance(rows, E4m3Rows) and rows.lanes.shape[0] == mesh.shape["dp"]
  return h, rows


@pytest.mark.parametrize("dp, tp", [(2, 1), (2, 2), (4, 1)])
def test_the_e4m3_rows_on_a_mesh_equal_one_device(monkeypatch, dp, tp):
  """The sharded norm (fp8_row_kernels.sharded_fp8_add_rms_norm, quantize) and the FP8
  product that reads its rows (projections.sharded_fp8_projection) on a dp x tp mesh: each
  batch shard's norm writes its own rows' scales (E4m3Rows.lanes, one row a shard), and the
  product on the mesh gives one device's output bit for bit."""
  from jspec.models import fp8_row_kernels, projections
  from jspec.sharding.rules import ShardingRules
  _stand_ins(monkeypatch)
  rng = np.random.default_rng(dp * 10 + tp)
  w_up, s_up = _e4m3_weight(rng, 384, 256)
  outs = []
  for mesh in (jspec.MeshConfig().make_mesh(), jspec.MeshConfig(dp=dp, tp=tp).make_mesh()):
    h, rows = _meshed_norm_rows(mesh, np.random.default_rng(dp * 10 + tp + 1))
    product = projections.sharded_fp8_projection(mesh, ShardingRules(), (128, 128))
    outs.append((h, rows.values, rows.x8, product(rows, w_up, s_up)))
  for one, meshed in zip(*outs):
    np.testing.assert_array_equal(_f32(meshed), _f32(one))


def _two_slice_partials(x_MK, w8s, scales, lanes, rows_first=False, act_lanes_X=None):
  """fp8_gemm.fp8_partials_many's stand-in for the mesh tests (the Mosaic GPU interpreter runs
  on one device): XLA's product in two K slices, rows first, of x as it is or of e4m3 rows times
  their groups' scales read from their lanes."""
  assert rows_first
  m, k = x_MK.shape
  x = x_MK.astype(jnp.float32)
  if act_lanes_X is not None:
    x = x * jnp.repeat(act_lanes_X.reshape(k // 128, -1)[:, :m].T, 128, axis=1)
  w = w8s[0].astype(jnp.float32) * jnp.repeat(jnp.repeat(scales[0], 128, 0), 128, 1)
  half = k // 2
  return jnp.stack([x[:, s * half:(s + 1) * half] @ w[:, s * half:(s + 1) * half].T
                    for s in (0, 1)]), None


@pytest.mark.parametrize("dp, tp", [(2, 1), (2, 2), (4, 1)])
def test_the_swiglu_kernel_on_a_mesh_equals_one_device(monkeypatch, dp, tp):
  """fp8_row_kernels.sharded_fp8_swiglu on a dp x tp mesh (the weights whole on every shard),
  fed by the sharded norm's e4m3 rows: each batch shard sums its rows' gate / up partials,
  applies SwiGLU and quantizes the result with its own rows' scales (one row of lanes a shard);
  the activation and its e4m3 rows equal one device's bit for bit."""
  from jspec.models import fp8_row_kernels
  from jspec.sharding.rules import ShardingRules
  monkeypatch.setattr(fp8_gemm, "fp8_partials_many", _two_slice_partials)
  rng = np.random.default_rng(100 + dp * 10 + tp)
  f = 256
  w_gate_up, s_gate_up = _e4m3_weight(rng, 2 * f, 256)
  outs = []
  for mesh in (jspec.MeshConfig().make_mesh(), jspec.MeshConfig(dp=dp, tp=tp).make_mesh()):
    _, rows = _meshed_norm_rows(mesh, np.random.default_rng(100 + dp * 10 + tp + 1))
    swiglu = fp8_row_kernels.sharded_fp8_swiglu(mesh, ShardingRules(), interpret=True)
    act = swiglu(rows, w_gate_up, s_gate_up, None)
    assert isinstance(act, E4m3Rows) and act.x8.shape == (*rows.x8.shape[:2], f)
    assert act.lanes.shape[0] == mesh.shape["dp"]
    outs.append((act.values, act.x8))
  for one, meshed in zip(*outs):
    np.testing.assert_array_equal(_f32(meshed), _f32(one))
  assert np.abs(_f32(outs[0][0])).max() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width, splits", [(1, 4096, 4), (8, 4096, 4), (3, 4096, 8),
                                                 (32, 7168, 2), (1, 2048, 8)])
def test_gpu_the_norm_kernel_quantizes_as_quantize_activations(rows, width, splits):
  """Compiled (Triton) at model shapes: h and norm(h) as without `quantize`, the e4m3 rows and
  their lanes equal to quantize_activations' of that output (the scales a product with
  448's reciprocal, the division rounded to nearest, as XLA's)."""
  rng = np.random.default_rng(rows * splits + width)
  parts = jnp.asarray(rng.standard_normal((splits, max(rows, 8), width)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
  scale = jnp.asarray(1 + 0.2 * rng.standard_normal(width), jnp.bfloat16)
  call = functools.partial(add_partials_rms_norm, x, parts, scale, dtype=jnp.bfloat16, eps=EPS)
  h, normed, x8, lanes = call(quantize=True)
  want_h, want = call()
  np.testing.assert_array_equal(_f32(h), _f32(want_h))
  np.testing.assert_array_equal(_f32(normed), _f32(want))
  want_x8, want_scale = fp8_gemm.quantize_activations(normed)
  np.testing.assert_array_equal(_f32(x8), _f32(want_x8))
  np.testing.assert_array_equal(np.asarray(lanes), np.asarray(fp8_gemm.act_lanes(want_scale)))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_the_fp8_kernel_takes_quantized_rows_as_they_are(rows):
  """Compiled: Qwen3-8B's q / k / v (4096 x 6144 in one call) and gate / up (4096 x 24576)
  of e4m3 rows and their lanes, against the e4m3 route that quantizes x itself."""
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, 4096)), jnp.bfloat16)
  x8, x_scale = fp8_gemm.quantize_activations(x)
  lanes = fp8_gemm.act_lanes(x_scale)
  for ns in ([4096, 1024, 1024], [24576]):
    weights, scales = _fp8_weights(rng, 4096, ns)
    want, _ = fp8_gemm.fp8_partials_many(x, weights, scales, activations="e4m3")
    got, _ = fp8_gemm.fp8_partials_many(x8, weights, scales, act_lanes_X=lanes)
    np.testing.assert_array_equal(np.asarray(got)[..., :rows], np.asarray(want)[..., :rows])


@pytest.mark.parametrize("seed", range(6))
def test_the_swiglu_kernel_sums_activates_and_quantizes(seed):
  """swiglu_e4m3: gate / up's partials summed (times the rows' scales where given) and cast as
  fp8_matmul gives them, silu(g) x u cast once, and that in e4m3 with its lanes as
  quantize_activations and act_lanes give them, bit for bit; padded partial rows unread."""
  from jspec.pallas_kernels.swiglu_e4m3 import swiglu_e4m3
  rng = np.random.default_rng(1900 + seed)
  rows = int(rng.choice([1, 2, 5, 8, 12, 33]))
  ffn = 128 * int(rng.choice([1, 2, 3, 8, 24]))
  splits = int(rng.choice([1, 2, 3, 4, 8]))
  dtype = [jnp.float32, jnp.bfloat16][seed % 2]
  parts = rng.standard_normal((splits, decode_routing.padded_tokens(rows), 2 * ffn)) * 3
  parts[:, rows:] = np.nan  # padding: a read of it would show
  parts = jnp.asarray(parts, jnp.float32)
  row_scale = (jnp.asarray(2.0 ** rng.integers(-3, 4, rows), jnp.float32) if seed % 3 == 1
               else None)
  act, x8, lanes = swiglu_e4m3(parts, row_scale, rows=rows, dtype=dtype)
  total = jnp.sum(parts[:, :rows], axis=0)
  if row_scale is not None:
    total = total * row_scale[:, None]
  gate, up = (total[:, cols].astype(dtype).astype(jnp.float32)
              for cols in (slice(0, ffn), slice(ffn, None)))
  want = (jax.nn.silu(gate) * up).astype(dtype)
  np.testing.assert_array_equal(_f32(act), _f32(want))
  want_x8, want_scale = fp8_gemm.quantize_activations(want)
  np.testing.assert_array_equal(_f32(x8), _f32(want_x8))
  np.testing.assert_array_equal(np.asarray(lanes), np.asarray(fp8_gemm.act_lanes(want_scale)))


def test_the_swiglu_kernel_refuses_what_it_cannot_lay_out():
  from jspec.pallas_kernels.swiglu_e4m3 import swiglu_e4m3
  with pytest.raises(ValueError, match="whole 128-groups"):
    swiglu_e4m3(jnp.ones((1, 8, 192)), rows=1, dtype=jnp.float32)
  with pytest.raises(ValueError, match="up to 64 rows"):
    swiglu_e4m3(jnp.ones((1, 8, 256)), rows=9, dtype=jnp.float32)  # more rows than partials


@pytest.mark.gpu
@pytest.mark.parametrize("rows, splits", [(1, 2), (8, 2), (3, 4)])
def test_gpu_the_swiglu_kernel_at_qwen3_8b_width(rows, splits):
  """Compiled (Triton) at Qwen3-8B's F = 12288: act as the reference computes it up to the
  order of the float32 sums and SiLU's rounding (1 bf16 ulp), its e4m3 rows and lanes equal
  to quantize_activations' of the kernel's own act."""
  from jspec.pallas_kernels.swiglu_e4m3 import swiglu_e4m3
  rng = np.random.default_rng(rows * 10 + splits)
  parts = jnp.asarray(rng.standard_normal((splits, max(rows, 8), 2 * 12288)), jnp.float32)
  act, x8, lanes = swiglu_e4m3(parts, rows=rows, dtype=jnp.bfloat16)
  total = jnp.sum(parts[:, :rows], axis=0)
  gate, up = (total[:, c].astype(jnp.bfloat16).astype(jnp.float32)
              for c in (slice(0, 12288), slice(12288, None)))
  want = _f32((jax.nn.silu(gate) * up).astype(jnp.bfloat16))
  np.testing.assert_allclose(_f32(act), want, rtol=2.0 ** -7, atol=1e-6)
  want_x8, want_scale = fp8_gemm.quantize_activations(act)
  np.testing.assert_array_equal(_f32(x8), _f32(want_x8))
  np.testing.assert_array_equal(np.asarray(lanes), np.asarray(fp8_gemm.act_lanes(want_scale)))
