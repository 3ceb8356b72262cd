"""The Pallas Mosaic GPU MoE kernels against the pure-jnp reference.

Off-GPU the kernels run in Mosaic GPU interpret mode, which fills every buffer a kernel
allocates with NaN: a row the kernel should have written and did not fails the comparison.
On the GPU the tests free a NaN buffer of the output's size just before each run, so that
the allocator hands the kernel poisoned memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import large_gpu_memory_cases
from moe_helpers import (TOLERANCE, chunked_reference, expert_problem, gpu_only, poison,
                         rel_err)
from jspec.models.moe_backends import experts_reference, get_experts_fn
from jspec.pallas_kernels import (Tiling, choose_tilings, down_weighted, experts_pallas,
                                  gate_up_swiglu, max_tiles, permute_rows, plan_routing,
                                  unpermute_combine)


def _check_experts(args, dtype, tolerance=None):
  x = args[0]
  poison(x.shape, x.dtype)
  got = jax.jit(experts_pallas)(*args)
  assert got.shape == x.shape and got.dtype == x.dtype
  assert rel_err(got, chunked_reference(*args)) < (tolerance or TOLERANCE[dtype])


# --- routing metadata ----------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_rows",
                         [(1, 8, 16, 8), (37, 2, 8, 16), (50, 4, 4, 64)])
def test_plan_places_every_copy_in_a_tile_of_its_expert(num_tokens, top_k, num_experts,
                                                        block_rows):
  _, ids, weights, *_ = expert_problem(0, num_tokens, num_experts, top_k, 64, 64, jnp.float32,
                                       invalid_fraction=0.2)
  plan = plan_routing(ids, weights, num_experts, block_rows)
  ids, weights = np.asarray(ids), np.asarray(weights)
  pos = np.asarray(plan.pos_TK)
  tile_expert = np.asarray(plan.tile_expert_N)
  num_tiles = int(plan.num_tiles)
  assert plan.tile_expert_N.shape[0] == max_tiles(ids.size, num_experts, block_rows)
  assert np.all(tile_expert[:num_tiles] >= 0) and np.all(tile_expert[num_tiles:] == -1)
  assert np.all(np.diff(tile_expert[:num_tiles]) >= 0), "tiles are in expert order"
  valid = (ids >= 0) & (ids < num_experts)
  assert np.all(pos[~valid] == -1)
  rows = pos[valid]
  assert len(set(rows.tolist())) == rows.size, "two copies share a row"
  np.testing.assert_array_equal(tile_expert[rows // block_rows], ids[valid])
  np.testing.assert_array_equal(np.asarray(plan.row_token_P)[rows], np.nonzero(valid)[0])
  np.testing.assert_allclose(np.asarray(plan.row_weight_P)[rows], weights[valid], rtol=1e-6)
  pad = np.setdiff1d(np.arange(plan.num_rows), rows)
  assert np.all(np.asarray(plan.row_weight_P)[pad] == 0.0)
  assert int(np.asarray(plan.tile_rows_N).sum()) == rows.size


def test_plan_gives_empty_experts_no_tiles():
  ids = jnp.array([[3, 3], [3, 5]], jnp.int32)
  plan = plan_routing(ids, jnp.ones((2, 2)), num_experts=8, block_rows=8)
  assert int(plan.num_tiles) == 2
  assert np.asarray(plan.tile_expert_N)[:2].tolist() == [3, 5]
  assert np.asarray(plan.tile_rows_N)[:2].tolist() == [3, 1]


# --- permute / combine -----------------------------------------------------------------------

def test_permute_then_combine_of_weighted_rows_is_the_weighted_sum():
  x, ids, weights, *_ = expert_problem(1, 13, 6, 3, 64, 64, jnp.float32, invalid_fraction=0.2)
  plan = plan_routing(ids, weights, 6, 8)
  x_PD = permute_rows(x, plan)
  y = unpermute_combine(x_PD * plan.row_weight_P[:, None], plan, jnp.float32)
  valid = (ids >= 0) & (ids < 6)
  want = x * jnp.where(valid, weights, 0.0).sum(axis=1, keepdims=True)
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)


# --- grouped GEMM kernels --------------------------------------------------------------------

TILINGS = {
    "swapped8": (Tiling(True, 8, 64, 64, 2), Tiling(True, 8, 64, 64, 2)),
    "swapped16": (Tiling(True, 16, 64, 128, 2), Tiling(True, 16, 64, 64, 2)),
    "standard64": (Tiling(False, 64, 64, 64, 2), Tiling(False, 64, 128, 64, 2)),
}


def _kernel_refs(x_PD, plan, w_gate, w_up, w_down):
  """Per-row jnp versions of both kernels (float32 math, HIGHEST precision)."""
  hp = jax.lax.Precision.HIGHEST
  block_rows = plan.block_rows
  expert_P = jnp.repeat(jnp.maximum(plan.tile_expert_N, 0), block_rows)
  xf = x_PD.astype(jnp.float32)
  gate = jnp.einsum("pd,pdf->pf", xf, w_gate[expert_P].astype(jnp.float32), precision=hp)
  up = jnp.einsum("pd,pdf->pf", xf, w_up[expert_P].astype(jnp.float32), precision=hp)
  act = jax.nn.silu(gate) * up
  down = jnp.einsum("pf,pfd->pd", act.astype(x_PD.dtype).astype(jnp.float32),
                    w_down[expert_P].astype(jnp.float32), precision=hp)
  used_rows = jnp.repeat(plan.tile_expert_N >= 0, block_rows)
  return act, down * plan.row_weight_P[:, None], np.asarray(used_rows)


@pytest.mark.parametrize("tiling_name", sorted(TILINGS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grouped_gemm_kernels_match_per_row_reference(tiling_name, dtype):
  gate_up_tiling, down_tiling = TILINGS[tiling_name]
  x, ids, weights, w_gate, w_up, w_down = expert_problem(2, 11, 4, 2, 128, 128, dtype,
                                                         invalid_fraction=0.1)
  plan = plan_routing(ids, weights, 4, gate_up_tiling.block_rows)
  x_PD = permute_rows(x, plan)
  act = gate_up_swiglu(x_PD, w_gate, w_up, plan.tile_expert_N, gate_up_tiling)
  out = down_weighted(act, w_down, plan.row_weight_P, plan.tile_expert_N, down_tiling)
  want_act, want_out, used = _kernel_refs(x_PD, plan, w_gate, w_up, w_down)
  # Every row of every used tile must be written (pad rows too), and match.
  assert rel_err(act[used], want_act[used]) < TOLERANCE[dtype]
  assert rel_err(out[used], want_out[used]) < TOLERANCE[dtype]


# --- the whole experts function --------------------------------------------------------------

CASES = {
    # name: (num_tokens, num_experts, top_k, experts_used, invalid_fraction)
    "one_token_top8": (1, 16, 8, None, 0.0),
    "odd_tokens_top2": (37, 8, 2, None, 0.0),
    "empty_experts": (24, 16, 2, [1, 6, 7], 0.0),
    "all_on_one_expert": (40, 8, 1, [5], 0.0),
    "top1": (29, 8, 1, None, 0.0),
    "other_shard_ids": (19, 8, 4, None, 0.3),
    "standard_tiling": (300, 4, 1, None, 0.0),
}


# Every case in bf16; fp32 on two cases (one per tiling) to keep interpret-mode CI short.
EXPERT_CASES = ([(case, jnp.bfloat16) for case in sorted(CASES)]
                + [(case, jnp.float32) for case in ("odd_tokens_top2", "standard_tiling")])


@pytest.mark.parametrize("case, dtype", EXPERT_CASES)
def test_experts_pallas_matches_reference(case, dtype):
  num_tokens, num_experts, top_k, used, invalid = CASES[case]
  args = expert_problem(3, num_tokens, num_experts, top_k, 128, 64, dtype, used, invalid)
  _check_experts(args, dtype)


def test_tilings_follow_rows_per_expert():
  decode, _ = choose_tilings(num_copies=8, num_experts=128, dim=2048, ffn=768)
  assert decode.swapped and decode.block_rows == 8
  verify, _ = choose_tilings(num_copies=32 * 8, num_experts=8, dim=2048, ffn=768)
  assert verify.swapped and verify.block_rows == 32
  prefill, _ = choose_tilings(num_copies=8192 * 8, num_experts=128, dim=2048, ffn=768)
  assert not prefill.swapped and prefill.block_rows == 128


def test_hidden_size_of_one_tile_takes_the_64_column_down_tiling():
  """D = 64 (a model padded to the tile, 64): the standard tiling's down GEMM writes 64-column
  blocks instead of 128, and matches the reference."""
  _, down = choose_tilings(num_copies=300, num_experts=4, dim=64, ffn=64)
  assert not down.swapped and down.block_cols == 64
  args = expert_problem(5, 300, 4, 1, 64, 64, jnp.bfloat16)
  _check_experts(args, jnp.bfloat16)


def test_sizes_off_the_tile_are_refused_with_the_padding_named():
  with pytest.raises(ValueError, match=r"multiples of 64, got D=64, F=48: .*expert_tile=64"):
    choose_tilings(num_copies=8, num_experts=8, dim=64, ffn=48)


def test_backend_registry_returns_pallas_kernels():
  assert get_experts_fn("pallas") is experts_pallas


def test_runs_inside_while_loop_and_jit():
  args = expert_problem(4, 5, 8, 2, 128, 64, jnp.bfloat16)

  def body(i, y):
    return y + experts_pallas(*args).astype(jnp.float32)

  got = jax.jit(lambda: jax.lax.fori_loop(0, 2, body, jnp.zeros(args[0].shape)))()
  want = 2 * experts_reference(*args).astype(jnp.float32)
  assert rel_err(got, want) < TOLERANCE[jnp.bfloat16]


# --- realistic shapes on the GPU -------------------------------------------------------------

GPU_CASES = {
    "qwen3_t1": (1, 128, 8, 2048, 768),
    "qwen3_t37": (37, 128, 8, 2048, 768),
    "qwen3_t512": (512, 128, 8, 2048, 768),
    "qwen3_t2049": (2049, 128, 8, 2048, 768),
    "deepseek_t8": (8, 256, 8, 7168, 2048),
    "deepseek_t130": (130, 256, 8, 7168, 2048),
}


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", large_gpu_memory_cases(sorted(GPU_CASES)))
def test_gpu_experts_pallas_matches_reference(case):
  num_tokens, num_experts, top_k, dim, ffn = GPU_CASES[case]
  args = expert_problem(5, num_tokens, num_experts, top_k, dim, ffn, jnp.bfloat16)
  _check_experts(args, jnp.bfloat16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", ["empty_experts", "all_on_one_expert", "other_shard_ids",
                                  "one_token_top8"])
def test_gpu_edge_cases(case):
  num_tokens, num_experts, top_k, used, invalid = CASES[case]
  args = expert_problem(6, num_tokens * 8, num_experts, top_k, 256, 128, jnp.bfloat16, used,
                        invalid)
  _check_experts(args, jnp.bfloat16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("tiling_name", sorted(TILINGS))
def test_gpu_grouped_gemm_kernels(tiling_name):
  gate_up_tiling, down_tiling = TILINGS[tiling_name]
  x, ids, weights, w_gate, w_up, w_down = expert_problem(7, 300, 16, 4, 512, 256, jnp.bfloat16)
  plan = plan_routing(ids, weights, 16, gate_up_tiling.block_rows)
  x_PD = permute_rows(x, plan)
  poison((plan.num_rows, 256), jnp.bfloat16)
  act = gate_up_swiglu(x_PD, w_gate, w_up, plan.tile_expert_N, gate_up_tiling)
  poison((plan.num_rows, 512), jnp.bfloat16)
  out = down_weighted(act, w_down, plan.row_weight_P, plan.tile_expert_N, down_tiling)
  want_act, want_out, used = _kernel_refs(x_PD, plan, w_gate, w_up, w_down)
  assert rel_err(act[used], want_act[used]) < TOLERANCE[jnp.bfloat16]
  assert rel_err(out[used], want_out[used]) < TOLERANCE[jnp.bfloat16]


@pytest.mark.gpu
@gpu_only
def test_gpu_float32_falls_back_and_matches():
  args = expert_problem(8, 64, 16, 4, 256, 128, jnp.float32)
  _check_experts(args, jnp.float32, tolerance=1e-2)  # XLA may use tf32 for float32 dots.
