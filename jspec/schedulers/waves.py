"""The waves scheduler (`batching="waves"`, kept to compare against): requests sorted by prompt
length run in batches of max_num_seqs, each as two programs (prefill, then the decode loop of
jspec.loop.waves) with the state donated between them; a batch ends when its longest
request ends, and the next one starts then.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec import interrupt
from jspec.config import SamplingParams
from jspec.device import DeviceModel
from jspec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jspec.progress import stage
from jspec.schedulers.base import (RunResult, cache_len_for, draft_positions, loop_plan,
                                   num_drafts, program_models)
from jspec.sharding.rules import to_host
from jspec.shapes import buckets
from jspec.loop.waves import decode_loop, prefill
from jspec.loop.state import FINISH_REASONS, RequestInputs
from jspec.loop.step import LoopPlan
from jspec.timing import Clock, ReadyTime


class WavesScheduler:
  """Compiles and runs the wave loop over a DeviceModel (jspec.device)."""

  def __init__(self, device: DeviceModel, parts):
    self.device, self.parts = device, parts
    self.k = num_drafts(parts.spec)
    self.programs = {}  # (LoopPlan, prompt shape) -> (prefill, loop) executables

  # ---- compilation ----------------------------------------------------------------------

  def _functions(self, plan: LoopPlan):
    device, ctx = self.device, self.device.ctx

    def prefill_fn(target_state, draft_state, tokens_BP, prompt_lens_B, req):
      target, drafter = program_models(device, target_state, draft_state, plan, in_loop=False)
      state = prefill(target, drafter, tokens_BP, prompt_lens_B, req, plan, ctx)
      # A small output of its own (the state is donated to the loop): ready with the prefill.
      return state, jnp.sum(state.lengths_B)

    def loop_fn(target_state, draft_state, state, req):
      target, drafter = program_models(device, target_state, draft_state, plan, in_loop=True)
      return decode_loop(target, drafter, state, req, plan, ctx)

    return prefill_fn, loop_fn

  def _state_shardings(self, state_shape):
    """The loop state's layout, fixed so prefill's output is exactly the loop's input: caches by
    the rules, per-sequence arrays split over the batch axes, scalars replicated."""
    shardings = self.device.batch_shardings(state_shape, state_shape.tokens_BS.shape[0])
    return self.device.with_cache_shardings(shardings)

  def _compile(self, plan: LoopPlan, tokens_BP, prompt_lens_B, req):
    key = (plan, tokens_BP.shape)
    if key not in self.programs:
      prefill_fn, loop_fn = self._functions(plan)
      label = (f"compiling batch={plan.batch} prompt={tokens_BP.shape[1]} "
               f"cache={plan.cache_len} method={plan.method or 'none'} k={plan.k}")
      with stage(label):
        args = (*self.device.weights, tokens_BP, prompt_lens_B, req)
        state_shape = jax.eval_shape(prefill_fn, *args)[0]
        shardings = self._state_shardings(state_shape)
        replicated = self.device.sharding(())
        state_in = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                state_shape, shardings)
        loop_jit = jax.jit(loop_fn, out_shardings=shardings, donate_argnums=(2,))
        prefill_c, loop_c = interrupt.compile_programs([
            lambda: jax.jit(prefill_fn, out_shardings=(shardings, replicated)).lower(*args),
            lambda: loop_jit.lower(*self.device.weights, state_in, req)])
      self.programs[key] = (prefill_c, loop_c)
    return self.programs[key]

  # ---- generation -----------------------------------------------------------------------

  def check(self, params: list[SamplingParams]):
    if any(p.n > 1 or p.logprobs is not None or p.prompt_logprobs is not None for p in params):
      raise ValueError("batching='waves' generates one completion per prompt without "
                       "logprobs; use batching='continuous' for n, logprobs and prompt_logprobs")

  def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams],
               seeds: list[int], use_tqdm=True, decode=None) -> RunResult:
    """Outputs in prompt order, and the seconds spent running (compilation excluded);
    no progress bar, no per-token text (one completion per prompt, no logprobs)."""
    del use_tqdm, decode
    # Similar lengths batch together (less padding); outputs are put back in prompt order.
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    outputs: list[RequestOutput | None] = [None] * len(prompt_ids)
    run_seconds = 0.0
    for start in range(0, len(order), self.parts.max_num_seqs):
      chunk = order[start:start + self.parts.max_num_seqs]
      # Times count from the call's start: a wave starts when the ones before it have run.
      results, seconds = self._run_batch([prompt_ids[i] for i in chunk],
                                         [params[i] for i in chunk], [seeds[i] for i in chunk],
                                         run_seconds)
      run_seconds += seconds
      for i, out in zip(chunk, results):
        outputs[i] = out
    return RunResult(outputs, run_seconds)

  def _request_inputs(self, prompts, params, seeds, batch) -> RequestInputs:
    parts, pad = self.parts, batch - len(prompts)
    eos = tuple(parts.config.eos_token_ids)
    stop_sets = [list(dict.fromkeys((() if p.ignore_eos else eos) + tuple(p.stop_token_ids or ())))
                 for p in params]
    width = max(4, buckets.next_pow2(max(len(s) for s in stop_sets) or 1))
    stop_ids = np.full((batch, width), -1, np.int32)
    for row, ids in enumerate(stop_sets):
      stop_ids[row, :len(ids)] = ids
    max_len = [min(len(p) + sp.max_tokens, parts.max_model_len) for p, sp in zip(prompts, params)]
    rows = lambda xs, fill, dtype: self.device.put(np.asarray(list(xs) + [fill] * pad, dtype),
                                                   ("batch",))
    return RequestInputs(
        temperature_B=rows((p.temperature for p in params), 0.0, np.float32),
        top_k_B=rows((p.top_k for p in params), 0, np.int32),
        top_p_B=rows((p.top_p for p in params), 1.0, np.float32),
        max_len_B=rows(max_len, 0, np.int32),  # padding rows finish in prefill
        stop_ids_BX=self.device.put(stop_ids, ("batch", None)),
        seeds_B=rows((seed % 2**32 for seed in seeds), 0, np.uint32))  # any int seed

  def _run_batch(self, prompts, params, seeds,
                 offset_s: float = 0.0) -> tuple[list[RequestOutput], float]:
    parts, k, put = self.parts, self.k, self.device.put
    depth = draft_positions(parts.spec)  # the metrics' positions
    batch = buckets.batch_bucket(len(prompts), parts.mesh_config.batch_width)
    cache_len = cache_len_for(prompts, params, k, parts.max_model_len)
    prompt_len = buckets.prompt_bucket(max(len(p) for p in prompts), cache_len)
    plan = loop_plan(parts.spec, params, batch=batch, cache_len=cache_len,
                     prefill_chunk=parts.prefill_chunk_size)
    tokens = np.zeros((batch, prompt_len), np.int32)
    for row, p in enumerate(prompts):
      tokens[row, :len(p)] = p
    prompt_lens = np.ones((batch,), np.int32)
    prompt_lens[:len(prompts)] = [len(p) for p in prompts]
    tokens_BP = put(tokens, ("batch", "seq"))
    prompt_lens_B = put(prompt_lens, ("batch",))
    req = self._request_inputs(prompts, params, seeds, batch)

    prefill_c, loop_c = self._compile(plan, tokens_BP, prompt_lens_B, req)

    def run():  # on a thread of its own, so that Ctrl-C is raised at once (jspec.interrupt)
      state, prefilled = prefill_c(*self.device.weights, tokens_BP, prompt_lens_B, req)
      prefill_done = ReadyTime(prefilled)
      state = loop_c(*self.device.weights, state, req)
      return prefill_done, to_host((state.tokens_BS, state.emitted_at_BS, state.lengths_B,
                                    state.finish_B, state.metrics, state.step))

    start = time.perf_counter()
    prefill_done, host = interrupt.call(run)
    wall = time.perf_counter() - start
    tokens_BS, emitted_at_BS, lengths_B, finish_B, metrics, steps = host
    clock = Clock(offset_s + prefill_done.get() - start)
    clock.add(int(steps), offset_s, offset_s + wall)

    outputs = []
    for row, prompt in enumerate(prompts):
      generated = tokens_BS[row, len(prompt):lengths_B[row]].tolist()
      row_metrics = RequestMetrics.from_counts(
          metrics.drafted_at_BK[row, :depth], metrics.accepted_at_BK[row, :depth],
          int(metrics.num_steps_B[row]), len(generated), None,
          token_times_s=clock.seconds(emitted_at_BS[row, len(prompt):lengths_B[row]]))
      completion = CompletionOutput(index=0, token_ids=generated, text=None,
                                    finish_reason=FINISH_REASONS[int(finish_B[row])],
                                    metrics=row_metrics)
      outputs.append(RequestOutput(prompt_token_ids=list(prompt), outputs=[completion],
                                   metrics=row_metrics))
    return outputs, wall
