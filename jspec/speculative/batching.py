"""Continuous batching inside the jitted loop: slots that take the next request when theirs ends.

A call's requests wait on device in a `Queue` (bucketed arrays, jspec.requests builds them).
The loop keeps `batch` slots. Before it, `start_state` prefills the first requests that fit
the slots as one batched prefill of their whole prompt bucket (a `Wave`), as a wave
scheduler would: a call whose requests all fit pays nothing for being continuous. Then each
*round* of the dispatch's `lax.while_loop`:

  1. admit (only when a slot is free and requests wait, or a prompt is in progress): each
     data-parallel shard's idle prefill lanes (`lanes` per shard: one for long prompts,
     several for short ones) take the next waiting groups (the samples of one request,
     jspec.requests) while it has a free slot for each sample;
  2. prefill: each lane runs the next `prefill_chunk` tokens of its group's prompt through
     the target (and the drafter), on the group leader's caches gathered out of the batch;
     the updated rows are written back to every slot of the group, so n samples share one
     prefill. After the last chunk each slot samples its first token (its own seed) and runs;
  3. decode: draft -> verify -> accept steps of every running slot (jspec.speculative.loop):
     one, then more in an inner loop for as long as nothing else is due (no prompt in
     progress, no slot to refill): between refills a round is the wave scheduler's loop, one
     step per iteration with no bookkeeping;
  4. harvest (only when a slot finished): finished slots are copied to the `Finished` rows and
     become free.

The loop stops after `budget` steps, when the Finished rows might not hold another batch, or
when every request is done: a *dispatch* (jspec.speculative.dispatch decides when each part of
a round is due). The host then collects the finished rows and
updates its progress while the next dispatch, already queued on the state it donated, runs
(jspec.continuous).

Exactness: a slot's computation depends only on its own request. Prefill (batched or in
chunks) starts at position 0 of each prompt whatever the slot, keys come from (seed,
position), and a slot's caches and drafter state are zeroed before its first chunk (recurrent
state and drafter state reset on refill; a KV cache needs no reset, its stale slots are
rewritten before they are read). Every shard runs the same program: a lane with nothing to
prefill computes on padding and writes nothing back (an idle lane's rows point past the shard).

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

from jspec.speculative import logprobs as logprob_lib
from jspec.speculative import sampling
from jspec.speculative.loop import (_TARGET_STREAM, LoopContext, LoopPlan, _choose, _is_stop,
                                    _stream_keys, _target_forward, decode_step,
                                    prefill_with_logits)
from jspec.speculative.drafters import make_drafter
from jspec.speculative.drafters.base import take_rows
from jspec.speculative.state import (FINISH_LENGTH, FINISH_NONE, FINISH_STOP, DecodeState,
                                     Metrics, RequestInputs)

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
class Queue:
  """The waiting requests, in admission order (jspec.requests.queue_arrays)."""
  prompt_tokens_N: jax.Array
  prompt_start_Q: jax.Array
  prompt_len_Q: jax.Array
  size_Q: jax.Array          # samples in the group; 0 for padding
  temperature_Q: jax.Array
  top_k_Q: jax.Array
  top_p_Q: jax.Array
  max_len_Q: jax.Array
  stop_ids_QX: jax.Array
  seeds_QM: jax.Array        # uint32 seed of each sample of the group

  @property
  def num_groups(self):
    return jnp.sum(self.size_Q > 0).astype(jnp.int32)


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


# ---- rows of batch-first pytrees, per shard --------------------------------------------------

def _by_shard(x, shards: int):
  return x.reshape(shards, x.shape[0] // shards, *x.shape[1:])


def gather_rows(tree, rows_DR, shards: int):
  """Rows `rows_DR` (local to each shard) of every [B, ...] leaf, as [D * R, ...]. Written as
  a gather batched over the shard axis, so each shard reads only its own rows."""
  def take(x):
    picked = jax.vmap(lambda x_b, i_R: jnp.take(x_b, i_R, axis=0, mode="clip"))(
        _by_shard(x, shards), rows_DR)
    return picked.reshape((rows_DR.size,) + x.shape[1:])  # explicit: leaves may be empty
  return jax.tree.map(take, tree)


def scatter_rows(tree, rows_DR, values, shards: int):
  """`tree` with rows `rows_DR` (local) of every leaf replaced by `values` ([D * R, ...]);
  a row index past the shard's rows writes nothing."""
  def put(x, v):
    v_DR = v.reshape(rows_DR.shape + x.shape[1:])
    out = jax.vmap(lambda x_b, i_R, v_R: x_b.at[i_R].set(v_R, mode="drop"))(
        _by_shard(x, shards), rows_DR, v_DR)
    return out.reshape(x.shape)
  return jax.tree.map(put, tree, values)


