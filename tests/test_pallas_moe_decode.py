"""The decode-sized Pallas MoE path (slot plan + two Mosaic GPU kernels) against the jnp reference.

Off-GPU the kernels run in Mosaic GPU interpret mode, which fills every buffer a kernel
allocates with NaN: a row the kernel should have written and did not fails the comparison.
On the GPU each run is preceded by freeing NaN buffers of the intermediates' and output's
sizes, so that the allocator hands the kernels poisoned memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import large_gpu_memory_cases
from moe_helpers import (ON_GPU, TOLERANCE, chunked_reference, expert_problem, gpu_only, poison,
                         rel_err)
from jspec.models.moe_backends import experts_reference, get_experts_fn
from jspec.pallas_kernels import (DecodeTiling, decode_tilings, experts_decode,
                                  experts_grouped, experts_pallas, plan_decode,
                                  use_decode_path)
from jspec.pallas_kernels.decode_routing import max_slots, padded_tokens


def _poison(num_tokens, top_k, num_experts, dim, ffn, dtype):
  """Leaves freed NaN buffers of the decode path's sizes for the next run (GPU only)."""
  if not ON_GPU:
    return
  slots, n = max_slots(num_tokens, top_k, num_experts), padded_tokens(num_tokens)
  for shape in [(slots, n, ffn), (slots, n, dim), (num_tokens, dim)]:
    poison(shape, dtype)


def _check(args, dtype, fn=experts_decode, tolerance=None):
  x, ids, _, w_gate, *_ = args
  _poison(ids.shape[0], ids.shape[1], w_gate.shape[0], w_gate.shape[1], w_gate.shape[2], dtype)
  got = jax.jit(fn)(*args)
  assert got.shape == x.shape and got.dtype == x.dtype
  assert rel_err(got, chunked_reference(*args, chunk=8)) < (tolerance or TOLERANCE[dtype])


# --- the slot plan ---------------------------------------------------------------------------

def test_plan_gives_each_selected_expert_one_slot_in_ascending_order():
  ids = jnp.array([[5, 2], [2, 9], [-1, 5]], jnp.int32)
  weights = jnp.array([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]], jnp.float32)
  plan = plan_decode(ids, weights, num_experts=8)  # 9 is another shard's expert
  assert int(plan.num_slots_1[0]) == 2
  assert np.asarray(plan.slot_expert_S)[:2].tolist() == [2, 5]
  assert np.asarray(plan.slot_TK).tolist() == [[1, 0], [0, -1], [-1, 1]]
  want = np.zeros((6, 32), np.float32)  # [S, R]: one 128-byte block of weights per slot
  want[0, :2] = [0.4, 0.3]
  want[1, [0, 2]] = [0.6, 0.5]
  np.testing.assert_allclose(np.asarray(plan.weight_SR), want, rtol=1e-6)


def test_plan_sums_a_repeated_pick_once_and_combines_it_once():
  ids = jnp.array([[3, 3, 1], [1, 0, 0]], jnp.int32)
  plan = plan_decode(ids, jnp.array([[0.2, 0.3, 0.5], [0.1, 0.4, 0.5]]), 4)
  assert np.asarray(plan.slot_expert_S)[:3].tolist() == [0, 1, 3]
  assert np.asarray(plan.slot_TK).tolist() == [[2, -1, 1], [1, 0, -1]]
  np.testing.assert_allclose(np.asarray(plan.weight_SR)[:3, :2],
                             [[0.0, 0.9], [0.5, 0.1], [0.5, 0.0]], rtol=1e-6)


def test_plan_of_one_token_makes_each_pick_a_slot():
  """Batch-1 decode: no dedupe, no prefix count; an invalid pick reads expert E (zeros)."""
  plan = plan_decode(jnp.array([[6, -1, 2]], jnp.int32), jnp.array([[0.5, 0.3, 0.2]]), 8)
  assert np.asarray(plan.slot_expert_S).tolist() == [6, 8, 2]
  assert int(plan.num_slots_1[0]) == 3
  assert np.asarray(plan.slot_TK).tolist() == [[0, -1, 2]]
  np.testing.assert_allclose(np.asarray(plan.weight_SR)[:, 0], [0.5, 0.0, 0.2], rtol=1e-6)


# --- the whole decode path -------------------------------------------------------------------

CASES = {
    # name: (num_tokens, num_experts, top_k, experts_used, invalid_fraction, distinct)
    "one_token_top8": (1, 16, 8, None, 0.0, True),
    "one_token_top1": (1, 8, 1, None, 0.0, True),
    "one_token_invalid_and_repeated": (1, 8, 4, [3, 5], 0.3, False),
    "odd_tokens_top2": (13, 8, 2, None, 0.0, True),
    "every_row_on_one_expert": (11, 8, 1, [5], 0.0, True),
    "empty_experts": (9, 16, 2, [1, 6, 7], 0.0, True),
    "other_shard_ids": (7, 8, 4, None, 0.3, True),
    "repeated_picks": (5, 8, 4, [2, 3], 0.0, False),
    "tokens_past_32": (37, 8, 2, None, 0.0, True),
}

