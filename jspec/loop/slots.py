"""The continuous loop's slots: their state, what a dispatch hands back, and the state a call
starts from (every slot free, or the first requests prefilled together as a wave would).

Slot phases: FREE -> PREFILL (admitted, prompt in progress) -> RUN -> FREE (harvested); the
batched prefill takes a slot from FREE to RUN at once. A slot that is not running holds the
placeholder length `cache_len - k - 1`, so the decode step's writes for it land past any
prompt it holds (cache_len >= max_len + k + 1).

Shape letters: B slots, D data-parallel shards (dp x ep), b = B / D slots per shard,
M samples per group, C prefill chunk, P batched-prefill prompt bucket, S cache slots, Q queue
groups, N queued prompt tokens, O output tokens per slot, F finished rows, X logprob
alternatives, K drafts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jspec.models import caches as cache_lib
from jspec.speculative import logprobs as logprob_lib
from jspec.loop.waves import prefill_with_logits
from jspec.loop.queue import Queue
from jspec.loop.state import FINISH_NONE, DecodeState, Metrics, RequestInputs
from jspec.loop.step import LoopContext, LoopPlan, target_forward

FREE, PREFILL, RUN = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """Static sizes of one continuous-batching program (hashable: keys the compile cache)."""
  loop: LoopPlan             # batch = slots, cache_len, drafter, k, sampling paths
  shards: int                # D: data-parallel shards the slots are split over
  group: int                 # M: samples per queued group at most
  out_len: int               # O: generated tokens a slot can hold (>= the largest max_tokens)
  finished_rows: int         # F: rows per dispatch for finished slots (>= 2 x slots)
  lanes: int = 1             # R: prompts each shard prefills side by side per iteration

  @property
  def num_logprobs(self) -> int | None:
    return self.loop.num_logprobs


@struct.dataclass
class SlotLogprobs:
  """Per slot (or finished row), per generated token: jspec.speculative.logprobs fields."""
  logprob_BO: jax.Array
  rank_BO: jax.Array
  top_ids_BOX: jax.Array
  top_logprobs_BOX: jax.Array

  @classmethod
  def zeros(cls, rows: int, out_len: int, num_top: int) -> "SlotLogprobs":
    return cls(jnp.zeros((rows, out_len), jnp.float32), jnp.zeros((rows, out_len), jnp.int32),
               jnp.zeros((rows, out_len, num_top), jnp.int32),
               jnp.zeros((rows, out_len, num_top), jnp.float32))


@struct.dataclass
class BatchState:
  decode: DecodeState
  req: RequestInputs         # each slot's sampling settings (its request's)
  phase_B: jax.Array
  group_B: jax.Array         # the queue group in the slot (-1: none yet)
  member_B: jax.Array        # which sample of that group
  prompt_len_B: jax.Array
  logprobs: SlotLogprobs | None
  # Prefill lanes, R per shard (lane l on shard l // R):
  prefill_group_L: jax.Array  # the group the lane is prefilling, -1: none
  prefill_pos_L: jax.Array    # its next prompt position
  prefill_rows_LM: jax.Array  # its slots (global rows, leader first; the leader repeated)
  next_group: jax.Array       # the first group not yet admitted
  iteration: jax.Array        # iterations in this dispatch


@struct.dataclass
class Finished:
  """Slots that finished during one dispatch, `count` rows filled."""
  group_F: jax.Array
  member_F: jax.Array
  tokens_FO: jax.Array
  emitted_at_FO: jax.Array   # each token's clock value (DecodeState.emitted_at_BS)
  num_tokens_F: jax.Array
  finish_F: jax.Array
  num_steps_F: jax.Array
  drafted_at_FK: jax.Array
  accepted_at_FK: jax.Array
  logprobs: SlotLogprobs | None
  count: jax.Array
  iterations: jax.Array      # decode steps (rounds) the dispatch ran
  clock: jax.Array           # the loop's clock (DecodeState.step) when the dispatch ended
  all_done: jax.Array        # no request left running or waiting: no further dispatch needed

  @classmethod
  def empty(cls, plan: BatchPlan) -> "Finished":
    f, o, k = plan.finished_rows, plan.out_len, max(plan.loop.k, 1)
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
    logprobs = (None if plan.num_logprobs is None else
                SlotLogprobs.zeros(f, o, plan.num_logprobs))
    return cls(zeros(f), zeros(f), zeros(f, o), zeros(f, o), zeros(f), zeros(f), zeros(f),
               zeros(f, k), zeros(f, k), logprobs, jnp.int32(0), jnp.int32(0), jnp.int32(0),
               jnp.zeros((), bool))


def draft_state_shape(target, drafter, batch: int, ctx: LoopContext):
  """The drafter's state for `batch` rows, abstractly: what its `prefill` returns for them
  (its caches are sized by the plan, whatever the prompt). The target's forward is traced
  for it only where the drafter's prefill reads its outputs (Drafter.prefill_reads_target)."""
  def prefill_small():
    tokens_BP = jnp.zeros((batch, 16), jnp.int32)
    lens_B = jnp.ones((batch,), jnp.int32)
    target_out = None
    if drafter.prefill_reads_target:
      positions_BP = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), tokens_BP.shape)
      caches = target.init_caches(batch, 16, ctx.dtype)
      target_out, _ = target_forward(target, drafter, tokens_BP, positions_BP, caches, 16,
                                      ctx.experts_fn, seq_lens_B=lens_B)
    return drafter.prefill(tokens_BP, lens_B, lens_B, target_out, 16)
  return jax.eval_shape(prefill_small)


