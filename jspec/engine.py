"""Host side of generation: the model's state split for jit, logits, and two schedulers.

"continuous" (the default; jspec.continuous, jspec.speculative.batching): every request of a
call waits on device, and a slot that finishes takes the next one inside the loop.
"waves" (kept to compare against): requests sorted by prompt length run in batches of
max_num_seqs, each two programs (prefill, then the decode loop) with the state donated
between them, a batch ending when its longest request ends.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec import interrupt
from jspec.config import SamplingParams
from jspec.continuous import ContinuousBatcher, RunResult
from jspec.models import caches as cache_lib
from jspec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jspec.progress import stage
from jspec.speculative import buckets
from jspec.sharding.rules import global_array, to_host
from jspec.speculative.loop import (LoopContext, LoopPlan, in_chunks, decode_loop, merge_module,
                                    prefill, split_module)
from jspec.speculative.state import FINISH_REASONS, RequestInputs
from jspec.timing import Clock, ReadyTime


class Runner:

  def __init__(self, llm):
    self.llm = llm
    self.spec = llm.spec
    self.method = self.spec.method if self.spec else None
    self.k = self.spec.num_speculative_tokens if self.spec else 0
    self.target_graphdef, self.target_state = nnx.split(llm.target)
    # The drafter's module (an MTP or EAGLE head, a draft model), or None (n-gram, no
    # speculation: an unused MTP head stays out of the compiled programs).
    self.draft_graphdef, self.draft_state = split_module(llm.draft_module)
    self._compiled = {}         # (LoopPlan, prompt shape) -> (prefill, loop) executables
    self._logits_compiled = {}  # (batch, length) -> jitted full-sequence logits
    self.ctx = LoopContext(
        experts_fn=llm.experts_fn, draft_experts_fn=llm.draft_experts_fn, dtype=llm.dtype,
        cache_shardings=module_cache_shardings(llm.target, llm.rules, llm.mesh, llm.dtype),
        draft_cache_shardings=(module_cache_shardings(llm.draft_module, llm.draft_rules,
                                                      llm.mesh, llm.dtype)
                               if llm.draft_module is not None else None))
    self.batcher = ContinuousBatcher(self)

  def _put(self, host: np.ndarray, logical_axes) -> jax.Array:
    """A host array made global on the mesh (each process supplies its devices' slices)."""
    return global_array(host, self.llm.rules.sharding(self.llm.mesh, logical_axes))

  # ---- compilation ----------------------------------------------------------------------

  def _functions(self, plan: LoopPlan):
    tgd, dgd, ctx = self.target_graphdef, self.draft_graphdef, self.ctx

    def prefill_fn(target_state, draft_state, tokens_BP, prompt_lens_B, req):
      state = prefill(nnx.merge(tgd, target_state), merge_module(dgd, draft_state), tokens_BP,
                      prompt_lens_B, req, plan, ctx)
      # A small output of its own (the state is donated to the loop): ready with the prefill.
      return state, jnp.sum(state.lengths_B)

    def loop_fn(target_state, draft_state, state, req):
      return decode_loop(nnx.merge(tgd, target_state), merge_module(dgd, draft_state), state,
                         req, plan, ctx)

    return prefill_fn, loop_fn

  def _state_shardings(self, state_shape):
    """The loop state's layout, fixed so prefill's output is exactly the loop's input: caches by
    the rules, per-sequence arrays split over the batch axes, scalars replicated."""
    llm, batch_rows = self.llm, state_shape.tokens_BS.shape[0]

    def leaf_sharding(leaf):
      axes = ("batch",) + (None,) * (leaf.ndim - 1) if leaf.ndim and leaf.shape[0] == batch_rows \
          else (None,) * leaf.ndim
      return llm.rules.sharding(llm.mesh, axes)

    shardings = jax.tree.map(leaf_sharding, state_shape)
    return shardings.replace(
        target_caches=self.ctx.cache_shardings,
        draft=shardings.draft.replace(caches=self.ctx.draft_cache_shardings or ()))

  def _compile(self, plan: LoopPlan, tokens_BP, prompt_lens_B, req):
    key = (plan, tokens_BP.shape)
    if key not in self._compiled:
      prefill_fn, loop_fn = self._functions(plan)
      label = (f"compiling batch={plan.batch} prompt={tokens_BP.shape[1]} "
               f"cache={plan.cache_len} method={plan.method or 'none'} k={plan.k}")
      with stage(label):
        args = (self.target_state, self.draft_state, tokens_BP, prompt_lens_B, req)
        state_shape = jax.eval_shape(prefill_fn, *args)[0]
        shardings = self._state_shardings(state_shape)
        replicated = self.llm.rules.sharding(self.llm.mesh, ())
        prefill_c = interrupt.call(jax.jit(
            prefill_fn, out_shardings=(shardings, replicated)).lower(*args).compile)
        state_in = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                state_shape, shardings)
        loop_jit = jax.jit(loop_fn, out_shardings=shardings, donate_argnums=(2,))
        loop_c = interrupt.call(
            loop_jit.lower(self.target_state, self.draft_state, state_in, req).compile)
      self._compiled[key] = (prefill_c, loop_c)
    return self._compiled[key]

  # ---- generation -----------------------------------------------------------------------

  def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams],
               seeds: list[int], use_tqdm=True, decode=None) -> RunResult:
    """Outputs in prompt order, and the seconds spent running (compilation excluded)."""
    if self.llm.batching == "continuous":
      return self.batcher.generate(prompt_ids, params, seeds, use_tqdm, decode)
    outputs, seconds = self._generate_waves(prompt_ids, params, seeds)
    return RunResult(outputs, seconds)

  def _generate_waves(self, prompt_ids, params, seeds):
    # Similar lengths batch together (less padding); outputs are put back in prompt order.
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    outputs: list[RequestOutput | None] = [None] * len(prompt_ids)
    run_seconds = 0.0
    for start in range(0, len(order), self.llm.max_num_seqs):
      chunk = order[start:start + self.llm.max_num_seqs]
      # Times count from the call's start: a wave starts when the ones before it have run.
      results, seconds = self._run_batch([prompt_ids[i] for i in chunk],
                                         [params[i] for i in chunk], [seeds[i] for i in chunk],
                                         run_seconds)
      run_seconds += seconds
      for i, out in zip(chunk, results):
        outputs[i] = out
    return outputs, run_seconds

  def _request_inputs(self, prompts, params, seeds, batch) -> RequestInputs:
    llm, pad = self.llm, batch - len(prompts)
    eos = tuple(llm.config.eos_token_ids)
    stop_sets = [list(dict.fromkeys((() if p.ignore_eos else eos) + tuple(p.stop_token_ids or ())))
                 for p in params]
    width = max(4, buckets.next_pow2(max(len(s) for s in stop_sets) or 1))
    stop_ids = np.full((batch, width), -1, np.int32)
    for row, ids in enumerate(stop_sets):
      stop_ids[row, :len(ids)] = ids
    max_len = [min(len(p) + sp.max_tokens, llm.max_model_len) for p, sp in zip(prompts, params)]
    rows = lambda xs, fill, dtype: self._put(np.asarray(list(xs) + [fill] * pad, dtype), ("batch",))
    return RequestInputs(
        temperature_B=rows((p.temperature for p in params), 0.0, np.float32),
        top_k_B=rows((p.top_k for p in params), 0, np.int32),
        top_p_B=rows((p.top_p for p in params), 1.0, np.float32),
        max_len_B=rows(max_len, 0, np.int32),  # padding rows finish in prefill
        stop_ids_BX=self._put(stop_ids, ("batch", None)),
        seeds_B=rows((seed % 2**32 for seed in seeds), 0, np.uint32))  # any int seed

  def _run_batch(self, prompts, params, seeds,
                 offset_s: float = 0.0) -> tuple[list[RequestOutput], float]:
    llm, k = self.llm, self.k
    batch = buckets.batch_bucket(len(prompts), llm.mesh_config.batch_width)
    max_total = max(min(len(p) + sp.max_tokens, llm.max_model_len)
                    for p, sp in zip(prompts, params))
    cache_len = buckets.cache_bucket(max_total, k, llm.max_model_len)
    prompt_len = buckets.prompt_bucket(max(len(p) for p in prompts), cache_len)
    plan = LoopPlan(batch=batch, cache_len=cache_len, method=self.method, k=k,
                    prefill_chunk=llm.prefill_chunk_size,
                    all_greedy=all(sp.temperature == 0 for sp in params),
                    any_filtered=any(sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1)
                                     for sp in params),
                    ngram_min=self.spec.prompt_lookup_min if self.spec else 1,
                    ngram_max=self.spec.prompt_lookup_max if self.spec else 1)
    tokens = np.zeros((batch, prompt_len), np.int32)
    for row, p in enumerate(prompts):
      tokens[row, :len(p)] = p
    prompt_lens = np.ones((batch,), np.int32)
    prompt_lens[:len(prompts)] = [len(p) for p in prompts]
    tokens_BP = self._put(tokens, ("batch", "seq"))
    prompt_lens_B = self._put(prompt_lens, ("batch",))
    req = self._request_inputs(prompts, params, seeds, batch)

    prefill_c, loop_c = self._compile(plan, tokens_BP, prompt_lens_B, req)

    def run():  # on a thread of its own, so that Ctrl-C is raised at once (jspec.interrupt)
      state, prefilled = prefill_c(self.target_state, self.draft_state, tokens_BP,
                                   prompt_lens_B, req)
      prefill_done = ReadyTime(prefilled)
      state = loop_c(self.target_state, self.draft_state, state, req)
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
          metrics.drafted_at_BK[row, :k], metrics.accepted_at_BK[row, :k],
          int(metrics.num_steps_B[row]), len(generated), None,
          token_times_s=clock.seconds(emitted_at_BS[row, len(prompt):lengths_B[row]]))
      completion = CompletionOutput(index=0, token_ids=generated, text=None,
                                    finish_reason=FINISH_REASONS[int(finish_B[row])],
                                    metrics=row_metrics)
      outputs.append(RequestOutput(prompt_token_ids=list(prompt), outputs=[completion],
                                   metrics=row_metrics))
    return outputs, wall

  # ---- logits ---------------------------------------------------------------------------

  def compute_logits(self, sequences: list[list[int]]) -> list[np.ndarray]:
    """Full-sequence target logits, in batches of at most max_num_seqs, one program per bucket."""
    results = []
    for start in range(0, len(sequences), self.llm.max_num_seqs):
      results += self._logits_batch(sequences[start:start + self.llm.max_num_seqs])
    return results

  def _logits_batch(self, sequences: list[list[int]]) -> list[np.ndarray]:
    llm = self.llm
    batch = buckets.batch_bucket(len(sequences), llm.mesh_config.batch_width)
    length = buckets.prompt_bucket(max(len(s) for s in sequences), llm.max_model_len)
    tokens = np.zeros((batch, length), np.int32)
    for row, s in enumerate(sequences):
      tokens[row, :len(s)] = s
    if (batch, length) not in self._logits_compiled:
      self._logits_compiled[batch, length] = jax.jit(self._logits_fn(batch, length))
    logits_fn = self._logits_compiled[batch, length]
    logits = to_host(logits_fn(self.target_state, self._put(tokens, ("batch", "seq"))))
    # The true vocabulary: the columns that pad it to the vocab shards are not the model's.
    vocab = llm.config.vocab_size
    return [logits[row, :len(s), :vocab] for row, s in enumerate(sequences)]

  def _logits_fn(self, batch: int, length: int):
    tgd, ctx, chunk = self.target_graphdef, self.ctx, self.llm.prefill_chunk_size

    def logits_fn(target_state, tokens_BT):
      target = nnx.merge(tgd, target_state)
      positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens_BT.shape)
      caches = cache_lib.constrain(target.init_caches(batch, length, ctx.dtype),
                                   ctx.cache_shardings)
      # Every position is "valid": padding after a sequence cannot reach its logits.
      full_B = jnp.full((batch,), length, jnp.int32)
      hidden_BTD, _ = in_chunks(
          lambda t, p, c: target(t, p, c, length, ctx.experts_fn, seq_lens_B=full_B),
          (tokens_BT, positions_BT), caches, chunk)
      return target.logits(hidden_BTD)

    return logits_fn


def module_cache_shardings(module, rules, mesh, dtype) -> tuple:
  """The sharding of each of a module's per-layer caches (independent of their sizes)."""
  shapes = jax.eval_shape(lambda: module.init_caches(1, 1, dtype))
  return cache_lib.shardings(shapes, rules, mesh)
