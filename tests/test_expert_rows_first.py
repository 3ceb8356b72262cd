"""The FP8 experts' gate / up partials rows first (fp8_experts.GATE_UP_ROWS_FIRST): the expert
kernel storing its tiles transposed (slot_products' rows_first) against its rows-last
partials, and both activation kernels reading only the step's live rows of them against the
rows-last forms, bit for bit; the decode path with the layout on against off. In interpret
mode here; the GPU runs are marked `gpu`."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.pallas_kernels import decode_routing, expert_act, fp8_experts, platform
from jspec.pallas_kernels.fp8_experts import experts_fp8_decode, slot_products
from jspec.pallas_kernels.fp8_gemm import act_lanes, quantize_activations
from tests.test_moe_e4m3 import _fp8_experts

RUN_SEED = 20261206


def _f32(a):
  return np.asarray(a, np.float32)


@pytest.mark.parametrize("seed", range(4))
def test_rows_first_partials_are_the_rows_last_ones_transposed(seed):
  """1 to 8 tokens of bf16 x or shared e4m3 rows, two weights, 1 or 2 K slices, the weights'
  lanes made beforehand or gathered."""
  rng = np.random.default_rng([RUN_SEED, seed])
  tokens, splits = [1, 3, 8, 2][seed], 1 + seed % 2
  num_experts, dim, ffn = 6, 256, 256
  weights = tuple(_fp8_experts(rng, num_experts, ffn, dim, with_lanes=seed < 2) for _ in range(2))
  x = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.bfloat16)
  if seed % 2:
    x8, x_scale = quantize_activations(x)
    x, lanes = x8, act_lanes(x_scale)
  else:
    x, lanes = fp8_experts.bfloat16_rows(x), None
  slot_expert = jnp.asarray(rng.choice(num_experts, 4, replace=False), jnp.int32)
  num_slots = jnp.asarray([3], jnp.int32)
  call = functools.partial(slot_products, x, weights, slot_expert, num_slots, 1, 4,
                           splits=splits, summed=False, act_lanes_X=lanes)
  got, want = _f32(call(rows_first=True)), _f32(call())
  np.testing.assert_array_equal(got[:, :, :3], np.swapaxes(want, 3, 4)[:, :, :3])


def test_rows_first_partials_are_left_unsummed():
  rng = np.random.default_rng(0)
  w = _fp8_experts(rng, 2, 128, 256, with_lanes=False)
  with pytest.raises(ValueError, match="summed=False"):
    slot_products(jnp.ones((1, 256), jnp.bfloat16), (w,), jnp.zeros(2, jnp.int32),
                  jnp.ones(1, jnp.int32), 1, 2, rows_first=True)


def _both_layouts(rng, splits, slots, ffn, rows, live, used):
  """(rows-last partials [2, P, S, F, N], the same rows first [2, P, S, N, F] with the rows
  from `live` on NaN: a read of them would show), the padded rows' partials zero in the
  rows-last form as the expert kernel leaves them (x's padded rows are zeros)."""
  parts = rng.standard_normal((2, splits, slots, rows, ffn)).astype(np.float32) * 2
  parts[:, :, :, live:] = 0.0
  parts[:, :, used:] = np.nan  # not written by the gate / up kernel
  rows_first = parts.copy()
  rows_first[:, :, :, live:] = np.nan
  return jnp.asarray(np.swapaxes(parts, 3, 4)), jnp.asarray(rows_first)


@pytest.mark.parametrize("case", range(6))
def test_the_activation_kernels_read_the_live_rows_first(case):
  """gate_up_act and gate_up_act_e4m3 on rows-first partials of `live` of N rows (the rest
  NaN): the rows-last forms' act, act8 and lanes on the live rows bit for bit, zeros past them
  (lanes 0, as act_lanes pads a step's rows)."""
  rng = np.random.default_rng([RUN_SEED, 10, case])
  splits, rows, live = [(1, 8, 1), (8, 8, 1), (3, 8, 3), (2, 16, 9), (4, 32, 32), (1, 8, 8)][case]
  ffn, slots = 128 * (1 + case % 3), int(rng.integers(2, 9))
  used = int(rng.integers(1, slots + 1))
  last, first = _both_layouts(rng, splits, slots, ffn, rows, live, used)
  num_slots = jnp.asarray([used], jnp.int32)
  layout = dict(rows_first=True, live_rows=live)
  act, want = _f32(expert_act.gate_up_act(first, num_slots, **layout)), _f32(
      expert_act.gate_up_act(last, num_slots))
  np.testing.assert_array_equal(act[:, :live], want[:, :live])
  assert not act[:, live:].any()
  (x8, lanes), (want_x8, want_lanes) = (expert_act.gate_up_act_e4m3(first, num_slots, **layout),
                                        expert_act.gate_up_act_e4m3(last, num_slots))
  np.testing.assert_array_equal(_f32(x8)[:, :live], _f32(want_x8)[:, :live])
  assert not _f32(x8)[:, live:].any()
  lanes_SGL, want_SGL = (np.asarray(a).reshape(slots, ffn // 128, -1) for a in (lanes, want_lanes))
  np.testing.assert_array_equal(lanes_SGL[..., :live], want_SGL[..., :live])
  assert not lanes_SGL[..., live:].any()


def test_live_rows_go_with_rows_first_partials_only():
  with pytest.raises(ValueError, match="live_rows"):
    expert_act.gate_up_act(jnp.zeros((2, 1, 2, 128, 8)), jnp.ones(1, jnp.int32), live_rows=1)
  with pytest.raises(ValueError, match="live_rows"):
    expert_act.gate_up_act_e4m3(jnp.zeros((2, 1, 2, 8, 128)), jnp.ones(1, jnp.int32),
                                rows_first=True, live_rows=9)


@pytest.mark.usefixtures("fresh_traces")
@pytest.mark.parametrize("tokens, down_e4m3", [(1, True), (3, False), (5, True)])
def test_the_decode_path_with_rows_first_partials_equals_it_without(monkeypatch, tokens,
                                                                     down_e4m3):
  """experts_fp8_decode with GATE_UP_ROWS_FIRST gives, bit for bit, what it gives without,
  with the down product on bf16 or e4m3 act."""
  from tests.test_expert_down_e4m3 import _moe_case
  rng = np.random.default_rng([RUN_SEED, 20, tokens])
  x, ids, weights, experts = _moe_case(rng, tokens)
  monkeypatch.setattr(fp8_experts, "DOWN_E4M3", down_e4m3)
  call = functools.partial(experts_fp8_decode, x, ids, weights, *experts)
  want = _f32(call())
  monkeypatch.setattr(fp8_experts, "GATE_UP_ROWS_FIRST", True)
  np.testing.assert_array_equal(_f32(call()), want)


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 8])
def test_gpu_rows_first_at_qwen3_30b_a3b_shapes(tokens):
  """Compiled: Qwen3-30B-A3B's gate / up (8 slots of 2 x 768 x 2048, the decode path's K
  slices) stored rows first equal the rows-last tiles transposed, and the activation kernels
  on the live rows equal their rows-last forms."""
  from tests.test_moe_e4m3 import a3b_gate_up_case
  weights, x8, x_scale, slots, slot_expert, num_slots, splits = a3b_gate_up_case(
      np.random.default_rng([RUN_SEED, 30, tokens]), tokens)
  call = functools.partial(slot_products, x8, weights, slot_expert, num_slots, 1, 4,
                           splits=splits, summed=False, act_lanes_X=act_lanes(x_scale))
  first, last = call(rows_first=True), call()
  used = slots - 1
  np.testing.assert_array_equal(_f32(first)[:, :, :used],
                                np.swapaxes(_f32(last), 3, 4)[:, :, :used])
  layout = dict(rows_first=True, live_rows=tokens)
  act = _f32(expert_act.gate_up_act(first, num_slots, **layout))
  want = _f32(expert_act.gate_up_act(last, num_slots))
  np.testing.assert_array_equal(act[:, :tokens], want[:, :tokens])
  rows = decode_routing.padded_tokens(tokens)
  assert act.shape[1] == rows and not act[:, tokens:].any()

