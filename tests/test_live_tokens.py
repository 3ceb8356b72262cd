"""MoE layers route live tokens only (jspec.models.moe_backends.live_tokens_only): a step's
dead rows (a bucket's spare rows, finished or free slots) and a prefill's positions past its
prompt pick no expert, so that no expert is read for them; live tokens' outputs are those of
the unmasked layer, and generation is unchanged."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import fixture_dir, greedy
from jspec.loop.step import target_forward
from jspec.models.moe_backends import experts_reference, live_tokens_only
from moe_helpers import expert_problem

NO_DRAFTER = types.SimpleNamespace(aux_layers=())


@pytest.mark.parametrize("seed", range(8))
def test_live_tokens_keep_their_outputs_and_dead_tokens_give_zeros(seed):
  rng = np.random.default_rng(seed)
  b, t = int(rng.integers(1, 5)), int(rng.integers(1, 4))
  x, ids, weights, wg, wu, wd = expert_problem(seed, b * t, num_experts=8, top_k=2, dim=16,
                                               ffn=8, dtype=jnp.float32)
  live_BT = rng.random((b, t)) < 0.5
  seen = []

  def spy(x_TD, ids_TK, *rest):
    seen.append(np.asarray(ids_TK))
    return experts_reference(x_TD, ids_TK, *rest)

  got = np.asarray(live_tokens_only(spy, jnp.asarray(live_BT))(x, ids, weights, wg, wu, wd))
  full = np.asarray(experts_reference(x, ids, weights, wg, wu, wd))
  live_T = live_BT.reshape(-1)
  np.testing.assert_array_equal(got[live_T], full[live_T])
  assert not got[~live_T].any()
  np.testing.assert_array_equal(seen[0][live_T], np.asarray(ids)[live_T])
  assert (seen[0][~live_T] == -1).all()


def test_a_mask_that_does_not_cover_the_tokens_is_refused():
  x, ids, weights, wg, wu, wd = expert_problem(0, 6, num_experts=4, top_k=2, dim=16, ffn=8,
                                               dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"does not cover the layer's 6 tokens"):
    live_tokens_only(experts_reference, jnp.ones((2, 2), bool))(x, ids, weights, wg, wu, wd)


def _moe_llm(**kwargs):
  return jspec.LLM(model=fixture_dir("qwen3_moe"), dtype="float32", max_model_len=64, **kwargs)


def _routed_rows(llm, live_B=None, seq_lens_B=None):
  """Which of 3 rows of a 2-token window routed any token copy, and the hidden states."""
  target, rows = llm.target, []

  def spy(x_TD, ids_TK, *rest):
    rows.append((np.asarray(ids_TK) >= 0).reshape(3, 2, -1).any(axis=(1, 2)))
    return llm.experts_fn(x_TD, ids_TK, *rest)

  tokens_BT = jnp.asarray([[5, 6], [7, 8], [9, 10]])
  positions_BT = jnp.asarray([[0, 1], [0, 1], [0, 1]])
  out, _ = target_forward(target, NO_DRAFTER, tokens_BT, positions_BT,
                          target.init_caches(3, 16, jnp.float32), 16, spy,
                          seq_lens_B=seq_lens_B, live_B=live_B)
  return rows, np.asarray(out.hidden_BTD)


def test_a_step_routes_its_live_rows_and_a_prefill_its_prompt_positions():
  llm = _moe_llm()
  all_rows, all_hidden = _routed_rows(llm)
  assert all_rows and all(r.all() for r in all_rows)
  rows, hidden = _routed_rows(llm, live_B=jnp.asarray([True, False, True]))
  assert rows and all((r == [True, False, True]).all() for r in rows)
  np.testing.assert_array_equal(hidden[[0, 2]], all_hidden[[0, 2]])
  # A prefill: row 2's prompt is empty (an idle lane), row 1 has one token.
  rows, hidden = _routed_rows(llm, seq_lens_B=jnp.asarray([2, 1, 0]))
  assert rows and all((r == [True, True, False]).all() for r in rows)
  np.testing.assert_array_equal(hidden[0], all_hidden[0])
  np.testing.assert_array_equal(hidden[1, 0], all_hidden[1, 0])


@pytest.mark.parametrize("batching", ["continuous", "waves"])
def test_in_the_loop_a_finished_row_routes_nothing_and_tokens_stay_vanillas(batching):
  """Two prompts, one ending after 2 tokens: the later steps route the other row's tokens
  only (counted on device), and each output equals its prompt generated alone."""
  llm = _moe_llm(max_num_seqs=2, batching=batching)
  live_counts = []
  base = llm.device.ctx.experts_fn

  def spy(x_TD, ids_TK, *rest):
    jax.debug.callback(lambda n: live_counts.append(int(n)), jnp.sum(jnp.any(ids_TK >= 0, 1)))
    return base(x_TD, ids_TK, *rest)

  llm.device.ctx = dataclasses.replace(llm.device.ctx, experts_fn=spy)
  prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
  params = [greedy(2, ignore_eos=True), greedy(12, ignore_eos=True)]
  got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
  alone = _moe_llm(max_num_seqs=1)
  want = [alone.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids
          for p, s in zip(prompts, params)]
  assert got == want
  # Decode calls route one token per live row: two rows, then one once the first has ended.
  assert 2 in live_counts and 1 in live_counts, live_counts


@pytest.mark.parametrize("batching", ["continuous", "waves"])
def test_an_mtp_heads_moe_routes_the_emitted_positions_of_running_rows_only(batching):
  """DeepSeek-V3's MTP layers are MoE layers: the head's pass over a verify window (and over
  a prompt) routes only the positions whose outputs are read, the emitted ones of running
  rows (the prompt's own), and its draft steps (k = 2: one a step, two rows) only the rows
  still running, so once the first prompt has ended they route one token of two; the tokens
  stay those of plain greedy decoding, each prompt alone."""
  def mtp_llm(**kwargs):
    return jspec.LLM(model=fixture_dir("deepseek_v3"), dtype="float32", max_model_len=64,
                     speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                     **kwargs)

  llm = mtp_llm(max_num_seqs=2, batching=batching)
  calls = []
  base = llm.device.ctx.draft_experts_fn

  def spy(x_TD, ids_TK, *rest):
    total = ids_TK.shape[0]
    jax.debug.callback(lambda n: calls.append((int(n), total)), jnp.sum(jnp.any(ids_TK >= 0, 1)))
    return base(x_TD, ids_TK, *rest)

  llm.device.ctx = dataclasses.replace(llm.device.ctx, draft_experts_fn=spy)
  prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
  params = [greedy(2, ignore_eos=True), greedy(12, ignore_eos=True)]
  got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
  plain = jspec.LLM(model=fixture_dir("deepseek_v3"), dtype="float32", max_model_len=64,
                    max_num_seqs=1)
  want = [plain.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids
          for p, s in zip(prompts, params)]
  assert got == want
  assert calls, "the MTP head's MoE layer was never called"
  assert all(live <= total for live, total in calls)
  assert any(live < total for live, total in calls), calls
  assert (1, 2) in calls and (2, 2) in calls, calls  # draft steps: one row ended, both running
