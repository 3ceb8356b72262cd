"""Host side of continuous batching: one program per call's shapes, run as a few dispatches.

A call compiles (once per shape: slots, cache slots, queue buckets, drafter, first-wave prompt
bucket) a `start` program (jspec.loop.slots) and a `dispatch` program
(jspec.loop.dispatch). `start` allocates the slots' state and prefills the first
requests that fit the slots in one batched pass (the wave scheduler's prefill), so a call whose
requests all fit runs as a wave would. `dispatch` runs the loop until its Finished rows fill,
its step budget is spent or every request is done; where every request starts in the wave, it
is compiled without admission and prefill, which would never run (a smaller program that
compiles in about 60% of the time). The state is donated from one dispatch to
the next and never leaves the device. A worker thread (jspec.schedulers.dispatch_chain)
launches `start` and then each dispatch as soon as the previous one returns, *before* the
host reads that one's finished rows, so the device waits neither for the host's collecting,
progress bar or output building nor for a hand-off between threads; it stops after the
dispatch that reports every request done. A call's queue and first wave reach the device as
one buffer each, and a dispatch's finished rows come back as one (jspec.shapes.packing): on a
GPU each small copy costs tens of µs, almost all of it fixed.

The step budget: a call whose requests all fit the slots runs in one dispatch (no boundary)
unless the rate of earlier calls says that would take over `LONG_CALL_SECONDS`; otherwise a
dispatch lasts about `DISPATCH_SECONDS` (the progress bar's refresh), whatever a step costs.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec import interrupt
from jspec.device import DeviceModel
from jspec.progress import RequestProgress, stage
from jspec.schedulers.base import (DispatchTiming, RunResult, cache_len_for, draft_positions,
                                   loop_plan, num_drafts, program_models)
from jspec.schedulers.collect import FinishedCompletion, OutputCollector
from jspec.schedulers.dispatch_chain import DispatchChain
from jspec.sharding.rules import to_host
from jspec.loop import dispatch, slots
from jspec.shapes import buckets
from jspec.loop.queue import Queue, plan_queue, queue_arrays
from jspec.loop.slots import BatchPlan, Finished, Wave, start_state
from jspec.shapes.packing import Layout, TreeLayout, tree_shapes
from jspec.loop.state import FINISH_REASONS
from jspec.timing import Clock, ReadyTime

DISPATCH_SECONDS = 1.0
LONG_CALL_SECONDS = 10.0   # a call that fits the slots runs in one dispatch if no longer
FIRST_BUDGET = 64          # steps of a call's first dispatch when no rate is known
MAX_BUDGET = 1 << 20


@dataclasses.dataclass(frozen=True)
class WavePlan:
  """The first wave on the host: slot b takes queue group group_B[b] (-1: none); groups
  0 .. num_groups - 1, spread over the data-parallel shards in turn."""
  group_B: np.ndarray
  num_groups: int
  prompt_bucket: int


@dataclasses.dataclass(frozen=True)
class Packed:
  """Arrays packed into one device buffer, and where each lies in it."""
  layout: Layout
  buffer: jax.Array

  @property
  def spec(self) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(self.buffer.shape, self.buffer.dtype,
                                sharding=self.buffer.sharding)


class ContinuousScheduler:
  """Compiles and runs the continuous-batching loop over a DeviceModel (jspec.device)."""

  def __init__(self, device: DeviceModel, parts):
    self.device, self.parts = device, parts
    self.k = num_drafts(parts.spec)
    self.dispatch_programs = {}  # (BatchPlan, queue layout, whether it admits) -> dispatch
    self.finished_layouts = {}   # the same keys -> dispatch's packed Finished
    self.start_programs = {}     # (BatchPlan, queue layout, wave layout) -> start
    self._draft_layouts = {}     # LoopPlan -> the drafter state layout (cached_draft_layout)
    self._budgets = {}        # step budget -> its replicated device scalar
    self._rates = {}          # dispatch_programs' keys -> steps per second last measured
    self.finished_rows = None  # Finished rows per dispatch; None: twice the slots
    self.budget = None         # steps per dispatch; None: chosen per call (module docstring)

  # ---- plans -----------------------------------------------------------------------------

  def check(self, params):
    """Serves every sampling setting."""

  def _plans(self, prompt_ids, params, seeds):
    parts = self.parts
    width = parts.mesh_config.batch_width
    total = sum(p.n for p in params)
    batch = buckets.batch_bucket(min(total, parts.max_num_seqs), width)
    queue = plan_queue(prompt_ids, params, seeds, batch // width)
    cache_len = cache_len_for(prompt_ids, params, self.k, parts.max_model_len)
    # About prefill_chunk_size prompt tokens per shard and iteration, in `lanes` prompts of
    # `chunk` tokens side by side: a quarter of it per lane at most, so that a prompt pads its
    # last chunk by little, and short prompts many to an iteration (as a batched prefill).
    longest = max(len(p) for p in prompt_ids)
    chunk = min(max(buckets.MIN_PROMPT_BUCKET, parts.prefill_chunk_size // 4),
                max(buckets.MIN_PROMPT_BUCKET, buckets.next_pow2(longest)))
    loop = loop_plan(parts.spec, params, batch=batch, cache_len=cache_len, prefill_chunk=chunk,
                     num_logprobs=queue.num_logprobs)
    lanes = min(batch // width, max(1, parts.prefill_chunk_size // chunk))
    plan = BatchPlan(loop=loop, shards=width, group=queue.group, lanes=lanes,
                              out_len=cache_len, finished_rows=self.finished_rows or 2 * batch)
    return plan, queue

  def _wave(self, plan: BatchPlan, queue_plan) -> WavePlan | None:
    """The groups that start in a batched prefill: as many as there are slots, when groups
    are single samples (n > 1 shares one prefill per group inside the loop instead: a batched
    prefill would repeat the prompt for every sample)."""
    if plan.group != 1:
      return None
    batch, shards = plan.loop.batch, plan.shards
    per_shard = batch // shards
    count = min(len(queue_plan.groups), batch)
    group_B = np.full((batch,), -1, np.int32)
    for g in range(count):  # in turn over the shards, so that each gets its share
      group_B[(g % shards) * per_shard + g // shards] = g
    longest = max(len(queue_plan.prompts[queue_plan.groups[g].request]) for g in range(count))
    return WavePlan(group_B, count, buckets.prompt_bucket(longest, plan.loop.cache_len))

  @staticmethod
  def _wave_fields(wave: WavePlan, queue_plan) -> dict[str, np.ndarray]:
    """The wave's `Wave` fields on the host."""
    tokens = np.zeros((len(wave.group_B), wave.prompt_bucket), np.int32)
    lens = np.ones((len(wave.group_B),), np.int32)
    for row, g in enumerate(wave.group_B):
      if g >= 0:
        prompt = queue_plan.prompts[queue_plan.groups[g].request]
        tokens[row, :len(prompt)], lens[row] = prompt, len(prompt)
    return dict(tokens_BP=tokens, prompt_lens_B=lens, group_B=wave.group_B)

  def _packed(self, fields: dict[str, np.ndarray]) -> Packed:
    """Host arrays as one replicated int32 buffer on the device: one host-to-device copy
    instead of one per array (jspec.shapes.packing)."""
    layout = Layout.of(fields)
    return Packed(layout, self.device.put(layout.pack_host(fields), (None,)))

  # ---- compilation -----------------------------------------------------------------------

  def _shardings(self, state_shape, batch: int):
    """Per-slot arrays split over the batch axes, caches by their rules, the rest (queue,
    per-shard prefill bookkeeping, finished rows) replicated."""
    shardings = self.device.batch_shardings(state_shape, batch)
    return shardings.replace(decode=self.device.with_cache_shardings(shardings.decode))

  def _start_fn(self, plan: BatchPlan, queue_layout: Layout, wave_layout: Layout | None):
    device, ctx, chunk = self.device, self.device.ctx, self.parts.prefill_chunk_size

    def start_fn(target_state, draft_state, queue_buffer, wave_buffer):
      wave = None if wave_layout is None else Wave(**wave_layout.unpack(wave_buffer))
      target, drafter = program_models(device, target_state, draft_state, plan.loop,
                                       in_loop=False)
      layout = slots.cached_draft_layout(self._draft_layouts, target, drafter, plan.loop, ctx)
      state = start_state(target, drafter, Queue(**queue_layout.unpack(queue_buffer)), wave,
                          plan, ctx, chunk, layout)
      # A small output of its own (not donated with the state): ready when the prefill is.
      return state, jnp.sum(state.decode.lengths_B)

    return start_fn

  def _compile(self, plan: BatchPlan, queue: Packed, wave: Packed | None, admits: bool):
    """(start, dispatch, the layout of dispatch's packed Finished rows) for these shapes.
    Dispatch takes no wave: one program serves every first-wave prompt bucket. `admits`:
    whether requests wait for the wave's slots (else dispatch has no admission and prefill:
    the branch would never run, and it is about 40% of the program XLA compiles)."""
    device, ctx = self.device, self.device.ctx
    start_key = (plan, queue.layout, None if wave is None else wave.layout)
    key = (plan, queue.layout, admits)
    if key in self.dispatch_programs and start_key in self.start_programs:
      return (self.start_programs[start_key], self.dispatch_programs[key],
              self.finished_layouts[key])
    replicated = device.sharding(())
    lp = plan.loop
    label = (f"compiling continuous batch={lp.batch} cache={lp.cache_len} chunk="
             f"{lp.prefill_chunk} method={lp.method or 'none'} k={lp.k}"
             + (f" wave prompt={wave.layout.fields[0].shape[1]}" if wave is not None else ""))
    with stage(label):
      start_fn = self._start_fn(plan, queue.layout, None if wave is None else wave.layout)
      args = (*device.weights, queue.spec, None if wave is None else wave.spec)
      # The state's shapes from the slots' initial state alone (start returns the same with a
      # wave or without): tracing the whole start program for them would trace it twice.
      state_shape = jax.eval_shape(self._start_fn(plan, queue.layout, None),
                                   *device.weights, queue.spec, None)[0]
      shardings = self._shardings(state_shape, lp.batch)
      lowerings = []  # (where the program goes, its key, its lowering) of each missing one
      if start_key not in self.start_programs:

        def lower_start():
          lowered = jax.jit(start_fn, out_shardings=(shardings, replicated)).lower(*args)
          if tree_shapes(lowered.out_info[0]) != tree_shapes(state_shape):
            raise AssertionError("start's state is not the planned one")
          return lowered

        lowerings.append((self.start_programs, start_key, lower_start))
      if key not in self.dispatch_programs:

        state_in = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                state_shape, shardings)
        budget = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        # The loop's carry keeps Finished.empty's layout (checked at dispatch_fn's trace): no
        # trace of the whole dispatch for it.
        finished = TreeLayout.of(jax.eval_shape(lambda: Finished.empty(plan)))

        def dispatch_fn(target_state, draft_state, state, queue_buffer, budget):
          target, drafter = program_models(device, target_state, draft_state, plan.loop,
                                           in_loop=True)
          state, rows = dispatch.dispatch(target, drafter, state,
                                          Queue(**queue.layout.unpack(queue_buffer)), budget,
                                          plan, ctx, admits=admits)
          # The Finished rows leave as one buffer: one device-to-host copy a dispatch.
          if TreeLayout.of(rows) != finished:
            raise AssertionError(f"dispatch's Finished rows {TreeLayout.of(rows)} are not the "
                                 f"planned {finished}")
          return state, finished.pack(rows)

        lowerings.append((self.dispatch_programs, key, lambda: jax.jit(
            dispatch_fn, out_shardings=(shardings, device.sharding((None,))),
            donate_argnums=(2,)).lower(*device.weights, state_in, queue.spec, budget)))
        self.finished_layouts[key] = finished
      compiled = interrupt.compile_programs([lower for *_, lower in lowerings])
      for (programs, program_key, _), program in zip(lowerings, compiled):
        programs[program_key] = program
    return (self.start_programs[start_key], self.dispatch_programs[key],
            self.finished_layouts[key])

  # ---- a call ----------------------------------------------------------------------------

  def _first_budget(self, key, admits: bool, queue_plan) -> int:
    """Steps of the first dispatch: the whole call when it admits nothing (all in the wave)
    and earlier calls' rate says it is not long, else about DISPATCH_SECONDS."""
    if self.budget is not None:
      return self.budget
    rate = self._rates.get(key)
    if not admits:
      # Each step emits at least one token of every running request; prefill the first.
      steps = max(min(len(queue_plan.prompts[g.request]) + queue_plan.params[g.request].max_tokens,
                      self.parts.max_model_len) - len(queue_plan.prompts[g.request])
                  for g in queue_plan.groups)
      if rate is None or steps <= rate * LONG_CALL_SECONDS:
        return max(1, steps)
    if rate is None:
      return FIRST_BUDGET
    return buckets.next_pow2(int(min(MAX_BUDGET, max(FIRST_BUDGET, rate * DISPATCH_SECONDS))))

  def generate(self, prompt_ids, params, seeds, use_tqdm=True, decode=None) -> RunResult:
    device, parts = self.device, self.parts
    plan, queue_plan = self._plans(prompt_ids, params, seeds)
    queue = self._packed(queue_arrays(queue_plan, parts.config.eos_token_ids,
                                      parts.max_model_len))
    wave_plan = self._wave(plan, queue_plan)
    wave = None if wave_plan is None else self._packed(self._wave_fields(wave_plan, queue_plan))
    # Every request in the wave: nothing is ever admitted.
    admits = wave_plan is None or wave_plan.num_groups < len(queue_plan.groups)
    start_c, dispatch_c, finished_layout = self._compile(plan, queue, wave, admits)
    rate_key = (plan, queue.layout, admits)
    prompt_lps = parts.scorer.prompt_logprobs(prompt_ids, params, decode)

    collector = OutputCollector(queue_plan, draft_positions(self.parts.spec), decode)
    remaining = [p.n for p in params]
    progress = RequestProgress(len(prompt_ids), show=use_tqdm,
                               bar=use_tqdm if callable(use_tqdm) else None)
    targets = device.weights
    budgets = self._budgets
    timings = []

    def launch(state, budget):
      if budget not in budgets:  # kept across calls: a put costs ~0.1 ms on a GPU
        budgets[budget] = device.put(np.asarray(budget, np.int32), ())
      begin = time.perf_counter()
      state, rows = dispatch_c(*targets, state, queue.buffer, budgets[budget])
      # Waits for the dispatch's end (on a GPU its launch already has; on a CPU it returns at
      # once), then reads its rows, so that the chain stops after the dispatch that left
      # nothing to do.
      finished = finished_layout.unpack_host(to_host(rows))
      timings.append(DispatchTiming(begin - start, time.perf_counter() - begin))
      return state, (finished, bool(finished.all_done))

    def collect(host) -> tuple[int, int]:
      count, tokens = int(host.count), 0
      done_requests = 0
      for i in range(count):
        n = int(host.num_tokens_F[i])
        lps = None
        if host.logprobs is not None:
          lp = host.logprobs
          lps = (lp.logprob_BO[i, :n], lp.rank_BO[i, :n], lp.top_ids_BOX[i, :n],
                 lp.top_logprobs_BOX[i, :n])
        done = FinishedCompletion(group=int(host.group_F[i]), member=int(host.member_F[i]),
                        token_ids=host.tokens_FO[i, :n].tolist(),
                        finish_reason=FINISH_REASONS[int(host.finish_F[i])],
                        num_steps=int(host.num_steps_F[i]), drafted_at_K=host.drafted_at_FK[i],
                        accepted_at_K=host.accepted_at_FK[i], logprobs=lps,
                        emitted_at=host.emitted_at_FO[i, :n])
        collector.add(done)
        request = queue_plan.groups[done.group].request
        remaining[request] -= 1
        done_requests += remaining[request] == 0
        tokens += n
      progress.update(done_requests, tokens)
      return int(host.iterations), int(host.clock)

    start = time.perf_counter()
    host_seconds = 0.0
    chain = None
    try:
      chain = DispatchChain(
          launch, lambda: start_c(*targets, queue.buffer, None if wave is None else wave.buffer),
          self._first_budget(rate_key, admits, queue_plan), is_last=lambda out: out[1])
      prefill_done = ReadyTime(chain.started())
      for index in itertools.count():
        pending, _ = chain.next()
        ready = time.perf_counter()
        timings[index].iterations, timings[index].clock = collect(pending)
        host_seconds += time.perf_counter() - ready
        if collector.num_finished == queue_plan.num_sequences:
          break
        seconds = timings[index].seconds
        if timings[index].iterations and seconds > 0:
          self._rates[rate_key] = timings[index].iterations / seconds
          if self.budget is None:
            budget = self._rates[rate_key] * DISPATCH_SECONDS
            chain.budget = buckets.next_pow2(int(min(MAX_BUDGET, max(FIRST_BUDGET, budget))))
        chain.proceed()
    except BaseException:  # Ctrl-C: raised now; the dispatch under way ends on its own
      if chain is not None:
        chain.close(wait=False)
      progress.close()
      raise
    chain.close()
    wall = time.perf_counter() - start
    progress.close()
    clock = Clock(prefill_done.get() - start)
    for t in timings:
      clock.add(t.clock, t.start_s, t.start_s + t.seconds)
    last = timings[-1]
    if last.iterations and last.seconds > 0:
      self._rates[rate_key] = last.iterations / last.seconds
    outputs = collector.outputs(wall, prompt_lps, clock)
    return RunResult(outputs, wall, host_seconds / len(timings), timings)
