"""The loop learns a drafter's state layout (jspec.loop.slots.draft_state_shape) before any
program runs: the slots' initial state holds zeros of it. Every drafter's layout is the one its
`prefill` gives after a real target forward, and the target's forward is traced for it only
where the drafter's prefill reads the target's hidden states (hidden-state heads: MTP,
EAGLE-3); for none, n-gram and draft models it is not traced at all."""

import jax
import jax.numpy as jnp
import pytest

import jspec

from drafter_checkpoints import eagle3_head, truncated_draft_model
from helpers import cached_llm, fixture_dir
from jspec.loop import slots
from jspec.loop.step import LoopPlan, target_forward
from jspec.schedulers.base import num_drafts, program_models

BATCH, SLOTS = 3, 128


@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory):
  root, llama = tmp_path_factory.mktemp("state_shape_drafters"), fixture_dir("llama3")
  return {"draft_model": truncated_draft_model(llama, str(root / "one_layer"), 1),
          "eagle3": eagle3_head(llama, str(root / "eagle3"), 96, aux_layer_ids=(0, 1, 1))}


def _llm(drafter_dirs, target: str, method: str | None, k: int):
  if method in drafter_dirs:
    return cached_llm(target, method, k, model=drafter_dirs[method])
  return cached_llm(target, method, k)


def _layout(tree):
  return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


@pytest.mark.parametrize("target, method, k, reads_target", [
    ("llama3", None, 0, False), ("llama3", "ngram", 3, False),
    ("llama3", "draft_model", 2, False), ("llama3", "eagle3", 2, True),
    ("qwen3_dense", "mtp", 2, True)])
def test_each_drafters_state_layout_is_its_prefills_and_the_target_is_traced_only_if_read(
    monkeypatch, drafter_dirs, target, method, k, reads_target):
  llm = _llm(drafter_dirs, target, method, k)
  assert num_drafts(llm.spec) == k
  device = llm.device
  plan = LoopPlan(batch=BATCH, cache_len=SLOTS, method=method, k=k, all_greedy=True)
  forwards = []

  def counted_forward(*args, **kwargs):
    forwards.append(args[2].shape)
    return target_forward(*args, **kwargs)

  monkeypatch.setattr(slots, "target_forward", counted_forward)

  def both(target_state, draft_state):
    model, drafter = program_models(device, target_state, draft_state, plan, in_loop=False)
    assert drafter.prefill_reads_target is reads_target
    shape = slots.draft_state_shape(model, drafter, BATCH, device.ctx)
    # The layout as a prompt's prefill makes it: a real target forward over 16 positions.
    tokens = jnp.ones((BATCH, 16), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), tokens.shape)
    lens = jnp.full((BATCH,), 16, jnp.int32)
    target_out, _ = target_forward(model, drafter, tokens, positions,
                                   model.init_caches(BATCH, 16, device.ctx.dtype), 16,
                                   device.ctx.experts_fn, seq_lens_B=lens)
    return shape, drafter.prefill(tokens, lens, lens, target_out, 16)

  shape, prefilled = jax.eval_shape(both, *device.weights)
  assert _layout(shape) == _layout(prefilled)
  assert forwards == ([(BATCH, 16)] if reads_target else [])


def test_a_drafter_that_reads_the_target_but_says_it_does_not_fails_as_it_is_traced(
    monkeypatch):
  """The flag is a promise: a hidden-state head told it need not read the target's hidden
  states gets none, and tracing its prefill fails, rather than laying out a state from
  nothing."""
  llm = cached_llm("qwen3_dense", "mtp", 2)
  device = llm.device
  plan = LoopPlan(batch=BATCH, cache_len=SLOTS, method="mtp", k=2, all_greedy=True)

  def shape(target_state, draft_state):
    model, drafter = program_models(device, target_state, draft_state, plan, in_loop=False)
    monkeypatch.setattr(drafter, "prefill_reads_target", False)
    return slots.draft_state_shape(model, drafter, BATCH, device.ctx)

  with pytest.raises(AttributeError, match="hidden_BTD"):
    jax.eval_shape(shape, *device.weights)


def test_the_continuous_scheduler_learns_a_plans_layout_once(monkeypatch):
  """A start program is traced twice (its state's shardings, then the program) and again for
  each new wave layout; the drafter's layout (for an MTP head, a trace of the target's whole
  forward) is learned once per plan and serves them all."""
  probes = []
  probe = slots.draft_state_shape

  def counted(*args, **kwargs):
    probes.append(args[2])
    return probe(*args, **kwargs)

  monkeypatch.setattr(slots, "draft_state_shape", counted)
  # prefill chunks of 16 whatever the prompt (a quarter of 64): one plan for both calls
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=128,
                  max_num_seqs=2, prefill_chunk_size=64,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
  params = jspec.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
  short, long = [[3, 1, 4, 1, 5]], [list(range(7, 47))]  # prompt buckets of 16 and 64
  first = llm.generate(short, params)
  llm.generate(long, params)
  starts = llm.scheduler.start_programs
  assert len(starts) == 2 and len({key[0].loop for key in starts}) == 1
  assert probes == [1]  # one plan (a call of one request: one slot), once
  assert first[0].token_ids == cached_llm("qwen3_dense").generate(short, params)[0].token_ids