def _select_rows(flag_N, new, old):
  """new where flag_N, else old, leaf by leaf ([N, ...] leaves)."""
  def pick(a, b):
    return jnp.where(flag_N.reshape(-1, *([1] * (a.ndim - 1))), a, b)
  return jax.tree.map(pick, new, old)


# ---- the state -------------------------------------------------------------------------------

def _draft_state_shape(target, drafter, batch: int, ctx: LoopContext):
  """The drafter's state for `batch` rows, abstractly: what its `prefill` returns for them
  (its caches are sized by the plan, whatever the prompt)."""
  def prefill_small():
    tokens_BP = jnp.zeros((batch, 16), jnp.int32)
    positions_BP = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), tokens_BP.shape)
    lens_B = jnp.ones((batch,), jnp.int32)
    caches = target.init_caches(batch, 16, ctx.dtype)
    target_out, _ = _target_forward(target, drafter, tokens_BP, positions_BP, caches, 16,
                                    ctx.experts_fn, seq_lens_B=lens_B)
    return drafter.prefill(tokens_BP, lens_B, lens_B, target_out)
  return jax.eval_shape(prefill_small)


def init_state(target, drafter, queue: Queue, plan: BatchPlan, ctx: LoopContext) -> BatchState:
  """Every slot free; caches allocated (their contents are never read before written)."""
  from jspec.models import caches as cache_lib
  lp, batch, shards = plan.loop, plan.loop.batch, plan.shards
  caches = cache_lib.constrain(target.init_caches(batch, lp.cache_len, ctx.dtype),
                               ctx.cache_shardings)
  draft = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                       _draft_state_shape(target, drafter, batch, ctx))
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


def start_state(target, draft_module, queue: Queue, wave: Wave | None, plan: BatchPlan,
                ctx: LoopContext, wave_chunk: int) -> BatchState:
  """The state a call's first dispatch starts from: every slot free (`wave` None), or the
  wave's slots running, their prompts prefilled in one batched pass of `wave_chunk` tokens
  at a time (jspec.speculative.loop.prefill), each with its first token sampled."""
  lp = plan.loop
  drafter = make_drafter(lp.method, target, draft_module, lp, ctx)
  state = init_state(target, drafter, queue, plan, ctx)
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
      target, draft_module, wave.tokens_BP, wave.prompt_lens_B, req,
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


# ---- 1. admit --------------------------------------------------------------------------------

