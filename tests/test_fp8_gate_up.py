"""FP8 experts' gate / up with SwiGLU in the kernel (jspec.pallas_kernels.fp8_gate_up): the
activation of each used slot, act[s] = silu(x @ W_gate[e_s]^T) * (x @ W_up[e_s]^T) in
bfloat16, against float64 NumPy on the dequantized weights (e4m3 value x its 128 x 128 block's
scale), within one bfloat16 rounding; the decode path through it against the whole layer. In
interpret mode here; the GPU runs are marked `gpu`."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jspec.pallas_kernels import decode_routing, fp8_experts, fp8_gate_up, platform
from jspec.pallas_kernels.fp8_experts import BLOCK, Fp8Experts
from jspec.pallas_kernels.fp8_gemm import bfloat16_rows, scale_lanes
from jspec.pallas_kernels.fp8_gate_up import GateUpTiling

RUN_SEED = 20261202


def _fp8(rng, num_experts, out, inner, lanes: bool):
  w8 = np.clip(rng.standard_normal((num_experts, out, inner)) * 60, -448, 448)
  scale = rng.uniform(1e-4, 3e-3, (num_experts, out // BLOCK, inner // BLOCK))
  w8, scale = jnp.asarray(w8.astype(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale, jnp.float32)
  return Fp8Experts(w8, scale, scale_lanes(scale) if lanes else None)


def _dequantized64(w: Fp8Experts):
  """[E, out, in] float64."""
  scale = np.repeat(np.repeat(np.asarray(w.scale, np.float64), BLOCK, 1), BLOCK, 2)
  return np.asarray(w.w8).astype(np.float64) * scale


def _act64(x, w_gate, w_up, slot_expert, used, rows):
  """[used, rows, F] float64: silu(gate) * up of each used slot's expert, x's missing rows 0."""
  x64 = np.zeros((rows, x.shape[1]))
  x64[:x.shape[0]] = np.asarray(x, np.float64)
  gate, up = _dequantized64(w_gate), _dequantized64(w_up)
  out = []
  for s in range(used):
    g, u = x64 @ gate[slot_expert[s]].T, x64 @ up[slot_expert[s]].T
    out.append(g / (1 + np.exp(-g)) * u)
  return np.stack(out)


def _assert_one_rounding(got, want):
  """bfloat16 keeps 8 significant bits: one rounding is within 2^-8 of a value; the float32
  sums of K products add about K * 2^-24 of the row's magnitude (the absolute term)."""
  got = np.asarray(got, np.float32).astype(np.float64)
  bound = 2.0 ** -8 * np.abs(want) + 1e-4 * np.abs(want).max(axis=-1, keepdims=True)
  assert np.isfinite(got).all()
  assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()


CASES = [  # (tokens, experts, slots max, used, D, F, tiling, lanes beforehand)
    (1, 6, 4, 4, 256, 128, GateUpTiling(), True),
    (1, 6, 4, 2, 384, 256, GateUpTiling(), False),
    (3, 8, 6, 5, 512, 384, GateUpTiling(blocks_per_step=2), True),
    (8, 5, 5, 5, 256, 128, GateUpTiling(block_cols=128), False),
    (12, 7, 7, 3, 256, 256, GateUpTiling(num_stages=2), True),
    (32, 4, 4, 4, 512, 128, GateUpTiling(blocks_per_step=4), False),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_activation_of_each_used_slot_equals_the_dequantized_swiglu(case):
  """Slots picking experts in any order, one expert in two slots; slots from `used` on are
  not written (interpret mode fills them with NaN, so only used slots are compared)."""
  tokens, experts, slots, used, dim, ffn, tiling, lanes = CASES[case]
  rng = np.random.default_rng([RUN_SEED, case])
  w_gate, w_up = (_fp8(rng, experts, ffn, dim, lanes) for _ in range(2))
  x = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.bfloat16)
  slot_expert = rng.integers(0, experts, slots)
  slot_expert[min(1, used - 1)] = slot_expert[0]
  rows = decode_routing.padded_tokens(tokens)
  act = fp8_gate_up.gate_up_act(bfloat16_rows(x), w_gate, w_up,
                                jnp.asarray(slot_expert, jnp.int32),
                                jnp.asarray([used], jnp.int32), rows, tiling)
  assert act.shape == (slots, rows, ffn) and act.dtype == jnp.bfloat16
  want = _act64(x, w_gate, w_up, slot_expert, used, rows)
  _assert_one_rounding(act[:used, :tokens], want[:, :tokens])


