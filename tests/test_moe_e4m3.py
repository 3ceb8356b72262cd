"""FP8 experts' gate / up on e4m3 rows written by the norm before the MoE layer
(backends.FP8_E4M3_ROWS): norm_router's `quantize` form, the expert kernel taking a step's
shared e4m3 rows with their lanes (fp8_experts.slot_products' act_lanes_X), the decode path on
them, and a Qwen3-MoE model whose q / k / v and experts read its norms' rows, against the same
products with x quantized by XLA (fp8_gemm.quantize_activations). In interpret mode here; the
GPU runs are marked `gpu`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import backends
from jspec.models.linear import E4m3Rows
from jspec.pallas_kernels import decode_routing, fp8_experts, fp8_gemm, norm_router, platform
from jspec.pallas_kernels.fp8_experts import Fp8Experts, experts_fp8_decode, slot_products
from jspec.pallas_kernels.fp8_gemm import act_lanes, quantize_activations, scale_lanes
from tests.test_e4m3_rows import check_quantized

EPS = 1e-6
# (rows, hidden, experts, dtype, zero_centered): slices of 1 to 2 groups
NORM_CASES = [(1, 2048, 128, jnp.bfloat16, False), (3, 256, 8, jnp.float32, True),
              (8, 1024, 32, jnp.bfloat16, True), (2, 4096, 64, jnp.float32, False),
              (64, 512, 16, jnp.bfloat16, False), (5, 128, 8, jnp.float32, False)]


def _f32(a):
  return np.asarray(a, np.float32)


@pytest.mark.parametrize("case", range(len(NORM_CASES)))
def test_the_norm_router_kernel_quantizes_its_output_as_quantize_activations(case):
  """quantize=True: h, norm(h) and the partial logits bit for bit as without, norm(h) in e4m3
  and its scales in the FP8 kernel's lanes exactly as quantize_activations and act_lanes give
  them (rows of very different sizes: each row's groups scaled by their own largest value)."""
  rows, hidden, experts, dtype, zero_centered = NORM_CASES[case]
  rng = np.random.default_rng(2100 + case)
  x = jnp.asarray(rng.standard_normal((rows, hidden)) * 2.0 ** rng.integers(-5, 5, (rows, 1)),
                  dtype)
  delta = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
  scale = jnp.asarray(1 + rng.standard_normal(hidden) / 4, dtype)
  router = jnp.asarray(rng.standard_normal((hidden, experts)) / np.sqrt(hidden), dtype)
  call = functools.partial(norm_router.add_norm_router_partials, x, delta, scale, router,
                           eps=EPS, zero_centered=zero_centered, interpret=True)
  assert norm_router.quantizes(rows, hidden)
  *got, x8, lanes = call(quantize=True)
  for a, b in zip(got, call(), strict=True):
    np.testing.assert_array_equal(_f32(a), _f32(b))
  check_quantized(got[1], x8, lanes, rows, hidden)


def test_the_norm_router_kernel_refuses_to_quantize_what_it_cannot_lay_out():
  ones = lambda *shape: jnp.ones(shape, jnp.float32)
  # 5120 and 7168 (GLM-4.5's and DeepSeek-V3's, whose sigmoid routing takes no such kernel):
  # 16 slices of 320 and 448 columns, not whole groups
  assert not any(norm_router.quantizes(*shape)
                 for shape in ((1, 192), (1, 5120), (1, 7168), (65, 1024)))
  with pytest.raises(ValueError, match="whole 128-groups"):  # 3 slices of 64
    norm_router.add_norm_router_partials(ones(1, 192), ones(1, 192), ones(192), ones(192, 8),
                                         eps=EPS, quantize=True, interpret=True)
  with pytest.raises(ValueError, match="M <= 64"):
    norm_router.add_norm_router_partials(ones(65, 256), ones(65, 256), ones(256), ones(256, 8),
                                         eps=EPS, quantize=True, interpret=True)


def _fp8_experts(rng, num_experts, out, inner, with_lanes: bool):
  w8 = jnp.asarray(np.clip(rng.standard_normal((num_experts, out, inner)) * 60, -448, 448),
                   jnp.float8_e4m3fn)
  scale = jnp.asarray(2.0 ** rng.integers(-12, -8, (num_experts, out // 128, inner // 128)),
                      jnp.float32)
  return Fp8Experts(w8, scale, scale_lanes(scale) if with_lanes else None)


@pytest.mark.parametrize("seed", range(4))
def test_shared_e4m3_rows_give_the_per_slot_routes_products(seed):
  """slot_products on a step's e4m3 rows shared by every slot, their scales as act_lanes
  multiplied into the weights' block scales inside the kernel, equal bit for bit the per-slot
  e4m3 route, whose combined scales XLA makes before the kernel (1 to 8 tokens, two weights in
  one call or one, the weights' lanes made beforehand or gathered, K slices)."""
  rng = np.random.default_rng(2200 + seed)
  tokens = [1, 3, 8, 2][seed]
  num_experts, dim, ffn = 6, 256, 256
  weights = tuple(_fp8_experts(rng, num_experts, ffn, dim, with_lanes=seed % 2 == 0)
                  for _ in range(1 + seed % 2))
  x = jnp.asarray(rng.standard_normal((tokens, dim)) * 2.0 ** rng.integers(-3, 3, (tokens, 1)),
                  jnp.float32)
  x8, x_scale = quantize_activations(x)
  slots, used = 4, 3
  slot_expert = jnp.asarray(rng.choice(num_experts, slots, replace=False), jnp.int32)
  num_slots = jnp.asarray([used], jnp.int32)
  splits = 1 + seed // 2
  got = slot_products(x8, weights, slot_expert, num_slots, 1, 4, splits=splits,
                      act_lanes_X=act_lanes(x_scale))
  rows = decode_routing.padded_tokens(tokens)
  x8_SND = jnp.broadcast_to(jnp.pad(x8, ((0, rows - tokens), (0, 0)))[None], (slots, rows, dim))
  scale_SKbN = jnp.broadcast_to(jnp.pad(x_scale, ((0, rows - tokens), (0, 0))).T[None],
                                (slots, dim // 128, rows))
  want = slot_products(x8_SND, weights, slot_expert, num_slots, 1, 4, scale_SKbN, splits=splits)
  np.testing.assert_array_equal(np.asarray(got)[:, :used, :, :tokens],
                                np.asarray(want)[:, :used, :, :tokens])


def test_slot_products_refuse_e4m3_rows_without_their_scales():
  rng = np.random.default_rng(0)
  w = _fp8_experts(rng, 2, 128, 256, with_lanes=False)
  x8, x_scale = quantize_activations(jnp.ones((1, 256)))
  call = functools.partial(slot_products, weights=(w,), slot_expert_S=jnp.zeros(2, jnp.int32),
                           num_slots_1=jnp.ones(1, jnp.int32), blocks_per_step=1, num_stages=2)
  with pytest.raises(ValueError, match="shared .* with its act_lanes_X"):
    call(x8)
  with pytest.raises(ValueError, match="16-bit x with none"):
    call(jnp.ones((1, 256), jnp.bfloat16), act_lanes_X=act_lanes(x_scale))
  with pytest.raises(ValueError, match=r"act_lanes_X has shape \(32,\)"):
    call(x8, act_lanes_X=act_lanes(x_scale)[:32])


@pytest.mark.usefixtures("fresh_traces")
@pytest.mark.parametrize("tokens", [1, 5])
def test_the_decode_path_on_the_norms_rows_equals_it_quantizing_x_itself(monkeypatch, tokens):
  """experts_fp8_decode given x's e4m3 rows and lanes (x_e4m3) gives, bit for bit, what it
  gives quantizing x itself (fp8_experts.X_E4M3), and differs from x taken as it is by the
  rounding of x to e4m3 alone."""
  rng = np.random.default_rng(2300 + tokens)
  num_experts, dim, ffn, top_k = 8, 256, 128, 2
  w_gate, w_up = (_fp8_experts(rng, num_experts, ffn, dim, True) for _ in range(2))
  w_down = _fp8_experts(rng, num_experts, dim, ffn, True)
  x = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.bfloat16)
  ids = jnp.asarray(np.stack([rng.choice(num_experts, top_k, replace=False)
                              for _ in range(tokens)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32)
  call = functools.partial(experts_fp8_decode, x, ids, weights, w_gate, w_up, w_down)
  x8, x_scale = quantize_activations(x)
  got = call(x_e4m3=(x8, act_lanes(x_scale)))
  as_it_is = call()
  monkeypatch.setattr(fp8_experts, "X_E4M3", True)
  np.testing.assert_array_equal(_f32(got), _f32(call()))
  assert not np.array_equal(_f32(got), _f32(as_it_is))
  np.testing.assert_allclose(_f32(got), _f32(as_it_is), rtol=0,
                             atol=0.1 * np.abs(_f32(as_it_is)).max())


def _qwen3_moe_config():
  """A tiny FP8 Qwen3-MoE: 2 MoE layers, 8 experts of whole 128-blocks, top-2."""
  from jspec.bench.presets import PRESETS
  return PRESETS["qwen3-30b-a3b"].replace(
      vocab_size=512, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
      fp8_block=(128, 128), moe=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=128))


def _qwen3_moe(monkeypatch, e4m3_rows: bool):
  """The tiny FP8 Qwen3-MoE as a Hopper GPU runs it (interpreted), every few-row FP8 product
  and the experts' gate / up on e4m3 activations (quantized by XLA where no norm wrote them),
  the norms' e4m3 rows on or off."""
  config = _qwen3_moe_config()
  monkeypatch.setattr(fp8_gemm, "DEFAULT_ACTIVATIONS", "e4m3")
  monkeypatch.setattr(fp8_experts, "X_E4M3", True)
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)
    patch.setattr(backends, "FP8_E4M3_ROWS", e4m3_rows)
    return jspec.LLM.from_random(config, dtype="float32", seed=6, max_model_len=64,
                                 max_num_seqs=2, attention_backend="xla", norm_backend="pallas",
                                 speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 2})


@pytest.mark.usefixtures("fresh_traces")
def test_a_moe_models_q_k_v_and_experts_read_the_e4m3_rows_of_the_norms(monkeypatch):
  """In a MoE model every layer's q / k / v (the first layer's too) take the e4m3 rows that
  their input norm's kernel wrote (residual_norm.rms_norm's `quantize`: that norm sums no FP8
  product, the MoE output is an array), and the experts' gate / up those of the norm + router
  kernel, with no quantizing pass of XLA's; the logits and greedy tokens (decode and n-gram
  verify) equal those of the same model with those rows quantized by XLA, bit for bit."""
  from tests.test_e4m3_rows import _same_logits_and_tokens
  from tests.test_fp8_gpu_configuration import PROMPTS
  calls, expert_calls = [], []
  partials_many, decode = fp8_gemm.fp8_partials_many, fp8_experts.experts_fp8_decode

  def spy(x, *args, act_lanes_X=None, **kwargs):
    calls.append((x.shape[-1], act_lanes_X is not None))
    return partials_many(x, *args, act_lanes_X=act_lanes_X, **kwargs)

  def expert_spy(*args, x_e4m3=None, **kwargs):
    expert_calls.append(x_e4m3 is not None)
    return decode(*args, x_e4m3=x_e4m3, **kwargs)

  monkeypatch.setattr(fp8_gemm, "fp8_partials_many", spy)
  monkeypatch.setattr(fp8_experts, "experts_fp8_decode", expert_spy)
  xla_quantized = _qwen3_moe(monkeypatch, e4m3_rows=False)
  xla_quantized.compute_logits(PROMPTS[:1])
  assert calls and not any(lanes for _, lanes in calls)  # off: XLA quantizes every product
  assert expert_calls and not any(expert_calls)
  rows = _qwen3_moe(monkeypatch, e4m3_rows=True)
  layers = rows.target.layers
  assert all(layer.is_moe and layer.attn.fp8_e4m3_rows and layer.mlp.fp8_e4m3_rows
             for layer in layers)
  hidden = layers[0].attn.o_proj.shape[2]
  x = jnp.ones((2, 1, hidden), jnp.float32)
  first = layers[0].input_norm(x, quantize=True)  # the first layer's input
  _, later = layers[1].input_norm.add_and_norm(x, x, quantize=True)  # a MoE output added
  assert all(isinstance(n, E4m3Rows) and n.lanes.shape[0] == 1 for n in (first, later))
  calls.clear()
  expert_calls.clear()
  rows.compute_logits(PROMPTS[:1])
  from_norms = [lanes for width, lanes in calls if width == hidden]
  assert len(from_norms) == len(layers) and all(from_norms)  # q / k / v: the norms' rows
  assert expert_calls and all(expert_calls)  # gate / up: the norms' rows (one jitted trace)
  expert_calls.clear()
  params = jspec.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
  rows.generate(PROMPTS, params, use_tqdm=False)  # two rows: live_tokens_only passes them on
  assert expert_calls and all(expert_calls)
  _same_logits_and_tokens(xla_quantized, rows)


def a3b_gate_up_case(rng, tokens):
  """Qwen3-30B-A3B's experts' gate / up at a step of `tokens`: (weights, x8, x's scales, slots,
  slot_expert, num_slots (all but the last slot used), K slices as the decode path chooses)."""
  weights = tuple(_fp8_experts(rng, 128, 768, 2048, True) for _ in range(2))
  x8, x_scale = quantize_activations(jnp.asarray(rng.standard_normal((tokens, 2048)),
                                                 jnp.bfloat16))
  slots = 8 * tokens if tokens > 1 else 8
  slot_expert = jnp.asarray(rng.choice(128, slots, replace=False), jnp.int32)
  num_slots = jnp.asarray([slots - 1], jnp.int32)
  return (weights, x8, x_scale, slots, slot_expert, num_slots,
          fp8_experts._splits(None, 2048, slots, 768))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_gpu_shared_e4m3_rows_at_qwen3_30b_a3b_shapes(tokens):
  """Compiled: Qwen3-30B-A3B's experts' gate / up (8 slots of 2 x 768 x 2048, K slices as the
  decode path chooses) on shared e4m3 rows, against the per-slot e4m3 route."""
  weights, x8, x_scale, slots, slot_expert, num_slots, splits = a3b_gate_up_case(
      np.random.default_rng(tokens), tokens)
  got = slot_products(x8, weights, slot_expert, num_slots, 1, 4, splits=splits,
                      act_lanes_X=act_lanes(x_scale))
  rows = decode_routing.padded_tokens(tokens)
  x8_SND = jnp.broadcast_to(jnp.pad(x8, ((0, rows - tokens), (0, 0)))[None],
                            (slots, rows, 2048))
  scale_SKbN = jnp.broadcast_to(jnp.pad(x_scale, ((0, rows - tokens), (0, 0))).T[None],
                                (slots, 16, rows))
  want = slot_products(x8_SND, weights, slot_expert, num_slots, 1, 4, scale_SKbN, splits=splits)
  np.testing.assert_array_equal(np.asarray(got)[:, :slots - 1, :, :tokens],
                                np.asarray(want)[:, :slots - 1, :, :tokens])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_the_norm_router_kernel_quantizes_at_model_shapes(rows):
  """Compiled (Triton): Qwen3-30B-A3B's norm + router (2048 wide, 128 experts) with
  `quantize`, its e4m3 rows and lanes those of quantize_activations on its norm(h)."""
  rng = np.random.default_rng(rows)
  x, delta = (jnp.asarray(rng.standard_normal((rows, 2048)), jnp.bfloat16) for _ in range(2))
  scale = jnp.asarray(1 + rng.standard_normal(2048) / 4, jnp.bfloat16)
  router = jnp.asarray(rng.standard_normal((2048, 128)) / 45, jnp.bfloat16)
  h, normed, parts, x8, lanes = norm_router.add_norm_router_partials(
      x, delta, scale, router, eps=EPS, quantize=True)
  want = norm_router.add_norm_router_partials(x, delta, scale, router, eps=EPS)
  for a, b in zip((h, normed, parts), want):
    np.testing.assert_array_equal(_f32(a), _f32(b))
  want_x8, want_scale = quantize_activations(normed)
  np.testing.assert_array_equal(_f32(x8), _f32(want_x8))
  np.testing.assert_array_equal(np.asarray(lanes), np.asarray(act_lanes(want_scale)))