def admit(state: BatchState, queue: Queue, plan: BatchPlan) -> BatchState:
  """Each shard's idle prefill lanes take the next groups, in queue order, while the shard
  has a free slot for every sample of them; a group's slots are the shard's first free ones
  (in group order), its leader the first of them. Shard by shard (a few small arrays each)."""
  shards, batch, lp, lanes, group = plan.shards, plan.loop.batch, plan.loop, plan.lanes, plan.group
  per_shard = batch // shards
  free_Db = _by_shard(state.phase_B == FREE, shards)
  rank_Db = jnp.cumsum(free_Db, axis=1)                # 1-based rank among free slots
  idle_DR = state.prefill_group_L.reshape(shards, lanes) < 0
  num_groups, last_q = queue.num_groups, queue.size_Q.shape[0] - 1
  j_R = jnp.arange(lanes, dtype=jnp.int32)
  nxt = state.next_group
  group_DR, took_DR, slot_group_Db, member_Db, rows_DRM = [], [], [], [], []
  for d in range(shards):
    # Candidate groups nxt, nxt+1, ...: a prefix of them fits the idle lanes and free slots.
    cand_R = nxt + j_R
    size_R = jnp.where(cand_R < num_groups, queue.size_Q[jnp.minimum(cand_R, last_q)], 0)
    cum_R = jnp.cumsum(size_R)
    fits_R = ((cand_R < num_groups) & (cum_R <= rank_Db[d, -1])
              & (j_R < jnp.sum(idle_DR[d])))
    count = jnp.sum(jnp.cumprod(fits_R.astype(jnp.int32)))
    # The j-th idle lane takes group nxt + j.
    lane_rank_R = jnp.cumsum(idle_DR[d])
    took_R = idle_DR[d] & (lane_rank_R <= count)
    j_of_lane_R = jnp.clip(lane_rank_R - 1, 0, lanes - 1)
    group_DR.append(nxt + j_of_lane_R)
    took_DR.append(took_R)
    # Free slot of rank t goes to taken group j with cum[j-1] < t <= cum[j].
    total = jnp.where(count > 0, cum_R[jnp.maximum(count - 1, 0)], 0)
    j_of_slot_b = jnp.clip(jnp.searchsorted(cum_R, rank_Db[d], side="left"), 0, lanes - 1)
    chosen_b = free_Db[d] & (rank_Db[d] <= total)
    slot_group_Db.append(jnp.where(chosen_b, nxt + j_of_slot_b, -1))
    member_Db.append(rank_Db[d] - (cum_R[j_of_slot_b] - size_R[j_of_slot_b]) - 1)
    # Lane r's member m sits in the free slot of rank cum[j-1] + m + 1 (the leader repeated
    # past the group's size).
    first_R = cum_R[j_of_lane_R] - size_R[j_of_lane_R]
    m_M = jnp.arange(group, dtype=jnp.int32)
    want_RM = first_R[:, None] + jnp.minimum(m_M[None], size_R[j_of_lane_R][:, None] - 1) + 1
    hit_RMb = free_Db[d][None, None] & (rank_Db[d][None, None] == want_RM[..., None])
    rows_DRM.append(jnp.argmax(hit_RMb, axis=-1).astype(jnp.int32) + d * per_shard)
    nxt = nxt + count.astype(jnp.int32)
  took_L = jnp.stack(took_DR).reshape(-1)
  group_L = jnp.stack(group_DR).reshape(-1)
  rows_LM = jnp.stack(rows_DRM).reshape(-1, group)
  group_B = jnp.stack(slot_group_Db).reshape(batch)
  member_B = jnp.stack(member_Db).reshape(batch).astype(jnp.int32)
  chosen_B = group_B >= 0
  group_B = jnp.maximum(group_B, 0)

  pick = lambda new, old: jnp.where(chosen_B.reshape(-1, *([1] * (old.ndim - 1))), new, old)
  req = state.req
  req = RequestInputs(
      temperature_B=pick(queue.temperature_Q[group_B], req.temperature_B),
      top_k_B=pick(queue.top_k_Q[group_B], req.top_k_B),
      top_p_B=pick(queue.top_p_Q[group_B], req.top_p_B),
      max_len_B=pick(queue.max_len_Q[group_B], req.max_len_B),
      stop_ids_BX=pick(queue.stop_ids_QX[group_B], req.stop_ids_BX),
      seeds_B=pick(queue.seeds_QM[group_B, jnp.clip(member_B, 0, group - 1)], req.seeds_B))
  metrics = jax.tree.map(lambda x: pick(jnp.zeros_like(x), x), state.decode.metrics)
  decode = state.decode.replace(
      lengths_B=pick(jnp.int32(lp.cache_len - lp.k - 1), state.decode.lengths_B),
      done_B=state.decode.done_B | chosen_B,
      finish_B=pick(jnp.int32(FINISH_NONE), state.decode.finish_B), metrics=metrics)
  return state.replace(
      decode=decode, req=req, phase_B=pick(jnp.int32(PREFILL), state.phase_B),
      group_B=pick(group_B, state.group_B), member_B=pick(member_B, state.member_B),
      prompt_len_B=pick(queue.prompt_len_Q[group_B], state.prompt_len_B),
      prefill_group_L=jnp.where(took_L, group_L, state.prefill_group_L),
      prefill_pos_L=jnp.where(took_L, 0, state.prefill_pos_L),
      prefill_rows_LM=jnp.where(took_L[:, None], rows_LM, state.prefill_rows_LM),
      next_group=nxt)


