"""The wave loop: prefill a batch, then one `lax.while_loop` of steps until it is done.

Pure functions over `DecodeState`. `prefill` runs the prompts and samples each sequence's first
token; `decode_loop` repeats the shared draft -> verify -> accept step (jspec.loop.step)
until every sequence of the batch has finished. The continuous loop reuses `prefill_with_logits`
for the first requests of a call (jspec.loop.slots.start_state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models import caches as cache_lib
from jspec.speculative import sampling
from jspec.shapes.chunks import in_chunks
from jspec.speculative.drafters.base import take_rows
from jspec.shapes.rows import set_row_items
from jspec.loop.state import (FINISH_LENGTH, FINISH_NONE, FINISH_STOP, DecodeState,
                                     Metrics, RequestInputs)
from jspec.loop.step import (TARGET_STREAM, LoopContext, LoopPlan, choose_tokens,
                                    decode_step, is_stop, stream_keys, target_forward)


def prefill(target, drafter, tokens_BP, prompt_lens_B, req: RequestInputs, plan: LoopPlan,
            ctx: LoopContext) -> DecodeState:
  """Runs the prompts, samples each sequence's first token, fills the target's and the
  drafter's state."""
  return prefill_with_logits(target, drafter, tokens_BP, prompt_lens_B, req, plan, ctx)[0]


def prefill_with_logits(target, drafter, tokens_BP, prompt_lens_B, req: RequestInputs,
                        plan: LoopPlan, ctx: LoopContext) -> tuple[DecodeState, jax.Array]:
  """`prefill`, and the float32 logits [B, V] each first token was chosen from."""
  batch, prompt_bucket = tokens_BP.shape
  positions_BP = jnp.broadcast_to(jnp.arange(prompt_bucket, dtype=jnp.int32), tokens_BP.shape)
  caches = cache_lib.constrain(target.init_caches(batch, plan.cache_len, ctx.dtype),
                               ctx.cache_shardings)
  target_out, caches = in_chunks(
      lambda t, p, c: target_forward(target, drafter, t, p, c, prompt_bucket, ctx.experts_fn,
                                     seq_lens_B=prompt_lens_B),
      (tokens_BP, positions_BP), caches, plan.prefill_chunk)
  last_B = prompt_lens_B - 1
  logits_BV = target.logits(take_rows(target_out.hidden_BTD, last_B)[:, None])[:, 0]
  keys_B = sampling.position_keys(stream_keys(req, TARGET_STREAM), prompt_lens_B[:, None])[:, 0]
  first_B, _ = choose_tokens(logits_BV, req.temperature_B, req.top_k_B, req.top_p_B, keys_B,
                             plan, ctx.vocab_argmax)

  tokens_BS = jnp.zeros((batch, plan.cache_len), jnp.int32).at[:, :prompt_bucket].set(tokens_BP)
  tokens_BS = set_row_items(tokens_BS, prompt_lens_B, first_B)
  lengths_B = prompt_lens_B + 1
  stop_B = is_stop(first_B[:, None], req.stop_ids_BX)[:, 0]
  finish_B = jnp.where(stop_B, FINISH_STOP,
                       jnp.where(lengths_B >= req.max_len_B, FINISH_LENGTH, FINISH_NONE))
  draft = drafter.prefill(tokens_BP, prompt_lens_B, first_B, target_out, plan.prefill_chunk)
  state = DecodeState(tokens_BS=tokens_BS, lengths_B=lengths_B, done_B=finish_B != FINISH_NONE,
                      finish_B=finish_B, target_caches=caches, draft=draft,
                      metrics=Metrics.zeros(batch, plan.k), step=jnp.int32(0),
                      emitted_at_BS=jnp.zeros((batch, plan.cache_len), jnp.int32))
  return state, logits_BV


def decode_loop(target, drafter, state: DecodeState, req: RequestInputs, plan: LoopPlan,
                ctx: LoopContext) -> DecodeState:
  """Steps until every sequence is done; the step bound only guards against a logic error."""
  def cond(s: DecodeState):
    return jnp.any(~s.done_B) & (s.step < plan.cache_len)

  def body(s: DecodeState):
    return decode_step(target, drafter, s, req, plan, ctx)[0]

  return jax.lax.while_loop(cond, body, state)

