"""Host side of continuous batching: one program per call's shapes, run as a few dispatches.

A call compiles (once per shape: slots, cache slots, queue buckets, drafter, first-wave prompt
bucket) a `start` program (jspec.speculative.batching) and a `dispatch` program
(jspec.speculative.dispatch). `start` allocates the slots' state and prefills the first
requests that fit the slots in one batched pass (the wave scheduler's prefill), so a call whose
requests all fit runs as a wave would. `dispatch` runs the loop until its Finished rows fill,
its step budget is spent or every request is done. The state is donated from one dispatch to
the next and never leaves the device. A worker thread (DispatchChain) launches each dispatch as
soon as the previous one returns, *before* the host reads that one's finished rows, so the
device waits neither for the host's collecting, progress bar or output building nor for a
hand-off between threads; it stops after the dispatch that reports every request done.

The step budget: a call whose requests all fit the slots runs in one dispatch (no boundary)
unless the rate of earlier calls says that would take over `LONG_CALL_SECONDS`; otherwise a
dispatch lasts about `DISPATCH_SECONDS` (the progress bar's refresh), whatever a step costs.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue as queues
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec import interrupt
from jspec.outputs import RequestOutput, position_logprobs
from jspec.progress import RequestProgress, stage
from jspec.requests import FinishedCompletion, OutputCollector, plan_queue, queue_arrays
from jspec.sharding.rules import to_host
from jspec.speculative import batching, buckets, dispatch
from jspec.speculative.drafters import make_drafter
from jspec.speculative.logprobs import prompt_logprobs_fn
from jspec.speculative.loop import LoopPlan, merge_module
from jspec.speculative.state import FINISH_REASONS
from jspec.timing import Clock, ReadyTime

DISPATCH_SECONDS = 1.0
LONG_CALL_SECONDS = 10.0   # a call that fits the slots runs in one dispatch if no longer
FIRST_BUDGET = 64          # steps of a call's first dispatch when no rate is known
MAX_BUDGET = 1 << 20


@dataclasses.dataclass
class DispatchTiming:
  """One dispatch as the launching thread saw it. On a GPU a launch returns when its while
  loop has ended (the host reads the loop condition back), so `seconds` is the dispatch's
  device time plus the launch; on a CPU a launch returns at once."""
  start_s: float       # when the launch began, from the call's start
  seconds: float       # until the dispatch had ended (the launch, and on a CPU the wait)
  iterations: int = 0  # decode steps (rounds) it ran
  clock: int = 0       # the loop's clock when it ended (jspec.timing)


@dataclasses.dataclass
class RunResult:
  outputs: list[RequestOutput]
  wall_time_s: float
  host_seconds_per_dispatch: float = 0.0  # host work per dispatch (overlapped with the next)
  dispatches: list[DispatchTiming] = dataclasses.field(default_factory=list)


class DispatchChain:
  """Runs dispatches back to back on a worker thread, each on the state the last one returned,
  until one's output satisfies `is_last`.

  On a GPU the launching thread drives a dispatch's while loop (it reads the loop condition
  back each iteration), so a launch returns only when its dispatch is done. The worker
  therefore launches the next dispatch as soon as the last one returns, without waiting on the
  host, and hands the host the finished rows. It runs at most one dispatch ahead of the
  host's collecting: the host allows each further dispatch with `proceed()` once it has
  collected the one before, and `close()` lets the last launched one end the chain. On a CPU a
  launch returns at once and the same order holds. The host waits in slices (jspec.interrupt),
  so Ctrl-C reaches it at once; `close(wait=False)` then ends the chain after the dispatch
  under way without waiting for it.
  """

  def __init__(self, launch, state, budget: int, is_last=lambda finished: False):
    self._launch = launch
    self._is_last = is_last
    self.budget = budget  # iterations for the next launch; the host adapts it
    self._finished = queues.Queue()
    self._permits = queues.Queue()
    self._closed = False
    self._permits.put(True)  # the second dispatch runs while the host collects the first
    self._thread = interrupt.start_thread(self._run, state, name="jspec-dispatch")

  def _run(self, state):
    try:
      while True:
        state, finished = self._launch(state, self.budget)
        self._finished.put(finished)
        if self._is_last(finished) or not self._permits.get() or self._closed:
          return
    except BaseException as err:  # re-raised on the host's thread by next()
      self._finished.put(err)

  def next(self):
    """The next dispatch's Finished rows, once its launch has returned."""
    item = interrupt.get(self._finished)
    if isinstance(item, BaseException):
      raise item
    return item

  def proceed(self):
    self._permits.put(True)

  def close(self, wait: bool = True):
    """No dispatch after the one under way; `wait`: until that one has returned."""
    self._closed = True
    self._permits.put(False)
    if wait:
      self._thread.join()