# Every case in bf16; fp32 on the two T = 1 cases and one odd size.
DECODE_CASES = ([(case, jnp.bfloat16) for case in sorted(CASES)]
                + [(case, jnp.float32) for case in ("one_token_top8", "one_token_top1",
                                                    "odd_tokens_top2")])


@pytest.mark.parametrize("case, dtype", DECODE_CASES)
def test_decode_path_matches_reference(case, dtype):
  num_tokens, num_experts, top_k, used, invalid, distinct = CASES[case]
  seed = sum(map(ord, case))
  args = expert_problem(seed, num_tokens, num_experts, top_k, 128, 64, dtype, used, invalid,
                        distinct)
  _check(args, dtype)


def test_no_valid_id_gives_zeros():
  x, _, weights, w_gate, w_up, w_down = expert_problem(1, 3, 4, 2, 128, 64, jnp.bfloat16)
  ids = jnp.full((3, 2), -1, jnp.int32)
  got = jax.jit(experts_decode)(x, ids, weights, w_gate, w_up, w_down)
  assert np.all(np.asarray(got, np.float32) == 0.0)


@pytest.mark.parametrize("async_mma", [True, False])
def test_wide_tiles_and_shallow_pipeline_match_reference(async_mma):
  """128-column work items for both kernels (the down tiling real shapes take), 2 stages, both
  ways of restarting the sums between items."""
  args = expert_problem(2, 6, 8, 3, 256, 128, jnp.bfloat16)
  tilings = (DecodeTiling(128, 128, 2, async_mma), DecodeTiling(128, 64, 2, async_mma))
  _check(args, jnp.bfloat16, fn=lambda *a: experts_decode(*a, tilings=tilings))


def test_blocking_accumulation_matches_reference_over_many_items():
  args = expert_problem(3, 13, 8, 4, 128, 128, jnp.float32)
  tilings = (DecodeTiling(64, 64, 3, False), DecodeTiling(64, 64, 3, False))
  _check(args, jnp.float32, fn=lambda *a: experts_decode(*a, tilings=tilings))


def test_pallas_backend_takes_the_decode_path_by_size():
  assert use_decode_path(1, 8) and use_decode_path(32, 8) and use_decode_path(64, 1)
  assert not use_decode_path(33, 8) and not use_decode_path(65, 1)
  assert decode_tilings(2048, 768) == (DecodeTiling(64, 128), DecodeTiling(128, 128))
  assert get_experts_fn("pallas") is experts_pallas
  args = expert_problem(3, 4, 8, 2, 128, 64, jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(experts_pallas(*args), np.float32),
                                np.asarray(jax.jit(experts_decode)(*args), np.float32))


def test_grouped_path_still_matches_reference_at_decode_sizes():
  """The previous (sorted, padded-tile) path, kept for larger sizes and as a baseline."""
  args = expert_problem(4, 5, 8, 2, 128, 64, jnp.bfloat16)
  _check(args, jnp.bfloat16, fn=experts_grouped)


def test_runs_inside_while_loop_and_jit():
  args = expert_problem(5, 3, 8, 2, 128, 64, jnp.bfloat16)

  def body(i, y):
    return y + experts_pallas(*args).astype(jnp.float32)

  got = jax.jit(lambda: jax.lax.fori_loop(0, 2, body, jnp.zeros(args[0].shape)))()
  want = 2 * experts_reference(*args).astype(jnp.float32)
  assert rel_err(got, want) < TOLERANCE[jnp.bfloat16]


# --- realistic shapes on the GPU -------------------------------------------------------------

GPU_SHAPES = {
    # name: (num_tokens, num_experts, top_k, dim, ffn)
    "qwen3_t1": (1, 128, 8, 2048, 768),
    "qwen3_t3": (3, 128, 8, 2048, 768),
    "qwen3_t8": (8, 128, 8, 2048, 768),
    "qwen3_t32": (32, 128, 8, 2048, 768),
    "qwen3_t64_top1": (64, 128, 1, 2048, 768),
    "qwen3.5_t4": (4, 256, 8, 2048, 512),
    "deepseek_t8": (8, 256, 8, 7168, 2048),
}


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", large_gpu_memory_cases(sorted(GPU_SHAPES)))
def test_gpu_decode_path_matches_reference(case):
  num_tokens, num_experts, top_k, dim, ffn = GPU_SHAPES[case]
  args = expert_problem(6, num_tokens, num_experts, top_k, dim, ffn, jnp.bfloat16)
  _check(args, jnp.bfloat16, fn=experts_pallas)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_edge_cases(case):
  num_tokens, num_experts, top_k, used, invalid, distinct = CASES[case]
  args = expert_problem(7, num_tokens, num_experts, top_k, 256, 128, jnp.bfloat16, used, invalid,
                        distinct)
  _check(args, jnp.bfloat16, fn=experts_pallas)


@pytest.mark.gpu
@gpu_only
def test_gpu_float32_falls_back_and_matches():
  args = expert_problem(8, 5, 16, 4, 256, 128, jnp.float32)
  _check(args, jnp.float32, fn=experts_pallas, tolerance=1e-2)  # XLA may use tf32.
