"""The decode-sized MoE experts as one kernel (jspec.pallas_kernels.decode_fused): the same
slots' outputs as the two kernels it joins (decode_gemm.gate_up_decode, then down_decode), bit
for bit where both take the same K steps, and the layer against the jnp reference.

Off the GPU one interpreted program runs every item; on the GPU the persistent grid's programs
wait on each other through the slots' counters, which the GPU cases exercise with grids of a
few programs (many items each) and of one per SM, and with calls repeated in one program (the
counters zeroed for each call)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_helpers import ON_GPU, TOLERANCE, chunked_reference, expert_problem, poison, rel_err
from jspec.pallas_kernels import decode_fused, decode_gemm, decode_routing, experts
from jspec.pallas_kernels.decode_routing import max_slots, padded_tokens


def _two_kernels(x, plan, w_gate, w_up, w_down):
  tokens_pad = padded_tokens(x.shape[0])
  gate_tiling, down_tiling = experts.decode_tilings(w_gate.shape[1], w_gate.shape[2])
  act = decode_gemm.gate_up_decode(x, w_gate, w_up, plan.slot_expert_S, plan.num_slots_1,
                                   tokens_pad, gate_tiling)
  return decode_gemm.down_decode(act, w_down, plan.weight_SR, plan.slot_expert_S,
                                 plan.num_slots_1, down_tiling)


def _fused_and_two(args, programs=None):
  """(fused, two kernels): each slot's [N, D] output, the used slots only (numpy float32)."""
  x, ids, weights, w_gate, w_up, w_down = args
  num_experts = w_gate.shape[0]
  if ON_GPU:  # poisoned memory for the intermediates and the outputs
    slots, n = max_slots(*ids.shape, num_experts), padded_tokens(x.shape[0])
    for shape in [(slots, n, w_gate.shape[2]), (slots, n, x.shape[1])]:
      poison(shape, x.dtype)

  @jax.jit
  def both(x, ids, weights, w_gate, w_up, w_down):
    plan = decode_routing.plan_decode(ids, weights, num_experts)
    fused = decode_fused.experts_decode_fused(x, w_gate, w_up, w_down, plan,
                                              padded_tokens(x.shape[0]), programs=programs)
    return fused, _two_kernels(x, plan, w_gate, w_up, w_down), plan.num_slots_1[0]

  fused, two, used = both(*args)
  used = int(used)
  return np.asarray(fused[:used], np.float32), np.asarray(two[:used], np.float32)


# (tokens, experts, top-k, D, F): one token as batch-1 decode, several as verify windows.
CASES = [(1, 8, 4, 128, 128), (1, 16, 8, 256, 256), (3, 8, 2, 256, 128), (5, 16, 4, 128, 256),
         (8, 8, 3, 384, 128), (12, 8, 2, 128, 128)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_fused_kernel_equals_the_two_kernels_bit_for_bit(case):
  """D and F multiples of 128: both forms multiply the same 128-K steps in the same order."""
  tokens, num_experts, top_k, dim, ffn = case
  args = expert_problem(sum(case), tokens, num_experts, top_k, dim, ffn, jnp.bfloat16,
                        invalid_fraction=0.2 if tokens > 1 else 0.0)
  fused, two = _fused_and_two(args)
  assert np.all(np.isfinite(fused)), "a slot's row was left unwritten"
  np.testing.assert_array_equal(fused, two)


@pytest.mark.parametrize("ffn", [64, 192])
def test_expert_widths_off_128_take_64_wide_k_steps_and_match_the_reference(ffn):
  args = expert_problem(ffn, 4, 8, 3, 256, ffn, jnp.bfloat16)
  got = jax.jit(experts.experts_decode)(*args)
  assert rel_err(got, chunked_reference(*args)) < TOLERANCE[jnp.bfloat16]


def test_decode_path_takes_the_fused_kernel_where_it_fits(monkeypatch):
  calls = []
  real = decode_fused.experts_decode_fused
  monkeypatch.setattr(decode_fused, "experts_decode_fused",
                      lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
  args = expert_problem(7, 2, 8, 2, 128, 64, jnp.bfloat16)
  got = experts.experts_decode(*args)
  assert calls == [(2, 128)]
  assert rel_err(got, chunked_reference(*args)) < TOLERANCE[jnp.bfloat16]
  # D = 64 has no two 64-column halves of a 128-column down item: the two kernels.
  experts.experts_decode(*expert_problem(7, 2, 8, 2, 64, 64, jnp.bfloat16))
  assert len(calls) == 1
  monkeypatch.setattr(decode_fused, "FUSED", False)
  experts.experts_decode(*args)
  assert len(calls) == 1


def test_sizes_the_kernel_refuses():
  assert decode_fused.fits(8, 2048, 768, jnp.bfloat16, 32)
  assert not decode_fused.fits(8, 2048, 768, jnp.float32, 32)  # 16-bit operands only
  assert not decode_fused.fits(8, 192, 128, jnp.bfloat16, 32)  # D not in 128-column items
  assert not decode_fused.fits(64, 2048, 1536, jnp.bfloat16, 64)  # the row fills the memory
  x, ids, weights, w_gate, w_up, w_down = expert_problem(1, 1, 4, 2, 192, 64, jnp.bfloat16)
  plan = decode_routing.plan_decode(ids, weights, 4)
  with pytest.raises(ValueError, match="does not take"):
    decode_fused.experts_decode_fused(x, w_gate, w_up, w_down, plan, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 3, 7, None])
def test_programs_that_wait_on_each_other_give_the_two_kernels_outputs(programs):
  """Qwen3-30B-A3B's expert shapes at batch 1 and at 8 tokens, on grids of 1, 3, 7 programs
  (each program's down items wait on other programs' gate / up items) and one per SM."""
  for tokens in (1, 8):
    args = expert_problem(11 + tokens, tokens, 128, 8, 2048, 768, jnp.bfloat16)
    fused, two = _fused_and_two(args, programs=programs)
    np.testing.assert_array_equal(fused, two)


@pytest.mark.gpu
def test_counters_start_at_zero_in_every_call_of_a_loop():
  """Forty calls in one jitted loop, each on the last one's output: a counter left over from a
  call would let a down item read another call's activations."""
  x, ids, weights, w_gate, w_up, w_down = expert_problem(5, 1, 64, 8, 1024, 512, jnp.bfloat16)

  def layer(x, fused):
    plan = decode_routing.plan_decode(ids, weights, 64)
    if fused:
      out = decode_fused.experts_decode_fused(x, w_gate, w_up, w_down, plan, 8)
    else:
      out = _two_kernels(x, plan, w_gate, w_up, w_down)
    y = decode_routing.combine_slots(out, plan, x.dtype)
    return (y / jnp.maximum(jnp.max(jnp.abs(y)), 1e-6)).astype(x.dtype)

  def loop(fused):
    return jax.jit(lambda x: jax.lax.fori_loop(0, 40, lambda _, x: layer(x, fused), x))(x)

  np.testing.assert_array_equal(np.asarray(loop(True), np.float32),
                                np.asarray(loop(False), np.float32))
