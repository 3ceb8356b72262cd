"""The MoE bytes of a step counted from the experts the step routed (jspec.bench.roofline,
StepTimer.routed_experts) rather than from uniform routing: counts against NumPy, the byte
formula, and a biased router whose few experts are what the count finds, layer by layer."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.bench.presets import PRESETS
from jspec.bench.roofline import (distinct_experts, expected_experts_used, routed_expert_bytes,
                                  step_bytes)
from jspec.bench.steps import STEPS_PER_CALL, StepTimer

# Three layers, the first dense: two MoE layers of 8 experts in 4 groups, top-2 of 2 groups.
CFG = dataclasses.replace(PRESETS["tiny-mla"], num_layers=3)


@pytest.mark.parametrize("seed", range(4))
def test_distinct_experts_counts_each_routed_expert_once(seed):
  rng = np.random.default_rng(seed)
  tokens, top_k = rng.integers(1, 40), rng.integers(1, 9)
  ids = np.stack([rng.choice(64, top_k, replace=False) for _ in range(tokens)])
  assert distinct_experts(ids) == len(set(ids.ravel().tolist()))


@pytest.mark.parametrize("seed", range(3))
def test_distinct_experts_of_several_steps_is_the_mean_of_each_steps_count(seed):
  rng = np.random.default_rng(seed)
  steps, tokens, top_k = rng.integers(2, 9), rng.integers(1, 40), rng.integers(1, 9)
  ids = np.stack([np.stack([rng.choice(rng.integers(top_k, 65), top_k, replace=False)
                            for _ in range(tokens)]) for _ in range(steps)])
  counts = [len(set(step.ravel().tolist())) for step in ids]
  assert distinct_experts(ids) == pytest.approx(np.mean(counts))


def test_step_bytes_count_the_experts_each_layer_routed():
  d, f = CFG.hidden_size, CFG.moe.intermediate_size
  used = [3, 7]
  assert routed_expert_bytes(CFG, used) == 10 * 3 * d * f * 2
  uniform = expected_experts_used(CFG.moe.num_experts, CFG.moe.num_experts_per_tok, 4)
  routed, assumed = step_bytes(CFG, 4, 1, 100, experts_used=used), step_bytes(CFG, 4, 1, 100)
  assert abs((routed - assumed) - (10 - 2 * uniform) * 3 * d * f * 2) <= 1
  with pytest.raises(ValueError, match="experts_used has 1 counts for 2 MoE layers"):
    step_bytes(CFG, 4, 1, 100, experts_used=[3])


def test_step_timer_records_the_experts_a_biased_router_sends_every_token_to():
  """Correction biases that make experts {1, 5} win in the first MoE layer and {2, 6} in the
  second: the recorded ids of a batch-3 verify step are those, in layer order, and the
  step's MoE bytes are 2 experts a layer where uniform routing would assume 5.8."""
  llm = jspec.LLM.from_random(CFG, dtype="float32", max_model_len=64)
  for layer, winners in ((1, (1, 5)), (2, (2, 6))):
    bias = np.zeros(CFG.moe.num_experts, np.float32)
    bias[list(winners)] = 10.0
    llm.target.layers[layer].mlp.correction_bias.set_value(jnp.asarray(bias))
  routed = StepTimer(llm).routed_experts(batch=3, context=20, width=2)
  assert [ids.shape for ids in routed] == [(STEPS_PER_CALL, 6, 2)] * 2
  for ids, winners in zip(routed, ({1, 5}, {2, 6})):
    assert all(set(np.unique(step).tolist()) == winners for step in ids)
  used = [distinct_experts(ids) for ids in routed]
  assert used == [2, 2]
  assert expected_experts_used(CFG.moe.num_experts, 2, 6) > 5.8
  assert step_bytes(CFG, 3, 2, 20, experts_used=used) < step_bytes(CFG, 3, 2, 20)


def test_step_timer_records_every_step_it_times_each_fed_the_last_ones_tokens():
  """The timed loop starts every row at token 1 and feeds each step the previous step's
  argmax: an unbiased router's picks move with the tokens, so the later steps route other
  experts than the first, and the recorded ids are those of all STEPS_PER_CALL steps."""
  llm = jspec.LLM.from_random(CFG, dtype="float32", max_model_len=64, seed=3)
  routed = StepTimer(llm).routed_experts(batch=4, context=20)
  assert [ids.shape for ids in routed] == [(STEPS_PER_CALL, 4, 2)] * 2
  num_experts = CFG.moe.num_experts
  assert all(((ids >= 0) & (ids < num_experts)).all() for ids in routed)
  assert any(not np.array_equal(ids[step], ids[0]) for ids in routed
             for step in range(1, STEPS_PER_CALL))
