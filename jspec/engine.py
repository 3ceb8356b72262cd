"""Host side of generation: group requests into buckets, compile once per bucket, run, unpack.

The device work of a batch is two compiled programs, prefill and the decode loop; between
them the state stays on device (donated), and nothing returns to the host until every
sequence of the batch is done.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.config import SamplingParams
from jspec.models.qwen3 import empty_caches
from jspec.outputs import RequestMetrics, RequestOutput
from jspec.progress import stage
from jspec.speculative import buckets
from jspec.speculative.loop import LoopPlan, decode_loop, merge_module, prefill
from jspec.speculative.state import FINISH_REASONS, RequestInputs


class Runner:

  def __init__(self, llm):
    self.llm = llm
    self.spec = llm.spec
    self.method = self.spec.method if self.spec else None
    self.k = self.spec.num_speculative_tokens if self.spec else 0
    self.target_graphdef, self.target_state = nnx.split(llm.target)
    if self.method == "mtp":
      self.mtp_graphdef, self.mtp_state = nnx.split(llm.mtp)
    else:  # The head is not needed: keep it out of the compiled programs.
      self.mtp_graphdef, self.mtp_state = None, None
    self._compiled = {}

  # ---- compilation ----------------------------------------------------------------------

  def _functions(self, plan: LoopPlan):
    llm, tgd, mgd = self.llm, self.target_graphdef, self.mtp_graphdef

    def prefill_fn(target_state, mtp_state, tokens_BP, prompt_lens_B, req):
      return prefill(nnx.merge(tgd, target_state), merge_module(mgd, mtp_state), tokens_BP,
                     prompt_lens_B, req, plan, llm.experts_fn, llm.dtype)

    def loop_fn(target_state, mtp_state, state, req):
      return decode_loop(nnx.merge(tgd, target_state), merge_module(mgd, mtp_state), state, req,
                         plan, llm.experts_fn)

    return jax.jit(prefill_fn), jax.jit(loop_fn, donate_argnums=(2,))

  def _compile(self, plan: LoopPlan, tokens_BP, prompt_lens_B, req):
    key = (plan, tokens_BP.shape)
    if key not in self._compiled:
      prefill_jit, loop_jit = self._functions(plan)
      label = (f"compiling batch={plan.batch} prompt={tokens_BP.shape[1]} "
               f"cache={plan.cache_len} method={plan.method or 'none'} k={plan.k}")
      with stage(label):
        prefill_c = prefill_jit.lower(self.target_state, self.mtp_state, tokens_BP,
                                      prompt_lens_B, req).compile()
        state_shape = jax.eval_shape(prefill_jit, self.target_state, self.mtp_state, tokens_BP,
                                     prompt_lens_B, req)
        loop_c = loop_jit.lower(self.target_state, self.mtp_state, state_shape, req).compile()
      self._compiled[key] = (prefill_c, loop_c)
    return self._compiled[key]

  # ---- generation -----------------------------------------------------------------------

  def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams],
               seeds: list[int]) -> tuple[list[RequestOutput], float]:
    """Outputs in prompt order, and the seconds spent running (compilation excluded)."""
    # Similar lengths batch together (less padding); outputs are put back in prompt order.
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    outputs: list[RequestOutput | None] = [None] * len(prompt_ids)
    run_seconds = 0.0
    for start in range(0, len(order), self.llm.max_num_seqs):
      chunk = order[start:start + self.llm.max_num_seqs]
      results, seconds = self._run_batch([prompt_ids[i] for i in chunk], [params[i] for i in chunk],
                                [seeds[i] for i in chunk])
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
    f32 = lambda xs, fill: jnp.asarray(list(xs) + [fill] * pad, jnp.float32)
    i32 = lambda xs, fill: jnp.asarray(list(xs) + [fill] * pad, jnp.int32)
    return RequestInputs(
        temperature_B=f32((p.temperature for p in params), 0.0),
        top_k_B=i32((p.top_k for p in params), 0),
        top_p_B=f32((p.top_p for p in params), 1.0),
        max_len_B=i32(max_len, 0),  # padding rows finish in prefill
        stop_ids_BX=jnp.asarray(stop_ids),
        seed_keys_B=jax.vmap(jax.random.key)(jnp.asarray(list(seeds) + [0] * pad, jnp.uint32)))

  def _run_batch(self, prompts, params, seeds) -> tuple[list[RequestOutput], float]:
    llm, k = self.llm, self.k
    batch = buckets.batch_bucket(len(prompts), llm.mesh_config.batch_width)
    max_total = max(min(len(p) + sp.max_tokens, llm.max_model_len)
                    for p, sp in zip(prompts, params))
    cache_len = buckets.cache_bucket(max_total, k, llm.max_model_len)
    prompt_len = buckets.prompt_bucket(max(len(p) for p in prompts), cache_len)
    plan = LoopPlan(batch=batch, cache_len=cache_len, method=self.method, k=k,
                    all_greedy=all(sp.temperature == 0 for sp in params),
                    ngram_min=self.spec.prompt_lookup_min if self.spec else 1,
                    ngram_max=self.spec.prompt_lookup_max if self.spec else 1)
    tokens = np.zeros((batch, prompt_len), np.int32)
    for row, p in enumerate(prompts):
      tokens[row, :len(p)] = p
    prompt_lens = np.ones((batch,), np.int32)
    prompt_lens[:len(prompts)] = [len(p) for p in prompts]
    tokens_BP, prompt_lens_B = jnp.asarray(tokens), jnp.asarray(prompt_lens)
    req = self._request_inputs(prompts, params, seeds, batch)

    prefill_c, loop_c = self._compile(plan, tokens_BP, prompt_lens_B, req)
    start = time.perf_counter()
    state = prefill_c(self.target_state, self.mtp_state, tokens_BP, prompt_lens_B, req)
    state = loop_c(self.target_state, self.mtp_state, state, req)
    host = jax.device_get((state.tokens_BS, state.lengths_B, state.finish_B, state.metrics))
    wall = time.perf_counter() - start
    tokens_BS, lengths_B, finish_B, metrics = host

    outputs = []
    for row, prompt in enumerate(prompts):
      generated = tokens_BS[row, len(prompt):lengths_B[row]].tolist()
      row_metrics = RequestMetrics.from_counts(
          metrics.drafted_at_BK[row, :k], metrics.accepted_at_BK[row, :k],
          int(metrics.num_steps_B[row]), len(generated), wall)
      outputs.append(RequestOutput(prompt_token_ids=list(prompt), token_ids=generated, text=None,
                                   finish_reason=FINISH_REASONS[int(finish_B[row])],
                                   metrics=row_metrics))
    return outputs, wall

  # ---- logits ---------------------------------------------------------------------------

  def compute_logits(self, sequences: list[list[int]]) -> list[np.ndarray]:
    llm, tgd = self.llm, self.target_graphdef
    batch = buckets.batch_bucket(len(sequences), llm.mesh_config.batch_width)
    length = buckets.prompt_bucket(max(len(s) for s in sequences), llm.max_model_len)
    tokens = np.zeros((batch, length), np.int32)
    for row, s in enumerate(sequences):
      tokens[row, :len(s)] = s

    @jax.jit
    def logits_fn(target_state, tokens_BT):
      target = nnx.merge(tgd, target_state)
      positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens_BT.shape)
      caches = empty_caches(target.cfg, target.cfg.num_layers, batch, length, llm.dtype)
      hidden_BTD, _ = target(tokens_BT, positions_BT, caches, length, llm.experts_fn)
      return target.logits(hidden_BTD)

    logits = np.asarray(jax.device_get(logits_fn(self.target_state, jnp.asarray(tokens))))
    return [logits[row, :len(s)] for row, s in enumerate(sequences)]