# ---- 2. prefill ------------------------------------------------------------------------------

def prefill_chunk(target, drafter, state: BatchState, queue: Queue, plan: BatchPlan,
                  ctx: LoopContext) -> BatchState:
  """The next chunk of every lane's prompt in prefill (see the module docstring). Lanes
  (plan.lanes per shard) stand for the rows of the batch: the L leaders' caches are gathered
  into an [L, C] forward, and written back to their L x M member slots."""
  lp, shards, group, lanes = plan.loop, plan.shards, plan.group, plan.lanes
  chunk, slots, per_shard = lp.prefill_chunk, lp.cache_len, lp.batch // shards
  active_L = state.prefill_group_L >= 0
  g_L = jnp.maximum(state.prefill_group_L, 0)
  pos_L = state.prefill_pos_L
  prompt_len_L = jnp.where(active_L, queue.prompt_len_Q[g_L], 0)
  start_L = queue.prompt_start_Q[g_L]
  num_tokens = queue.prompt_tokens_N.shape[0]

  positions_LC = pos_L[:, None] + jnp.arange(chunk, dtype=jnp.int32)
  def prompt_at(offset):
    index_LC = jnp.clip(start_L[:, None] + positions_LC + offset, 0, num_tokens - 1)
    valid_LC = positions_LC + offset < prompt_len_L[:, None]
    return jnp.where(valid_LC, queue.prompt_tokens_N[index_LC], 0)
  tokens_LC, next_LC = prompt_at(0), prompt_at(1)
  # Padding positions past the cache write (harmlessly) into its last slot.
  cache_positions_LC = jnp.minimum(positions_LC, slots - 1)

  rows_LM = state.prefill_rows_LM - (jnp.arange(shards * lanes) // lanes * per_shard)[:, None]
  fresh_L = active_L & (pos_L == 0)
  dec = state.decode
  leader = gather_rows(dec.target_caches, rows_LM[:, 0].reshape(shards, lanes), shards)
  leader = _select_rows(fresh_L, jax.tree.map(jnp.zeros_like, leader), leader)
  target_out, new_leader = _target_forward(target, drafter, tokens_LC, cache_positions_LC,
                                           leader, slots, ctx.experts_fn,
                                           seq_lens_B=prompt_len_L)
  # Local rows of (lane, member), by shard; an idle lane's rows (stale, maybe another lane's)
  # point past the shard, so that nothing is written there: its padding rows are dropped by
  # the scatter, not selected away. The written rows depend on the caches only through the
  # forward, and the barrier keeps XLA from fusing the leader's gather into the scatter: a
  # scatter fusion that reads its own operand elsewhere cannot run in place, and XLA copied
  # the whole cache (twice) around it.
  rows_flat = jnp.where(active_L[:, None], rows_LM, per_shard).reshape(shards, lanes * group)
  members = lambda x: jnp.repeat(x, group, axis=0)  # [L, ...] -> [L * M, ...]
  target_caches = scatter_rows(dec.target_caches, rows_flat, jax.lax.optimization_barrier(
      jax.tree.map(members, new_leader)), shards)

  # The last chunk: each member samples its first token at position prompt_len.
  final_L = active_L & (pos_L + chunk >= prompt_len_L)
  last_L = jnp.clip(prompt_len_L - 1 - pos_L, 0, chunk - 1)
  logits_LV = target.logits(take_rows(target_out.hidden_BTD, last_L)[:, None])[:, 0]
  member_req = gather_rows(state.req, rows_flat, shards)
  prompt_len_N = members(prompt_len_L)
  keys_N = sampling.position_keys(_stream_keys(member_req, _TARGET_STREAM),
                                  prompt_len_N[:, None])[:, 0]
  logits_NV = members(logits_LV)
  first_N, _ = _choose(logits_NV, member_req.temperature_B, member_req.top_k_B,
                       member_req.top_p_B, keys_N, lp)

  # The drafter sees each member's own first token after the prompt.
  final_N, active_N, fresh_N = members(final_L), members(active_L), members(fresh_L)
  next_NC = members(next_LC)
  last_N = members(last_L)
  next_NC = jnp.where(final_N[:, None] & (jnp.arange(chunk)[None] == last_N[:, None]),
                      first_N[:, None], next_NC)
  draft_rows = gather_rows(dec.draft, rows_flat, shards)
  draft_rows = _select_rows(fresh_N, jax.tree.map(jnp.zeros_like, draft_rows), draft_rows)
  new_draft = drafter.prefill_chunk(draft_rows, members(tokens_LC), members(cache_positions_LC),
                                    next_NC, prompt_len_N, last_N,
                                    jax.tree.map(members, target_out))
  draft = scatter_rows(dec.draft, rows_flat, jax.lax.optimization_barrier(new_draft), shards)

  # Members that finished their prompt: tokens, length, first finish check, logprobs.
  member_tokens_NS = _prompt_rows(queue, members(start_L), prompt_len_N, slots)
  member_tokens_NS = jnp.where(jnp.arange(slots)[None] == prompt_len_N[:, None],
                               first_N[:, None], member_tokens_NS)
  stop_N = _is_stop(first_N[:, None], member_req.stop_ids_BX)[:, 0]
  finish_N = jnp.where(stop_N, FINISH_STOP,
                       jnp.where(prompt_len_N + 1 >= member_req.max_len_B, FINISH_LENGTH,
                                 FINISH_NONE))
  put = lambda tree, values: _put_rows(tree, rows_flat, values, final_N, shards, per_shard)
  # The first token is out at the end of this round (the clock's next value).
  member_emitted_NS = jnp.where(jnp.arange(slots)[None] == prompt_len_N[:, None], dec.step + 1,
                                0)
  decode = dec.replace(
      tokens_BS=put(dec.tokens_BS, member_tokens_NS),
      emitted_at_BS=put(dec.emitted_at_BS, member_emitted_NS),
      lengths_B=put(dec.lengths_B, prompt_len_N + 1),
      done_B=put(dec.done_B, finish_N != FINISH_NONE), finish_B=put(dec.finish_B, finish_N),
      target_caches=target_caches, draft=draft)
  logprobs = state.logprobs
  if logprobs is not None:
    first = logprob_lib.token_logprobs(logits_NV, first_N, plan.num_logprobs)
    rows = gather_rows(logprobs, rows_flat, shards)
    rows = SlotLogprobs(rows.logprob_BO.at[:, 0].set(first.logprob_N),
                        rows.rank_BO.at[:, 0].set(first.rank_N),
                        rows.top_ids_BOX.at[:, 0].set(first.top_ids_NX),
                        rows.top_logprobs_BOX.at[:, 0].set(first.top_logprobs_NX))
    logprobs = put(logprobs, rows)
  return state.replace(
      decode=decode, logprobs=logprobs,
      phase_B=put(state.phase_B, jnp.full(final_N.shape, RUN, jnp.int32)),
      prefill_group_L=jnp.where(final_L, -1, state.prefill_group_L),
      prefill_pos_L=jnp.where(active_L, pos_L + chunk, pos_L))


def _prompt_rows(queue: Queue, start_N, prompt_len_N, slots: int):
  """[N, S] token rows: each prompt, zeros after it."""
  positions_S = jnp.arange(slots, dtype=jnp.int32)
  index_NS = jnp.clip(start_N[:, None] + positions_S, 0, queue.prompt_tokens_N.shape[0] - 1)
  return jnp.where(positions_S[None] < prompt_len_N[:, None], queue.prompt_tokens_N[index_NS], 0)


def _put_rows(tree, rows_DM, values, flag_N, shards: int, per_shard: int):
  """`tree` with its rows `rows_DM` (local) set to `values` where flag_N; the rows not
  flagged are pointed past the shard and dropped. A member repeated within its group (a
  group smaller than M repeats its leader) writes the leader's own values twice."""
  rows_DM = jnp.where(flag_N.reshape(rows_DM.shape), rows_DM, per_shard)
  return scatter_rows(tree, rows_DM, values, shards)


# ---- 3. decode and 4. harvest ----------------------------------------------------------------

def decode(target, draft_module, state: BatchState, plan: BatchPlan,
           ctx: LoopContext) -> BatchState:
  """One step of every running slot; generated tokens' logprobs into the slots' buffers."""
  lp = plan.loop
  before_B = state.decode.lengths_B
  running_B = ~state.decode.done_B
  decoded, out = decode_step(target, draft_module, state.decode, state.req, lp, ctx)
  logprobs = state.logprobs
  if logprobs is not None:
    # Token t of the window is generated token (length - prompt_len + t) of its slot.
    offsets_T = jnp.arange(lp.k + 1, dtype=jnp.int32)
    index_BT = before_B[:, None] - state.prompt_len_B[:, None] + offsets_T
    emitted_BT = running_B[:, None] & (offsets_T[None] < out.num_emit_B[:, None])
    index_BT = jnp.where(emitted_BT, index_BT, plan.out_len)  # dropped
    rows_B1 = jnp.arange(lp.batch)[:, None]
    write = lambda buf, v: buf.at[rows_B1, index_BT].set(v, mode="drop")
    w = out.logprobs
    logprobs = SlotLogprobs(write(logprobs.logprob_BO, w.logprob_N),
                            write(logprobs.rank_BO, w.rank_N),
                            write(logprobs.top_ids_BOX, w.top_ids_NX),
                            write(logprobs.top_logprobs_BOX, w.top_logprobs_NX))
  return state.replace(decode=decoded, logprobs=logprobs)


def harvest(state: BatchState, finished: Finished, plan: BatchPlan):
  """Finished slots copied to the next Finished rows, then freed."""
  dec, lp = state.decode, plan.loop
  done_B = (state.phase_B == RUN) & dec.done_B
  dest_B = finished.count + jnp.cumsum(done_B.astype(jnp.int32)) - 1
  dest_B = jnp.where(done_B, dest_B, plan.finished_rows)  # out of range: dropped
  positions_BO = state.prompt_len_B[:, None] + jnp.arange(plan.out_len, dtype=jnp.int32)
  positions_BO = jnp.minimum(positions_BO, lp.cache_len - 1)
  tokens_BO = jnp.take_along_axis(dec.tokens_BS, positions_BO, axis=1)
  emitted_at_BO = jnp.take_along_axis(dec.emitted_at_BS, positions_BO, axis=1)
  put = lambda buf, v: buf.at[dest_B].set(v.astype(buf.dtype), mode="drop")
  m = dec.metrics
  finished = finished.replace(
      group_F=put(finished.group_F, state.group_B),
      member_F=put(finished.member_F, state.member_B),
      tokens_FO=put(finished.tokens_FO, tokens_BO),
      emitted_at_FO=put(finished.emitted_at_FO, emitted_at_BO),
      num_tokens_F=put(finished.num_tokens_F, dec.lengths_B - state.prompt_len_B),
      finish_F=put(finished.finish_F, dec.finish_B),
      num_steps_F=put(finished.num_steps_F, m.num_steps_B),
      drafted_at_FK=put(finished.drafted_at_FK, m.drafted_at_BK),
      accepted_at_FK=put(finished.accepted_at_FK, m.accepted_at_BK),
      logprobs=(None if state.logprobs is None else
                jax.tree.map(put, finished.logprobs, state.logprobs)),
      count=finished.count + jnp.sum(done_B).astype(jnp.int32))
  placeholder = lp.cache_len - lp.k - 1
  free = lambda x, v: jnp.where(done_B, v, x)
  state = state.replace(phase_B=free(state.phase_B, FREE),
                        decode=dec.replace(lengths_B=free(dec.lengths_B, placeholder)))
  return state, finished
