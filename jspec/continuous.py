"""Host side of continuous batching: one program per call's shapes, run as a few dispatches.

A call compiles (once per shape: slots, cache slots, queue buckets, drafter) an `init`
program that allocates the slots' state and a `dispatch` program that runs the loop until
its Finished rows fill or its iteration budget is spent (jspec.speculative.batching). The
state is donated from one dispatch to the next and never leaves the device. A worker thread
(DispatchChain) launches each dispatch as soon as the previous one returns, *before* the host
reads that one's finished rows, so the device waits neither for the host's collecting,
progress bar or output building nor for a hand-off between threads: the host's work per
dispatch runs while the next dispatch computes. The last dispatch, launched before the host
knew every request was done, finds nothing to do and returns at once.

The iteration budget adapts so that a dispatch lasts about `DISPATCH_SECONDS` (the progress
bar's refresh), whatever a step costs.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue as queues
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.outputs import RequestOutput, position_logprobs
from jspec.progress import RequestProgress, stage
from jspec.requests import FinishedCompletion, OutputCollector, plan_queue, queue_arrays
from jspec.sharding.rules import to_host
from jspec.speculative import batching, buckets
from jspec.speculative.drafters import make_drafter
from jspec.speculative.logprobs import prompt_logprobs_fn
from jspec.speculative.loop import LoopPlan, merge_module
from jspec.speculative.state import FINISH_REASONS

DISPATCH_SECONDS = 0.5
FIRST_BUDGET = 64          # iterations of the first dispatch
MAX_BUDGET = 1 << 20


@dataclasses.dataclass
class DispatchTiming:
  """One dispatch as the launching thread saw it. On a GPU a launch returns when its while
  loop has ended (the host reads the loop condition back), so `seconds` is the dispatch's
  device time plus the launch; on a CPU a launch returns at once."""
  start_s: float       # when the launch began, from the call's start
  seconds: float       # how long the launch took
  iterations: int = 0  # loop iterations it ran (0: nothing was left to do)


@dataclasses.dataclass
class RunResult:
  outputs: list[RequestOutput]
  wall_time_s: float
  host_seconds_per_dispatch: float = 0.0  # host work per dispatch (overlapped with the next)
  dispatches: list[DispatchTiming] = dataclasses.field(default_factory=list)


class DispatchChain:
  """Runs dispatches back to back on a worker thread, each on the state the last one returned.

  On a GPU the launching thread drives a dispatch's while loop (it reads the loop condition
  back each iteration), so a launch returns only when its dispatch is done. The worker
  therefore launches the next dispatch as soon as the last one returns, without waiting on the
  host, and hands the host the finished rows. It runs at most one dispatch ahead of the
  host's collecting: the host allows each further dispatch with `proceed()` once it has
  collected the one before, and `close()` lets the last launched one end the chain. On a CPU a
  launch returns at once and the same order holds.
  """

  def __init__(self, launch, state, budget: int):
    self._launch = launch
    self.budget = budget  # iterations for the next launch; the host adapts it
    self._finished = queues.Queue()
    self._permits = queues.Queue()
    self._permits.put(True)  # the second dispatch runs while the host collects the first
    self._thread = threading.Thread(target=self._run, args=(state,), name="jspec-dispatch",
                                    daemon=True)
    self._thread.start()

  def _run(self, state):
    try:
      while True:
        state, finished = self._launch(state, self.budget)
        self._finished.put(finished)
        if not self._permits.get():
          return
    except BaseException as err:  # re-raised on the host's thread by next()
      self._finished.put(err)

  def next(self):
    """The next dispatch's Finished rows, once its launch has returned."""
    item = self._finished.get()
    if isinstance(item, BaseException):
      raise item
    return item

  def proceed(self):
    self._permits.put(True)

  def close(self):
    self._permits.put(False)
    self._thread.join()