def cached_draft_layout(layouts: dict, target, drafter, loop: LoopPlan, ctx: LoopContext):
  """draft_state_shape's layout for programs of `loop`, kept in `layouts` (a scheduler's, keyed
  by plan): traced once per plan. A continuous call's start program is traced twice (its
  state's shardings, then the program) and again for each new queue or wave layout, and for
  MTP and EAGLE-3 heads the layout takes a trace of the target's whole forward."""
  if loop not in layouts:
    layouts[loop] = draft_state_shape(target, drafter, loop.batch, ctx)
  return layouts[loop]


def init_state(target, drafter, queue: Queue, plan: BatchPlan, ctx: LoopContext,
               draft_layout=None) -> BatchState:
  """Every slot free; caches allocated (their contents are never read before written).
  draft_layout: draft_state_shape's for this plan where the caller has it (None: traced)."""
  lp, batch, shards = plan.loop, plan.loop.batch, plan.shards
  caches = cache_lib.constrain(target.init_caches(batch, lp.cache_len, ctx.dtype),
                               ctx.cache_shardings)
  if draft_layout is None:
    draft_layout = draft_state_shape(target, drafter, batch, ctx)
  draft = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), draft_layout)
  placeholder = lp.cache_len - lp.k - 1
  decode = DecodeState(
      tokens_BS=jnp.zeros((batch, lp.cache_len), jnp.int32),
      lengths_B=jnp.full((batch,), placeholder, jnp.int32),
      done_B=jnp.ones((batch,), bool), finish_B=jnp.zeros((batch,), jnp.int32),
      target_caches=caches, draft=draft, metrics=Metrics.zeros(batch, lp.k),
      step=jnp.int32(0), emitted_at_BS=jnp.zeros((batch, lp.cache_len), jnp.int32))
  req = RequestInputs(temperature_B=jnp.zeros((batch,), jnp.float32),
                      top_k_B=jnp.zeros((batch,), jnp.int32),
                      top_p_B=jnp.ones((batch,), jnp.float32),
                      max_len_B=jnp.zeros((batch,), jnp.int32),
                      stop_ids_BX=jnp.full((batch, queue.stop_ids_QX.shape[1]), -1, jnp.int32),
                      seeds_B=jnp.zeros((batch,), jnp.uint32))
  minus = lambda *shape: jnp.full(shape, -1, jnp.int32)
  logprobs = (None if plan.num_logprobs is None else
              SlotLogprobs.zeros(batch, plan.out_len, plan.num_logprobs))
  lanes = shards * plan.lanes
  first_rows_LM = jnp.broadcast_to(
      (jnp.arange(lanes) // plan.lanes * (batch // shards))[:, None],
      (lanes, plan.group)).astype(jnp.int32)
  return BatchState(decode=decode, req=req, phase_B=jnp.zeros((batch,), jnp.int32),
                    group_B=minus(batch), member_B=jnp.zeros((batch,), jnp.int32),
                    prompt_len_B=jnp.ones((batch,), jnp.int32), logprobs=logprobs,
                    prefill_group_L=minus(lanes), prefill_pos_L=jnp.zeros((lanes,), jnp.int32),
                    prefill_rows_LM=first_rows_LM, next_group=jnp.int32(0),
                    iteration=jnp.int32(0))


@struct.dataclass
class Wave:
  """The first groups of a call, prefilled together before the loop: slot b takes queue group
  `group_B[b]` (-1: none; groups 0 .. W-1, so the loop's admission resumes at group W) with
  its prompt in row b of `tokens_BP`. Only for groups of one sample (n = 1)."""
  tokens_BP: jax.Array
  prompt_lens_B: jax.Array
  group_B: jax.Array


def start_state(target, drafter, queue: Queue, wave: Wave | None, plan: BatchPlan,
                ctx: LoopContext, wave_chunk: int, draft_layout=None) -> BatchState:
  """The state a call's first dispatch starts from: every slot free (`wave` None), or the
  wave's slots running, their prompts prefilled in one batched pass of `wave_chunk` tokens
  at a time (jspec.loop.waves.prefill), each with its first token sampled. draft_layout: as
  init_state's."""
  lp = plan.loop
  state = init_state(target, drafter, queue, plan, ctx, draft_layout)
  if wave is None:
    return state
  assigned_B = wave.group_B >= 0
  g_B = jnp.maximum(wave.group_B, 0)
  def pick(new, old):
    new, old = jnp.asarray(new), jnp.asarray(old)
    return jnp.where(assigned_B.reshape(-1, *([1] * (max(new.ndim, old.ndim) - 1))), new, old)
  r = state.req
  req = RequestInputs(
      temperature_B=pick(queue.temperature_Q[g_B], r.temperature_B),
      top_k_B=pick(queue.top_k_Q[g_B], r.top_k_B), top_p_B=pick(queue.top_p_Q[g_B], r.top_p_B),
      max_len_B=pick(queue.max_len_Q[g_B], r.max_len_B),  # 0 for a free slot: done at once
      stop_ids_BX=pick(queue.stop_ids_QX[g_B], r.stop_ids_BX),
      seeds_B=pick(queue.seeds_QM[g_B, 0], r.seeds_B))
  dec, logits_BV = prefill_with_logits(
      target, drafter, wave.tokens_BP, wave.prompt_lens_B, req,
      dataclasses.replace(lp, prefill_chunk=wave_chunk), ctx)
  # The drafter's state must be laid out as the loop expects it, whatever the prompt bucket.
  expected = jax.tree.map(lambda x: (x.shape, x.dtype), state.decode.draft)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), dec.draft) == expected, "drafter state"
  placeholder = lp.cache_len - lp.k - 1
  dec = dec.replace(lengths_B=pick(dec.lengths_B, placeholder),
                    done_B=pick(dec.done_B, True),
                    finish_B=pick(dec.finish_B, FINISH_NONE))
  logprobs = state.logprobs
  if logprobs is not None:
    first_B = jnp.take_along_axis(dec.tokens_BS, wave.prompt_lens_B[:, None], axis=1)[:, 0]
    first = logprob_lib.token_logprobs(logits_BV, first_B, plan.num_logprobs)
    logprobs = SlotLogprobs(logprobs.logprob_BO.at[:, 0].set(first.logprob_N),
                            logprobs.rank_BO.at[:, 0].set(first.rank_N),
                            logprobs.top_ids_BOX.at[:, 0].set(first.top_ids_NX),
                            logprobs.top_logprobs_BOX.at[:, 0].set(first.top_logprobs_NX))
  return state.replace(
      decode=dec, req=req, logprobs=logprobs,
      phase_B=jnp.where(assigned_B, RUN, FREE).astype(jnp.int32),
      group_B=jnp.where(assigned_B, g_B, -1),
      prompt_len_B=jnp.where(assigned_B, wave.prompt_lens_B, 1),
      next_group=jnp.sum(assigned_B).astype(jnp.int32))