@dataclasses.dataclass(frozen=True)
class WavePlan:
  """The first wave on the host: slot b takes queue group group_B[b] (-1: none); groups
  0 .. num_groups - 1, spread over the data-parallel shards in turn."""
  group_B: np.ndarray
  num_groups: int
  prompt_bucket: int


class ContinuousBatcher:
  """Compiles and runs the continuous-batching loop for a Runner (jspec.engine)."""

  def __init__(self, runner):
    self.runner = runner
    self.llm = runner.llm
    self._compiled = {}       # (BatchPlan, queue shapes) -> dispatch
    self._start_compiled = {}  # (BatchPlan, queue shapes, prompt bucket) -> start
    self._prompt_compiled = {}
    self._rates = {}          # (BatchPlan, queue shapes) -> steps per second last measured
    self.finished_rows = None  # Finished rows per dispatch; None: twice the slots
    self.budget = None         # steps per dispatch; None: chosen per call (module docstring)

  # ---- plans -----------------------------------------------------------------------------

  def _plans(self, prompt_ids, params, seeds):
    llm, runner = self.llm, self.runner
    width, k = llm.mesh_config.batch_width, runner.k
    total = sum(p.n for p in params)
    batch = buckets.batch_bucket(min(total, llm.max_num_seqs), width)
    queue = plan_queue(prompt_ids, params, seeds, batch // width)
    max_total = max(min(len(p) + sp.max_tokens, llm.max_model_len)
                    for p, sp in zip(prompt_ids, params))
    cache_len = buckets.cache_bucket(max_total, k, llm.max_model_len)
    # About prefill_chunk_size prompt tokens per shard and iteration, in `lanes` prompts of
    # `chunk` tokens side by side: a quarter of it per lane at most, so that a prompt pads its
    # last chunk by little, and short prompts many to an iteration (as a batched prefill).
    longest = max(len(p) for p in prompt_ids)
    chunk = min(max(buckets.MIN_PROMPT_BUCKET, llm.prefill_chunk_size // 4),
                max(buckets.MIN_PROMPT_BUCKET, buckets.next_pow2(longest)))
    spec = runner.spec
    loop = LoopPlan(batch=batch, cache_len=cache_len, method=runner.method, k=k,
                    all_greedy=all(sp.temperature == 0 for sp in params),
                    any_filtered=any(sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1)
                                     for sp in params),
                    ngram_min=spec.prompt_lookup_min if spec else 1,
                    ngram_max=spec.prompt_lookup_max if spec else 1,
                    prefill_chunk=chunk, num_logprobs=queue.num_logprobs)
    lanes = min(batch // width, max(1, llm.prefill_chunk_size // chunk))
    plan = batching.BatchPlan(loop=loop, shards=width, group=queue.group, lanes=lanes,
                              out_len=cache_len, finished_rows=self.finished_rows or 2 * batch)
    return plan, queue

  def _wave(self, plan: batching.BatchPlan, queue_plan) -> WavePlan | None:
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

  def _wave_inputs(self, wave: WavePlan, queue_plan) -> batching.Wave:
    tokens = np.zeros((len(wave.group_B), wave.prompt_bucket), np.int32)
    lens = np.ones((len(wave.group_B),), np.int32)
    for row, g in enumerate(wave.group_B):
      if g >= 0:
        prompt = queue_plan.prompts[queue_plan.groups[g].request]
        tokens[row, :len(prompt)], lens[row] = prompt, len(prompt)
    put = self.runner._put
    return batching.Wave(tokens_BP=put(tokens, ("batch", "seq")),
                         prompt_lens_B=put(lens, ("batch",)), group_B=put(wave.group_B, ("batch",)))

  # ---- compilation -----------------------------------------------------------------------

  def _shardings(self, state_shape, batch: int):
    """Per-slot arrays split over the batch axes, caches by their rules, the rest (queue,
    per-shard prefill bookkeeping, finished rows) replicated."""
    llm, ctx = self.llm, self.runner.ctx

    def leaf(x):
      axes = (("batch",) + (None,) * (x.ndim - 1) if x.ndim and x.shape[0] == batch
              else (None,) * x.ndim)
      return llm.rules.sharding(llm.mesh, axes)

    shardings = jax.tree.map(leaf, state_shape)
    decode = shardings.decode
    decode = decode.replace(target_caches=ctx.cache_shardings,
                            draft=decode.draft.replace(caches=ctx.draft_cache_shardings or ()))
    return shardings.replace(decode=decode)

  def _start_fn(self, plan: batching.BatchPlan):
    runner, ctx = self.runner, self.runner.ctx
    tgd, dgd = runner.target_graphdef, runner.draft_graphdef
    chunk = self.llm.prefill_chunk_size

    def start_fn(target_state, draft_state, queue, wave):
      state = batching.start_state(nnx.merge(tgd, target_state), merge_module(dgd, draft_state),
                                   queue, wave, plan, ctx, chunk)
      # A small output of its own (not donated with the state): ready when the prefill is.
      return state, jnp.sum(state.decode.lengths_B)

    return start_fn

  def _compile(self, plan: batching.BatchPlan, queue, wave):
    """(start, dispatch) executables for these shapes (`wave`: a batching.Wave or None)."""
    runner, ctx, llm = self.runner, self.runner.ctx, self.llm
    shapes = jax.tree.map(lambda x: x.shape, queue)
    key = (plan, shapes)
    start_key = key + (None if wave is None else wave.tokens_BP.shape,)
    if key in self._compiled and start_key in self._start_compiled:
      return self._start_compiled[start_key], self._compiled[key]
    tgd, dgd = runner.target_graphdef, runner.draft_graphdef
    replicated = llm.rules.sharding(llm.mesh, ())
    lp = plan.loop
    label = (f"compiling continuous batch={lp.batch} cache={lp.cache_len} chunk="
             f"{lp.prefill_chunk} method={lp.method or 'none'} k={lp.k}"
             + (f" wave prompt={wave.tokens_BP.shape[1]}" if wave is not None else ""))
    with stage(label):
      start_fn = self._start_fn(plan)
      args = (runner.target_state, runner.draft_state, queue, wave)
      state_shape = jax.eval_shape(start_fn, *args)[0]
      shardings = self._shardings(state_shape, lp.batch)
      if start_key not in self._start_compiled:
        self._start_compiled[start_key] = interrupt.call(jax.jit(
            start_fn, out_shardings=(shardings, replicated)).lower(*args).compile)
      if key not in self._compiled:

        def dispatch_fn(target_state, draft_state, state, queue, budget):
          return dispatch.dispatch(nnx.merge(tgd, target_state), merge_module(dgd, draft_state),
                                   state, queue, budget, plan, ctx)

        state_in = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state_shape,
            shardings)
        budget = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        finished_shape = jax.eval_shape(dispatch_fn, runner.target_state, runner.draft_state,
                                        state_in, queue, budget)[1]
        finished_sh = jax.tree.map(lambda x: llm.rules.sharding(llm.mesh, (None,) * x.ndim),
                                   finished_shape)
        self._compiled[key] = interrupt.call(jax.jit(
            dispatch_fn, out_shardings=(shardings, finished_sh), donate_argnums=(2,)).lower(
                runner.target_state, runner.draft_state, state_in, queue, budget).compile)
    return self._start_compiled[start_key], self._compiled[key]

  # ---- a call ----------------------------------------------------------------------------

  def _first_budget(self, key, wave: WavePlan | None, queue_plan) -> int:
    """Steps of the first dispatch: the whole call when its requests all start in the wave
    (and earlier calls' rate says it is not long), else about DISPATCH_SECONDS."""
    if self.budget is not None:
      return self.budget
    rate = self._rates.get(key)
    if wave is not None and wave.num_groups == len(queue_plan.groups):
      # Each step emits at least one token of every running request; prefill the first.
      steps = max(min(len(queue_plan.prompts[g.request]) + queue_plan.params[g.request].max_tokens,
                      self.llm.max_model_len) - len(queue_plan.prompts[g.request])
                  for g in queue_plan.groups)
      if rate is None or steps <= rate * LONG_CALL_SECONDS:
        return max(1, steps)
    if rate is None:
      return FIRST_BUDGET
    return buckets.next_pow2(int(min(MAX_BUDGET, max(FIRST_BUDGET, rate * DISPATCH_SECONDS))))

  def generate(self, prompt_ids, params, seeds, use_tqdm=True, decode=None) -> RunResult:
    runner, llm = self.runner, self.llm
    plan, queue_plan = self._plans(prompt_ids, params, seeds)
    arrays = queue_arrays(queue_plan, llm.config.eos_token_ids, llm.max_model_len)
    queue = batching.Queue(**{name: runner._put(a, (None,) * a.ndim)
                              for name, a in arrays.items()})
    wave_plan = self._wave(plan, queue_plan)
    wave = None if wave_plan is None else self._wave_inputs(wave_plan, queue_plan)
    start_c, dispatch_c = self._compile(plan, queue, wave)
    rate_key = (plan, jax.tree.map(lambda x: x.shape, queue))
    prompt_lps = self.prompt_logprobs(prompt_ids, params, decode)

    collector = OutputCollector(queue_plan, runner.k, decode)
    remaining = [p.n for p in params]
    progress = RequestProgress(len(prompt_ids), show=use_tqdm,
                               bar=use_tqdm if callable(use_tqdm) else None)
    targets = (runner.target_state, runner.draft_state)
    budgets = {}
    timings = []

    def launch(state, budget):
      if budget not in budgets:
        budgets[budget] = runner._put(np.asarray(budget, np.int32), ())
      begin = time.perf_counter()
      state, finished = dispatch_c(*targets, state, queue, budgets[budget])
      # Waits for the dispatch's end (on a GPU its launch already has; on a CPU it returns at
      # once): the chain stops after the dispatch that left nothing to do.
      last = bool(finished.all_done)
      timings.append(DispatchTiming(begin - start, time.perf_counter() - begin))
      return state, (finished, last)

    def collect(finished) -> tuple[int, int]:
      host = to_host(finished)
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
    state, prefilled = start_c(*targets, queue, wave)
    host_seconds = 0.0
    chain = None
    try:
      chain = DispatchChain(launch, state, self._first_budget(rate_key, wave_plan, queue_plan),
                            is_last=lambda out: out[1])
      prefill_done = ReadyTime(prefilled)
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

  # ---- prompt logprobs ---------------------------------------------------------------------

  def prompt_logprobs(self, prompt_ids, params, decode):
    """{request: [None, {token: Logprob}, ...]} for the requests that ask, or None."""
    asked = [i for i, p in enumerate(params) if p.prompt_logprobs is not None]
    if not asked:
      return None
    runner, llm = self.runner, self.llm
    num_top = max(params[i].prompt_logprobs for i in asked)
    results = [None] * len(prompt_ids)
    step = llm.max_num_seqs
    for begin in range(0, len(asked), step):
      rows = asked[begin:begin + step]
      batch = buckets.batch_bucket(len(rows), llm.mesh_config.batch_width)
      length = buckets.prompt_bucket(max(len(prompt_ids[i]) for i in rows), llm.max_model_len)
      tokens = np.zeros((batch, length), np.int32)
      for r, i in enumerate(rows):
        tokens[r, :len(prompt_ids[i])] = prompt_ids[i]
      key = (batch, length, num_top)
      if key not in self._prompt_compiled:
        self._prompt_compiled[key] = jax.jit(prompt_logprobs_fn(
            runner.target_graphdef, runner.ctx.experts_fn, runner.ctx.dtype,
            runner.ctx.cache_shardings, batch, length, llm.prefill_chunk_size, num_top))
      out = to_host(self._prompt_compiled[key](runner.target_state,
                                               runner._put(tokens, ("batch", "seq"))))
      for r, i in enumerate(rows):
        prompt, top = prompt_ids[i], params[i].prompt_logprobs
        m = len(prompt) - 1  # position t scores token t + 1
        results[i] = [None] + position_logprobs(
            prompt[1:], out.logprob_N[r, :m], out.rank_N[r, :m], out.top_ids_NX[r, :m, :top],
            out.top_logprobs_NX[r, :m, :top], decode)
    return results
