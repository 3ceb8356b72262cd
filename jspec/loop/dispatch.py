"""A dispatch of the continuous-batching loop: its rounds, and which of their parts are due.

jspec.loop.slots holds the slots, jspec.loop.rounds what happens to them
(admit, prefill a chunk, decode, harvest); this module decides, inside the jitted
`lax.while_loop`, when each runs: admission and prefill only when a slot is free and requests
wait (or a prompt is in progress), decode steps in an inner loop for as long as nothing else
is due, harvest only when a slot finished. Conditional parts run as one-trip while loops (`run_if`), never `lax.cond`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.loop.rounds import admit, decode, harvest, prefill_chunk
from jspec.loop.queue import Queue
from jspec.loop.slots import FREE, RUN, BatchPlan, BatchState, Finished
from jspec.loop.step import LoopContext


def run_if(flag, fn, operand):
  """fn(operand) where `flag`, else operand: a while loop of zero or one trip, not a
  `lax.cond`. XLA's GPU compiler gives a conditional's results buffers of their own: with the
  prefill chunk under a cond, the branch that returns its operand copied all 72 KV-cache
  buffers of the target (Qwen3-8B shapes, 64 slots: 72 copies of 128 MB, in the optimized
  HLO). A loop updates its carry in place."""
  def body(carry):
    _, x = carry
    return jnp.zeros((), bool), fn(x)
  return jax.lax.while_loop(lambda carry: carry[0], body, (flag, operand))[1]


def has_work(state: BatchState, queue: Queue):
  return jnp.any(state.phase_B != FREE) | (state.next_group < queue.num_groups)


def _waiting(state: BatchState, queue: Queue):
  return state.next_group < queue.num_groups


def admission_due(state: BatchState, queue: Queue):
  """A prompt is in progress, or requests wait and a slot is free."""
  return jnp.any(state.prefill_group_L >= 0) | (
      _waiting(state, queue) & jnp.any(state.phase_B == FREE))


def steps_may_continue(state: BatchState, queue: Queue):
  """Nothing but decoding is due: no prompt in progress, and no slot that is (or has just
  become) free while requests wait."""
  refill = _waiting(state, queue) & jnp.any((state.phase_B == FREE) | state.decode.done_B
                                            & (state.phase_B == RUN))
  return ~jnp.any(state.prefill_group_L >= 0) & ~refill


def dispatch(target, drafter, state: BatchState, queue: Queue, budget, plan: BatchPlan,
             ctx: LoopContext, admits: bool = True):
  """Rounds until `budget` decode steps ran, the Finished rows might not hold one more batch,
  or every request is done: (state, Finished). `admits` False: a call whose requests all
  started in the first wave, for which admission is never due; the program leaves it out
  (and the prefill chunk with it)."""
  lp = plan.loop
  state = state.replace(iteration=jnp.int32(0))

  def admit_and_prefill(s):
    s = admit(s, queue, plan, ctx.replicated)
    return run_if(jnp.any(s.prefill_group_L >= 0),
                  lambda s: prefill_chunk(target, drafter, s, queue, plan, ctx), s)

  def decode_steps(s):
    # The first step whenever a slot runs; further ones while nothing else is due, so that
    # between refills a step pays for nothing but itself (one loop condition, as the wave
    # scheduler's loop). Not under lax.cond, for the reason run_if gives.
    def cond(carry):
      s, first = carry
      return (jnp.any(~s.decode.done_B) & (s.iteration < budget)
              & (first | steps_may_continue(s, queue)))

    def body(carry):
      s, _ = carry
      s = decode(target, drafter, s, plan, ctx)
      return s.replace(iteration=s.iteration + 1), jnp.zeros((), bool)

    return jax.lax.while_loop(cond, body, (s, jnp.ones((), bool)))[0]

  def cond(carry):
    s, f = carry
    return has_work(s, queue) & (s.iteration < budget) & (
        f.count <= plan.finished_rows - lp.batch)

  def body(carry):
    s, f = carry
    begin = s.iteration
    if admits:
      s = run_if(admission_due(s, queue), admit_and_prefill, s)
    s = decode_steps(s)
    # A round with no running slot (prompts only) still advances the clock and the budget.
    idle = (s.iteration == begin).astype(jnp.int32)
    s = s.replace(iteration=s.iteration + idle,
                  decode=s.decode.replace(step=s.decode.step + idle))
    return run_if(jnp.any((s.phase_B == RUN) & s.decode.done_B),
                  lambda sf: harvest(*sf, plan), (s, f))

  state, finished = jax.lax.while_loop(cond, body, (state, Finished.empty(plan)))
  return state, finished.replace(iterations=state.iteration, clock=state.decode.step,
                                 all_done=~has_work(state, queue))
