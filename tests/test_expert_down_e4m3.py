"""The FP8 experts' down product on e4m3 act (fp8_experts.DOWN_E4M3): the activation kernel's
e4m3 form (expert_act.gate_up_act_e4m3) against gate / up's partials summed, SiLU(gate) x up
rounded to bfloat16 and quantize_activations per slot, bit for bit; the down kernel on per-slot
e4m3 rows with their lanes (slot_products' act_lanes_SX) against the same rows with the scales
multiplied in by XLA (act_scale_SKbN); and the decode path with it on against that composition
and against a float64 reference. In interpret mode here; the GPU runs are marked `gpu`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.pallas_kernels import decode_routing, expert_act, fp8_experts
from jspec.pallas_kernels.fp8_experts import experts_fp8_decode, slot_products
from jspec.pallas_kernels.fp8_gemm import INVERSE_E4M3_MAX, act_lanes, quantize_activations
from tests.test_moe_e4m3 import _fp8_experts

RUN_SEED = 20261205


def _f32(a):
  return np.asarray(a, np.float32)


def _partials(rng, splits, slots, ffn, rows, used):
  parts = rng.standard_normal((2, splits, slots, ffn, rows)).astype(np.float32) * 2
  parts[:, :, used:] = np.nan  # not written by the gate / up kernel: anything may be there
  return jnp.asarray(parts)


def _act_bf16(parts, used):
  """[S, N, F] bfloat16: the slices summed in order, silu(gate) x up rounded once, 0 past the
  used slots (what gate_up_act_e4m3 quantizes)."""
  gate, up = parts[0, 0], parts[1, 0]
  for p in range(1, parts.shape[1]):
    gate, up = gate + parts[0, p], up + parts[1, p]
  act = (jax.nn.silu(gate) * up).astype(jnp.bfloat16)
  act = jnp.where((jnp.arange(act.shape[0]) < used)[:, None, None], act, 0.0)
  return jnp.swapaxes(act, 1, 2)


def _quantized_per_slot(act_SNF):
  """(x8 [S, N, F], lanes [S, F/128 x L], scale [S, F/128, N]) by quantize_activations and
  act_lanes, slot by slot."""
  x8, scales = zip(*(quantize_activations(a) for a in act_SNF))
  lanes = jnp.stack([act_lanes(s) for s in scales])
  return jnp.stack(x8), lanes, jnp.swapaxes(jnp.stack(scales), 1, 2)


def _numpy_quantized(act_SNF):
  """(x8 [S, N, F] float32 values of e4m3, lanes [S, F/128 x L]) in NumPy: each row's
  128-groups scaled by max(|group|, 1e-12) x float32(1 / 448), IEEE division, e4m3 rounded to
  nearest even (what div.rn and cvt.rn give on the GPU; XLA's CPU division inside
  quantize_activations is not always correctly rounded, and a quotient on an e4m3 tie shows
  it)."""
  import ml_dtypes
  act = _f32(act_SNF)
  slots, rows, ffn = act.shape
  groups = act.reshape(slots, rows, ffn // 128, 128)
  scale = (np.maximum(np.abs(groups).max(axis=3), np.float32(1e-12))
           * np.float32(INVERSE_E4M3_MAX)).astype(np.float32)
  x8 = (groups / scale[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  lanes = np.zeros((slots, ffn // 128, expert_act.lanes_per_group(rows)), np.float32)
  lanes[:, :, :rows] = np.swapaxes(scale, 1, 2)
  return x8.reshape(slots, rows, ffn), lanes.reshape(slots, -1)


@pytest.mark.parametrize("case", range(8))
def test_the_e4m3_activation_is_the_bf16_one_quantized_per_row_and_group(case):
  """Slices of 1 to 8 (3 and 5 not powers of two), 8 to 64 rows, F of 1 to 6 groups, some
  slots unused (their partials NaN): act8 and its lanes those of DeepSeek-V3's act_quant on
  the bf16 act, laid out as act_lanes lays out a step's (lane n of a group: row n's scale),
  bit for bit, lanes past the rows 0."""
  rng = np.random.default_rng([RUN_SEED, case])
  splits = [1, 2, 3, 4, 5, 8, 8, 2][case]
  rows = [8, 8, 16, 8, 32, 8, 16, 64][case]
  ffn = 128 * [1, 6, 2, 3, 1, 6, 4, 2][case]
  slots = int(rng.integers(2, 10))
  used = int(rng.integers(1, slots + 1))
  parts = _partials(rng, splits, slots, ffn, rows, used)
  act8, lanes = expert_act.gate_up_act_e4m3(parts, jnp.asarray([used], jnp.int32))
  want_x8, want_lanes = _numpy_quantized(_act_bf16(parts, used))
  assert act8.dtype == jnp.float8_e4m3fn and act8.shape == (slots, rows, ffn)
  np.testing.assert_array_equal(_f32(act8), _f32(want_x8))
  np.testing.assert_array_equal(np.asarray(lanes), np.asarray(want_lanes))
  lanes_SGL = np.asarray(lanes).reshape(slots, ffn // 128, -1)
  assert lanes_SGL.shape[2] == expert_act.lanes_per_group(rows)
  assert np.all(lanes_SGL[:, :, rows:] == 0) and np.all(lanes_SGL[:, :, :rows] > 0)
  assert not _f32(act8[used:]).any()


def test_the_e4m3_activation_refuses_what_it_cannot_lay_out():
  with pytest.raises(ValueError, match="multiple of 128"):
    expert_act.gate_up_act_e4m3(jnp.zeros((2, 1, 2, 192, 8)), jnp.ones(1, jnp.int32))
  with pytest.raises(ValueError, match="power of two up to 64"):
    expert_act.gate_up_act_e4m3(jnp.zeros((2, 1, 2, 128, 12)), jnp.ones(1, jnp.int32))
  assert not expert_act.quantizes(768, 128) and expert_act.quantizes(768, 64)


def test_the_e4m3_activation_is_taken_where_it_measured_shorter():
  """One K slice of 8 rows (DeepSeek-V3's decode step) takes it; Qwen3-30B-A3B's 8 slices of 8
  rows, 32 rows and widths of no whole group do not."""
  assert expert_act.e4m3_pays(1, 2048, 8) and expert_act.e4m3_pays(1, 1536, 4)
  assert not expert_act.e4m3_pays(8, 768, 8)
  assert not expert_act.e4m3_pays(1, 768, 32)
  assert not expert_act.e4m3_pays(1, 192, 8)


def _down_case(rng, slots, rows, ffn, dim, with_lanes):
  w = _fp8_experts(rng, 6, dim, ffn, with_lanes)
  act = jnp.asarray(rng.standard_normal((slots, rows, ffn))
                    * 2.0 ** rng.integers(-3, 3, (slots, rows, 1)), jnp.bfloat16)
  return w, act


@pytest.mark.parametrize("seed", range(4))
def test_per_slot_lanes_give_the_xla_scaled_routes_products(seed):
  """slot_products on per-slot e4m3 rows whose scales the kernel multiplies in as it reads
  them (act_lanes_SX) equals, bit for bit, the route whose combined scales XLA makes before
  the kernel (act_scale_SKbN): 8 to 32 rows, one or two blocks a step, K slices, the weights'
  lanes made beforehand or gathered."""
  rng = np.random.default_rng([RUN_SEED, 10, seed])
  rows = [8, 16, 8, 32][seed]
  slots, used, ffn, dim = 4, 3, 256 * (1 + seed % 2), 256
  w, act = _down_case(rng, slots, rows, ffn, dim, with_lanes=seed % 2 == 0)
  x8, lanes, scale_SKbN = _quantized_per_slot(act)
  slot_expert = jnp.asarray(rng.choice(6, slots, replace=False), jnp.int32)
  num_slots = jnp.asarray([used], jnp.int32)
  blocks, splits = 1 + seed // 2, 1 + seed % 2
  got = slot_products(x8, (w,), slot_expert, num_slots, blocks, 4, splits=splits,
                      act_lanes_SX=lanes)
  want = slot_products(x8, (w,), slot_expert, num_slots, blocks, 4, scale_SKbN, splits=splits)
  np.testing.assert_array_equal(np.asarray(got)[:, :used], np.asarray(want)[:, :used])


def test_slot_products_refuse_per_slot_rows_with_two_kinds_of_scales_or_bad_lanes():
  rng = np.random.default_rng(0)
  w, act = _down_case(rng, 2, 8, 256, 128, with_lanes=False)
  x8, lanes, scale_SKbN = _quantized_per_slot(act)
  call = functools.partial(slot_products, x8, (w,), jnp.zeros(2, jnp.int32),
                           jnp.ones(1, jnp.int32), 1, 2)
  with pytest.raises(ValueError, match="act_scale_SKbN or its act_lanes_SX"):
    call(scale_SKbN, act_lanes_SX=lanes)
  with pytest.raises(ValueError, match="act_scale_SKbN or its act_lanes_SX"):
    call()
  with pytest.raises(ValueError, match=r"act_lanes_SX has shape \(2, 32\)"):
    call(act_lanes_SX=lanes[:, :32])


def _moe_case(rng, tokens):
  num_experts, dim, ffn, top_k = 8, 256, 256, 2
  w_gate, w_up = (_fp8_experts(rng, num_experts, ffn, dim, True) for _ in range(2))
  w_down = _fp8_experts(rng, num_experts, dim, ffn, True)
  x = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.bfloat16)
  ids = jnp.asarray(np.stack([rng.choice(num_experts, top_k, replace=False)
                              for _ in range(tokens)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32)
  return x, ids, weights, (w_gate, w_up, w_down)


def _reference64(x, ids, weights, experts, e4m3_act: bool):
  """y [T, D] in float64 from the dequantized weights: act rounded to bfloat16 as the bf16
  route rounds it, then (e4m3_act) per 128 columns to e4m3 and back, as the down kernel reads
  it."""
  import ml_dtypes
  w_gate, w_up, w_down = (np.asarray(w.dequantized(jnp.float32), np.float64) for w in experts)
  x64 = _f32(x).astype(np.float64)
  y = np.zeros_like(x64)
  for t, (row_ids, row_weights) in enumerate(zip(np.asarray(ids), np.asarray(weights))):
    for e, weight in zip(row_ids, row_weights):
      gate, up = x64[t] @ w_gate[e], x64[t] @ w_up[e]
      act = (gate / (1 + np.exp(-gate)) * up).astype(ml_dtypes.bfloat16).astype(np.float64)
      if e4m3_act:
        groups = act.reshape(-1, 128)
        scale = np.maximum(np.abs(groups).max(axis=1, keepdims=True), 1e-12) / 448
        act = ((groups / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
               * scale).reshape(-1)
      y[t] += weight * (act @ w_down[e])
  return y


@pytest.mark.usefixtures("fresh_traces")
@pytest.mark.parametrize("tokens", [1, 3])
def test_the_decode_path_with_e4m3_act_rounds_act_to_e4m3_alone(monkeypatch, tokens):
  """experts_fp8_decode with DOWN_E4M3 equals the gate / up partials, the e4m3 activation
  and the XLA-scaled down route composed by hand, bit for bit; it is nearer a float64
  reference that rounds act to e4m3 than to one that does not, and differs from the bf16 act
  route by that rounding alone."""
  rng = np.random.default_rng([RUN_SEED, 20, tokens])
  x, ids, weights, experts = _moe_case(rng, tokens)
  call = functools.partial(experts_fp8_decode, x, ids, weights, *experts)
  monkeypatch.setattr(fp8_experts, "DOWN_E4M3", False)
  bf16_act = _f32(call())
  monkeypatch.setattr(fp8_experts, "DOWN_E4M3", True)
  got = _f32(call())
  w_gate, w_up, w_down = experts
  plan = decode_routing.plan_unless_given(None, ids, weights, w_gate.w8.shape[0])
  rows = decode_routing.padded_tokens(tokens)
  splits = fp8_experts._splits(None, x.shape[1], plan.slot_expert_S.shape[0], w_gate.w8.shape[1])
  parts = slot_products(fp8_experts.bfloat16_rows(x), (w_gate, w_up), plan.slot_expert_S,
                        plan.num_slots_1, 1, 4, splits=splits, summed=False)
  act8, lanes = _numpy_quantized(_act_bf16(parts, plan.num_slots_1[0]))
  act8 = jnp.asarray(act8, jnp.float8_e4m3fn)
  scale_SKbN = jnp.asarray(lanes.reshape(act8.shape[0], act8.shape[2] // 128, -1)[..., :rows])
  (down,) = slot_products(act8, (w_down,), plan.slot_expert_S, plan.num_slots_1,
                          fp8_experts.DECODE_TILING.down_blocks, 4, scale_SKbN,
                          splits=fp8_experts._splits(None, w_down.w8.shape[2],
                                                     plan.slot_expert_S.shape[0],
                                                     w_down.w8.shape[1]))
  want = fp8_experts._combined(down, plan.weight_SR[:, :rows], plan, x.dtype)
  np.testing.assert_array_equal(got, _f32(want))
  near, far = (_reference64(x, ids, weights, experts, e4m3) for e4m3 in (True, False))
  assert np.abs(got - near).max() < np.abs(got - far).max()
  assert not np.array_equal(got, bf16_act)
  np.testing.assert_allclose(got, bf16_act, rtol=0, atol=0.1 * np.abs(bf16_act).max())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_gpu_the_down_product_on_e4m3_act_at_qwen3_30b_a3b_shapes(tokens):
  """Compiled: the e4m3 activation of 8 slots of 768-wide experts from their K slices' partials
  (each row's groups within e4m3's rounding of the bf16 act kernel's values), and the down
  product (2048 x 768, two blocks a step) on them with per-slot lanes equal bit for bit to the
  XLA-scaled route."""
  rng = np.random.default_rng([RUN_SEED, 30, tokens])
  rows = decode_routing.padded_tokens(tokens)
  slots = 8 * tokens if tokens > 1 else 8
  parts = _partials(rng, 4, slots, 768, rows, slots - 1)
  num_slots = jnp.asarray([slots - 1], jnp.int32)
  act8, lanes = expert_act.gate_up_act_e4m3(parts, num_slots)
  act = _f32(expert_act.gate_up_act(parts, num_slots))
  lanes_SGN = np.asarray(lanes).reshape(slots, 6, -1)[:, :, :rows]
  back = _f32(act8) * np.repeat(np.swapaxes(lanes_SGN, 1, 2), 128, axis=2)
  group_max = np.repeat(np.abs(act).reshape(slots, rows, 6, 128).max(axis=3), 128, axis=2)
  assert (np.abs(back - act) <= 2.0 ** -3 * group_max + 1e-30).all()
  w = _fp8_experts(rng, 128, 2048, 768, True)
  slot_expert = jnp.asarray(rng.choice(128, slots, replace=False), jnp.int32)
  x8, lanes, scale_SKbN = _quantized_per_slot(jnp.asarray(act, jnp.bfloat16))
  got = slot_products(x8, (w,), slot_expert, num_slots, 2, 4, act_lanes_SX=lanes)
  want = slot_products(x8, (w,), slot_expert, num_slots, 2, 4, scale_SKbN)
  np.testing.assert_array_equal(np.asarray(got)[:, :slots - 1],
                                np.asarray(want)[:, :slots - 1])
