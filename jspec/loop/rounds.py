"""Continuous batching inside the jitted loop: slots that take the next request when theirs ends.

A call's requests wait on device in a `Queue` (jspec.loop.queue).
The loop keeps `batch` slots. Before it, `start_state`
(jspec.loop.slots) prefills the first requests that fit
the slots as one batched prefill of their whole prompt bucket (a `Wave`), as a wave
scheduler would: a call whose requests all fit pays nothing for being continuous. Then each
*round* of the dispatch's `lax.while_loop`:

  1. admit (only when a slot is free and requests wait, or a prompt is in progress): each
     data-parallel shard's idle prefill lanes (`lanes` per shard: one for long prompts,
     several for short ones) take the next waiting groups (the samples of one request,
     jspec.loop.queue) while it has a free slot for each sample;
  2. prefill: each lane runs the next `prefill_chunk` tokens of its group's prompt through
     the target (and the drafter), on the group leader's caches gathered out of the batch;
     the updated rows are written back to every slot of the group, so n samples share one
     prefill. After the last chunk each slot samples its first token (its own seed) and runs;
  3. decode: draft -> verify -> accept steps of every running slot (jspec.loop.step):
     one, then more in an inner loop for as long as nothing else is due (no prompt in
     progress, no slot to refill): between refills a round is the wave scheduler's loop, one
     step per iteration with no bookkeeping;
  4. harvest (only when a slot finished): finished slots are copied to the `Finished` rows and
     become free.

The loop stops after `budget` steps, when the Finished rows might not hold another batch, or
when every request is done: a *dispatch* (jspec.loop.dispatch decides when each part of
a round is due). The host then collects the finished rows and
updates its progress while the next dispatch, already queued on the state it donated, runs
(jspec.schedulers.continuous).

Exactness: a slot's computation depends only on its own request. Prefill (batched or in
chunks) starts at position 0 of each prompt whatever the slot, keys come from (seed,
position), and a slot's caches and drafter state are zeroed before its first chunk (recurrent
state and drafter state reset on refill; a KV cache needs no reset, its stale slots are
rewritten before they are read). Every shard runs the same program: a lane with nothing to
prefill computes on padding and writes nothing back (an idle lane's rows point past the shard).

Slot phases and shape letters: jspec.loop.slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.speculative import logprobs as logprob_lib
from jspec.speculative import sampling
from jspec.speculative.drafters.base import take_rows
from jspec.loop.queue import Queue
from jspec.shapes.rows import (by_shard, gather_rows, scatter_rows, select_rows,
                                    set_row_items)
from jspec.loop.slots import (FREE, PREFILL, RUN, BatchPlan, BatchState, Finished,
                                     SlotLogprobs)
from jspec.loop.state import FINISH_LENGTH, FINISH_NONE, FINISH_STOP, RequestInputs
from jspec.loop.step import (TARGET_STREAM, LoopContext, choose_tokens, decode_step,
                                    is_stop, stream_keys, target_forward)


# ---- 1. admit --------------------------------------------------------------------------------

def admit(state: BatchState, queue: Queue, plan: BatchPlan, replicated=None) -> BatchState:
  """Each shard's idle prefill lanes take the next groups, in queue order, while the shard
  has a free slot for every sample of them; a group's slots are the shard's first free ones
  (in group order), its leader the first of them. Shard by shard (a few small arrays each).

  replicated: the mesh's replicated sharding, or None. The walk is sequential over the shards
  (each takes the groups after the previous one's), so every shard runs all of it from
  replicated copies of the slots' phases and lanes: two small all-gathers, where the walk over
  split arrays had XLA move each shard's pieces with about twenty collectives."""
  shards, batch, lp, lanes, group = plan.shards, plan.loop.batch, plan.loop, plan.lanes, plan.group
  per_shard = batch // shards
  whole = (lambda x: x) if replicated is None else (
      lambda x: jax.lax.with_sharding_constraint(x, replicated))
  free_Db = by_shard(whole(state.phase_B) == FREE, shards)
  rank_Db = jnp.cumsum(free_Db, axis=1)                # 1-based rank among free slots
  idle_DR = whole(state.prefill_group_L).reshape(shards, lanes) < 0
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
  # Replicated until a shard takes its own rows of them (a local slice).
  took_L = whole(jnp.stack(took_DR)).reshape(-1)
  group_L = whole(jnp.stack(group_DR)).reshape(-1)
  rows_LM = whole(jnp.stack(rows_DRM)).reshape(-1, group)
  group_B = whole(jnp.stack(slot_group_Db)).reshape(batch)
  member_B = whole(jnp.stack(member_Db)).reshape(batch).astype(jnp.int32)
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
  leader = select_rows(fresh_L, jax.tree.map(jnp.zeros_like, leader), leader)
  target_out, new_leader = target_forward(target, drafter, tokens_LC, cache_positions_LC,
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
  keys_N = sampling.position_keys(stream_keys(member_req, TARGET_STREAM),
                                  prompt_len_N[:, None])[:, 0]
  logits_NV = members(logits_LV)
  first_N, _ = choose_tokens(logits_NV, member_req.temperature_B, member_req.top_k_B,
                       member_req.top_p_B, keys_N, lp, ctx.vocab_argmax)

  # The drafter sees each member's own first token after the prompt.
  final_N, active_N, fresh_N = members(final_L), members(active_L), members(fresh_L)
  next_NC = members(next_LC)
  last_N = members(last_L)
  next_NC = jnp.where(final_N[:, None] & (jnp.arange(chunk)[None] == last_N[:, None]),
                      first_N[:, None], next_NC)
  draft_rows = gather_rows(dec.draft, rows_flat, shards)
  draft_rows = select_rows(fresh_N, jax.tree.map(jnp.zeros_like, draft_rows), draft_rows)
  new_draft = drafter.prefill_chunk(draft_rows, members(tokens_LC), members(cache_positions_LC),
                                    next_NC, prompt_len_N, last_N,
                                    jax.tree.map(members, target_out))
  draft = scatter_rows(dec.draft, rows_flat, jax.lax.optimization_barrier(new_draft), shards)

  # Members that finished their prompt: tokens, length, first finish check, logprobs.
  member_tokens_NS = _prompt_rows(queue, members(start_L), prompt_len_N, slots)
  member_tokens_NS = jnp.where(jnp.arange(slots)[None] == prompt_len_N[:, None],
                               first_N[:, None], member_tokens_NS)
  stop_N = is_stop(first_N[:, None], member_req.stop_ids_BX)[:, 0]
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

def decode(target, drafter, state: BatchState, plan: BatchPlan,
           ctx: LoopContext) -> BatchState:
  """One step of every running slot; generated tokens' logprobs into the slots' buffers."""
  lp = plan.loop
  before_B = state.decode.lengths_B
  running_B = ~state.decode.done_B
  decoded, out = decode_step(target, drafter, state.decode, state.req, lp, ctx)
  logprobs = state.logprobs
  if logprobs is not None:
    # Token t of the window is generated token (length - prompt_len + t) of its slot.
    offsets_T = jnp.arange(lp.k + 1, dtype=jnp.int32)
    index_BT = before_B[:, None] - state.prompt_len_B[:, None] + offsets_T
    emitted_BT = running_B[:, None] & (offsets_T[None] < out.num_emit_B[:, None])
    index_BT = jnp.where(emitted_BT, index_BT, plan.out_len)  # dropped
    write = lambda buf, v: set_row_items(buf, index_BT, v, mode="drop")
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