class ContinuousBatcher:
  """Compiles and runs the continuous-batching loop for a Runner (jspec.engine)."""

  def __init__(self, runner):
    self.runner = runner
    self.llm = runner.llm
    self._compiled = {}       # (BatchPlan, queue shapes) -> (init, dispatch)
    self._prompt_compiled = {}
    self.finished_rows = None  # Finished rows per dispatch; None: twice the slots
    self.budget = None         # iterations per dispatch; None: adapted to DISPATCH_SECONDS

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

  def _compile(self, plan: batching.BatchPlan, queue):
    key = (plan, jax.tree.map(lambda x: x.shape, queue))
    if key in self._compiled:
      return self._compiled[key]
    runner, ctx = self.runner, self.runner.ctx
    tgd, dgd = runner.target_graphdef, runner.draft_graphdef

    def init_fn(target_state, draft_state, queue):
      target = nnx.merge(tgd, target_state)
      drafter = make_drafter(plan.loop.method, target, merge_module(dgd, draft_state),
                             plan.loop, ctx)
      return batching.init_state(target, drafter, queue, plan, ctx)

    def dispatch_fn(target_state, draft_state, state, queue, budget):
      return batching.dispatch(nnx.merge(tgd, target_state), merge_module(dgd, draft_state),
                               state, queue, budget, plan, ctx)

    lp = plan.loop
    label = (f"compiling continuous batch={lp.batch} cache={lp.cache_len} chunk="
             f"{lp.prefill_chunk} method={lp.method or 'none'} k={lp.k}")
    with stage(label):
      args = (runner.target_state, runner.draft_state, queue)
      state_shape = jax.eval_shape(init_fn, *args)
      shardings = self._shardings(state_shape, lp.batch)
      init_c = jax.jit(init_fn, out_shardings=shardings).lower(*args).compile()
      state_in = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              state_shape, shardings)
      replicated = self.llm.rules.sharding(self.llm.mesh, ())
      budget = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
      finished_shape = jax.eval_shape(dispatch_fn, runner.target_state, runner.draft_state,
                                      state_in, queue, budget)[1]
      finished_sh = jax.tree.map(
          lambda x: self.llm.rules.sharding(self.llm.mesh, (None,) * x.ndim), finished_shape)
      dispatch_c = jax.jit(dispatch_fn, out_shardings=(shardings, finished_sh),
                           donate_argnums=(2,)).lower(
                               runner.target_state, runner.draft_state, state_in, queue,
                               budget).compile()
    self._compiled[key] = (init_c, dispatch_c)
    return init_c, dispatch_c

  # ---- a call ----------------------------------------------------------------------------

  def generate(self, prompt_ids, params, seeds, use_tqdm=True, decode=None) -> RunResult:
    runner, llm = self.runner, self.llm
    plan, queue_plan = self._plans(prompt_ids, params, seeds)
    arrays = queue_arrays(queue_plan, llm.config.eos_token_ids, llm.max_model_len)
    queue = batching.Queue(**{name: runner._put(a, (None,) * a.ndim)
                              for name, a in arrays.items()})
    init_c, dispatch_c = self._compile(plan, queue)
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
      out = dispatch_c(*targets, state, queue, budgets[budget])
      timings.append(DispatchTiming(begin - start, time.perf_counter() - begin))
      return out

    def collect(finished) -> int:
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
                        accepted_at_K=host.accepted_at_FK[i], logprobs=lps)
        collector.add(done)
        request = queue_plan.groups[done.group].request
        remaining[request] -= 1
        done_requests += remaining[request] == 0
        tokens += n
      progress.update(done_requests, tokens)
      return int(host.iterations)

    start = time.perf_counter()
    chain = DispatchChain(launch, init_c(*targets, queue), self.budget or FIRST_BUDGET)
    host_seconds, last = 0.0, start
    try:
      for index in itertools.count():
        pending = chain.next()
        jax.block_until_ready(pending.count)
        ready = time.perf_counter()
        iterations = collect(pending)
        timings[index].iterations = iterations
        host_seconds += time.perf_counter() - ready
        if collector.num_finished == queue_plan.num_sequences:
          break
        if iterations and self.budget is None:
          rate = iterations / max(ready - last, 1e-6)
          budget = int(min(MAX_BUDGET, max(FIRST_BUDGET, rate * DISPATCH_SECONDS)))
          chain.budget = buckets.next_pow2(budget)  # few distinct budget arrays
        last = ready
        chain.proceed()
      # The dispatch launched before the host knew every request was done: nothing to do.
      timings[-1].iterations = collect(chain.next())
    finally:
      chain.close()
    wall = time.perf_counter() - start
    progress.close()
    outputs = collector.outputs(wall, prompt_lps)
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
