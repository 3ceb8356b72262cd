"""The loop learns a drafter's state layout (jspec.loop.slots.draft_state_shape) before any
program runs: the slots' initial state holds zeros of it. Every drafter's layout is the one its
`prefill` gives after a real target forward, and the target's forward is traced for it only
where the drafter's prefill reads the target's hidden states (hidden-state heads: MTP,
EAGLE-3); for none, n-gram and draft models it is not traced at all."""

import jax
import pytest

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
    tokens = jax.numpy.ones((BATCH, 16), jax.numpy.int32)
    positions = jax.numpy.broadcast_to(jax.numpy.arange(16, dtype=jax.numpy.int32),
                                       tokens.shape)
    lens = jax.numpy.full((BATCH,), 16, jax.numpy.int32)
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