def test_shapes_off_the_kernel_are_refused():
  rng = np.random.default_rng([RUN_SEED, 99])
  w = _fp8(rng, 2, 128, 256, False)
  args = (jnp.asarray([0, 1], jnp.int32), jnp.asarray([2], jnp.int32))
  with pytest.raises(ValueError, match="at most 32 rows"):
    fp8_gate_up.gate_up_act(jnp.zeros((40, 256), jnp.bfloat16), w, w, *args, 64)
  with pytest.raises(ValueError, match="bfloat16 x"):
    fp8_gate_up.gate_up_act(jnp.zeros((1, 256), jnp.float32), w, w, *args, 8)
  with pytest.raises(ValueError, match="steps of 4"):  # D = 256 is 2 blocks, not 4
    fp8_gate_up.gate_up_act(jnp.zeros((1, 256), jnp.bfloat16), w, w, *args, 8,
                            GateUpTiling(blocks_per_step=4))


def test_the_decode_path_takes_it_where_its_items_fill_the_sms(monkeypatch):
  """bfloat16 x with no K slices asked for and (slot, 64-column) items at least half the SMs:
  the whole-K kernel; fewer items (a tp shard's narrow experts), float32 x or asked-for K
  slices: the K-sliced path."""
  rng = np.random.default_rng([RUN_SEED, 7])
  qwen_a3b = _fp8(rng, 1, 768, 256, False)  # F = 768: 12 items a slot
  narrow = _fp8(rng, 1, 256, 256, False)    # F = 256 (DeepSeek-V3's at tp = 8): 4 a slot
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  monkeypatch.setattr(fp8_experts, "WHOLE_K_GATE_UP", True)
  assert fp8_experts._whole_k_gate_up(qwen_a3b, 8, 8)      # 96 items
  assert not fp8_experts._whole_k_gate_up(narrow, 8, 8)    # 32 items
  assert fp8_experts._whole_k_gate_up(narrow, 8, 24)       # 96 items: three tokens' slots
  assert not fp8_experts._whole_k_gate_up(qwen_a3b, 64, 8)  # past MAX_ROWS
  monkeypatch.setattr(fp8_experts, "WHOLE_K_GATE_UP", False)
  assert not fp8_experts._whole_k_gate_up(qwen_a3b, 8, 8)


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_the_layer_through_the_whole_k_kernel_equals_the_k_sliced_path(num_tokens,
                                                                       monkeypatch):
  """The decode path's output with gate / up through fp8_gate_up against the K-sliced path
  (K in 2 slices, the activation kernel): the same activation up to the order of float32
  additions, so equal within one bfloat16 rounding of act and of y."""
  rng = np.random.default_rng([RUN_SEED, 11, num_tokens])
  experts, top_k, dim, ffn = 6, 3, 512, 256
  w_gate, w_up = (_fp8(rng, experts, ffn, dim, True) for _ in range(2))
  w_down = _fp8(rng, experts, dim, ffn, True)
  x = jnp.asarray(rng.standard_normal((num_tokens, dim)), jnp.bfloat16)
  ids = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False)
                              for _ in range(num_tokens)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (num_tokens, top_k)), jnp.float32)
  monkeypatch.setattr(fp8_experts, "WHOLE_K_GATE_UP", True)
  args = (x, ids, weights, w_gate, w_up, w_down)
  assert "fp8_experts_gate_up_act" in str(jax.make_jaxpr(fp8_experts.experts_fp8_decode)(*args))
  whole = fp8_experts.experts_fp8_decode(*args)
  sliced = fp8_experts.experts_fp8_decode(
      x, ids, weights, w_gate, w_up, w_down,
      fp8_experts.Fp8ExpertsTiling(gate_up_splits=2, down_splits=1))
  whole, sliced = np.asarray(whole, np.float64), np.asarray(sliced, np.float64)
  scale = np.abs(sliced).max(axis=1, keepdims=True)
  assert np.isfinite(whole).all()
  assert (np.abs(whole - sliced) <= 2.0 ** -7 * scale).all(), np.abs(whole - sliced).max()


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("tokens,tiling", [(1, GateUpTiling()), (3, GateUpTiling()),
                                           (8, GateUpTiling(blocks_per_step=2)),
                                           (16, GateUpTiling(block_cols=128)),
                                           (32, GateUpTiling())])
def test_on_the_gpu_at_qwen3_30b_a3b_shapes(tokens, tiling):
  """Qwen3-30B-A3B's expert shapes (D = 2048, F = 768) on 132 programs: 8 slots a token."""
  rng = np.random.default_rng([RUN_SEED, 40, tokens])
  experts, dim, ffn = 16, 2048, 768
  w_gate, w_up = (_fp8(rng, experts, ffn, dim, tokens <= 8) for _ in range(2))
  x = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.bfloat16)
  slots = min(8 * tokens, experts)
  slot_expert = rng.permutation(experts)[:slots]
  used = slots - 1
  rows = decode_routing.padded_tokens(tokens)
  act = fp8_gate_up.gate_up_act(bfloat16_rows(x), w_gate, w_up,
                                jnp.asarray(slot_expert, jnp.int32),
                                jnp.asarray([used], jnp.int32), rows, tiling)
  want = _act64(x, w_gate, w_up, slot_expert, used, rows)
  _assert_one_rounding(act[:used, :tokens], want[:, :tokens])
