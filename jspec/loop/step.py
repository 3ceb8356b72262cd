"""One draft -> verify -> accept step, and the pieces every loop that runs it shares.

Both schedulers run this step: the wave loop (jspec.loop.waves) on a batch that
started together, the continuous loop (jspec.loop.rounds) on slots that take the
next request when theirs ends. For every running sequence of length L, one step:

  1. drafts k tokens d_1..d_k through the drafter surface (jspec.speculative.drafters: an
     MTP or EAGLE head, a draft model, n-gram lookup);
  2. verifies: one target forward over [t_{L-1}, d_1..d_k] at positions L-1..L+k-1;
  3. accepts: greedy prefix match or lossless rejection sampling -> accept_len in 0..k,
     plus the target's own token after the accepted run;
  4. updates: stops exactly where vanilla decoding would (EOS / stop id / max length inside
     the accepted run), appends the emitted tokens, advances the length, commits the
     target's caches to the emitted tokens (KV caches roll back by length alone; recurrent
     layers keep the state after the last emitted token: jspec.models.caches), then "draft
     extend": hands the drafter the verified window with the target's hidden states there,
     so its state always follows the committed tokens (SGLang / vLLM draft extend).

k = 0 (no drafter) is vanilla decoding through the same step. Random draws come from two
streams per request (TARGET_STREAM, DRAFT_STREAM), keyed by (seed, position): a token never
depends on what shares the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jspec.models import caches as cache_lib, moe_backends
from jspec.speculative import sampling, verify
from jspec.speculative.drafters import TargetOut
from jspec.speculative.drafters.base import take_rows
from jspec.speculative.logprobs import TokenLogprobs, window_logprobs
from jspec.shapes.rows import row_items, set_row_items
from jspec.loop.state import (FINISH_LENGTH, FINISH_STOP, DecodeState, Metrics,
                                     RequestInputs)
from jspec.loop.tree_step import tree_window
from jspec.token_tree import TokenTree

TARGET_STREAM, DRAFT_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class LoopContext:
  """How the loop runs its modules: expert backends (EP-wrapped on a mesh) and cache layout."""
  experts_fn: Callable
  draft_experts_fn: Callable
  dtype: object
  # Per-layer cache shardings (jspec.models.caches.shardings) of the target and the draft, or
  # None (no constraint).
  cache_shardings: tuple | None = None
  draft_cache_shardings: tuple | None = None
  # The mesh's replicated sharding, or None (one device): the admission's walk over the queue
  # runs on every shard from replicated inputs (jspec.loop.rounds.admit says why).
  replicated: object = None
  # The greedy argmax over the target's and the draft's logits: sampling.vocab_argmax, or where
  # the mesh splits a vocabulary, the same tokens in one all-reduce
  # (jspec.sharding.vocab.sharded_vocab_argmax).
  vocab_argmax: Callable = sampling.vocab_argmax
  draft_vocab_argmax: Callable = sampling.vocab_argmax


@dataclasses.dataclass(frozen=True)
class LoopPlan:
  """Everything static about one compiled program (hashable: it keys the jit cache)."""
  batch: int
  cache_len: int
  method: str | None       # None or a method (jspec.speculative.drafters.METHODS)
  k: int                   # drafts per step; 0 without speculation
  all_greedy: bool         # every request has temperature 0: argmax paths only
  any_filtered: bool = True  # some request uses top-k or top-p (the sampling path sorts)
  ngram_min: int = 1
  ngram_max: int = 3
  prefill_chunk: int = 1024  # prompt tokens per sequence per prefill pass (bounds attention memory)
  # Log-probabilities of emitted tokens with this many alternatives (jspec.speculative.logprobs),
  # from the verify pass; None: not computed.
  num_logprobs: int | None = None
  # A token tree to verify instead of a chain, k = its nodes - 1.
  tree: TokenTree | None = None


@struct.dataclass
class StepOutputs:
  """What one step emitted, beside the new state: the window's tokens (the first num_emit_B
  of each running row) and, when the plan asks, their log-probabilities [B, k+1]."""
  out_tokens_BT: jax.Array
  num_emit_B: jax.Array
  logprobs: TokenLogprobs | None = None


def stream_keys(req: RequestInputs, stream: int):
  return jax.vmap(lambda seed: jax.random.fold_in(jax.random.key(seed), stream))(req.seeds_B)


def choose_tokens(logits_NV, temperature_N, top_k_N, top_p_N, keys_N, plan: "LoopPlan",
                  argmax: Callable = sampling.vocab_argmax):
  """Token and the distribution it was drawn from (None when every row is greedy); `argmax`
  for greedy programs (LoopContext.vocab_argmax)."""
  if plan.all_greedy:
    return argmax(logits_NV).astype(jnp.int32), None
  probs_NV = sampling.processed_probs(logits_NV, temperature_N, top_k_N, top_p_N,
                                      plan.any_filtered)
  return sampling.sample(probs_NV, keys_N), probs_NV


def is_stop(tokens_BT, stop_ids_BX):
  return jnp.any(tokens_BT[..., None] == stop_ids_BX[:, None, :], axis=-1)


def target_forward(target, drafter, tokens_BT, positions_BT, caches, kv_window: int,
                    experts_fn, seq_lens_B=None, live_B=None):
  """The target over a window, with the layer inputs the drafter reads (TargetOut). MoE
  layers route the live tokens only (moe_backends.live_tokens_only): a prefill's positions
  before seq_lens_B, a step's rows of live_B [B] (a dead row's window is never committed)."""
  if seq_lens_B is not None:
    live_BT = positions_BT < seq_lens_B[:, None]
  elif live_B is not None and tokens_BT.shape[0] > 1:  # one row runs until it ends
    live_BT = jnp.broadcast_to(live_B[:, None], tokens_BT.shape)
  else:
    live_BT = None
  if live_BT is not None:
    experts_fn = moe_backends.live_tokens_only(experts_fn, live_BT)
  if drafter.aux_layers:
    hidden_BTD, caches, aux = target(tokens_BT, positions_BT, caches, kv_window, experts_fn,
                                     seq_lens_B=seq_lens_B, aux_layers=drafter.aux_layers)
    return TargetOut(hidden_BTD, aux), caches
  hidden_BTD, caches = target(tokens_BT, positions_BT, caches, kv_window, experts_fn,
                              seq_lens_B=seq_lens_B)
  return TargetOut(hidden_BTD), caches


def draft_chooser(req: RequestInputs, lengths_B, plan: LoopPlan,
                  argmax: Callable = sampling.vocab_argmax):
  """choose(logits_BV, j) for the drafter: draft j's token and distribution, drawn from the
  draft random stream at its own position (so a draft never reuses a verify key)."""
  keys_BK = sampling.position_keys(
      stream_keys(req, DRAFT_STREAM), lengths_B[:, None] + jnp.arange(plan.k, dtype=jnp.int32))

  def choose(logits_BV, j: int):
    return choose_tokens(logits_BV, req.temperature_B, req.top_k_B, req.top_p_B, keys_BK[:, j],
                         plan, argmax)

  return choose


def accept(target_logits_BTV, drafts_BK, draft_len_B, draft_probs_BKV, state, req, plan,
           argmax: Callable = sampling.vocab_argmax):
  k = plan.k
  if plan.all_greedy:
    return verify.greedy_verify(drafts_BK, draft_len_B, target_logits_BTV, argmax)
  batch = target_logits_BTV.shape[0]
  target_probs_BTV = sampling.processed_rows(target_logits_BTV, req.temperature_B, req.top_k_B,
                                             req.top_p_B, plan.any_filtered)
  keys_BT = sampling.position_keys(stream_keys(req, TARGET_STREAM),
                                   state.lengths_B[:, None] + jnp.arange(k + 1, dtype=jnp.int32))
  if k == 0:  # Vanilla sampling: the "bonus" token is the only token.
    return jnp.zeros((batch,), jnp.int32), sampling.sample(
        target_probs_BTV[:, 0], keys_BT[:, 0])[:, None]
  return verify.rejection_verify(drafts_BK, draft_len_B, draft_probs_BKV, target_probs_BTV,
                                 keys_BT)


def decode_step(target, drafter, state: DecodeState, req: RequestInputs, plan: LoopPlan,
                ctx: LoopContext) -> tuple[DecodeState, StepOutputs]:
  lengths_B = state.lengths_B
  last_token_B = row_items(state.tokens_BS, lengths_B - 1)
  if plan.tree is not None:
    forward = lambda t, p, c: target_forward(target, drafter, t, p, c, plan.cache_len,
                                             ctx.experts_fn, live_B=~state.done_B)
    (accept_len_B, out_tokens_BT, target_out, window_caches, draft, logits_BTV,
     draft_len_B) = tree_window(target, drafter, state, req, last_token_B, plan, ctx, forward,
                                (stream_keys(req, TARGET_STREAM), stream_keys(req, DRAFT_STREAM)))
    positions_BT = lengths_B[:, None] - 1 + jnp.arange(plan.k + 1, dtype=jnp.int32)
  else:
    (accept_len_B, out_tokens_BT, target_out, window_caches, draft, logits_BTV, draft_len_B,
     positions_BT) = _chain_window(target, drafter, state, req, plan, ctx, last_token_B)
  return _finish_step(state, req, plan, drafter, accept_len_B, out_tokens_BT, target_out,
                      window_caches, draft, logits_BTV, draft_len_B, positions_BT)


def _chain_window(target, drafter, state, req, plan, ctx, last_token_B):
  """A chain's draft, verify and accept: the drafts at positions L..L+k-1."""
  k, batch, lengths_B = plan.k, plan.batch, state.lengths_B
  draft, draft_probs_BKV = state.draft, None
  if k > 0:
    drafts_BK, draft_len_B, draft_probs_BKV, draft = drafter.propose(
        draft, state.tokens_BS, lengths_B,
        draft_chooser(req, lengths_B, plan, ctx.draft_vocab_argmax), live_B=~state.done_B)
  else:
    drafts_BK, draft_len_B = jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch,), jnp.int32)

  verify_tokens_BT = jnp.concatenate([last_token_B[:, None], drafts_BK], axis=1)
  positions_BT = lengths_B[:, None] - 1 + jnp.arange(k + 1, dtype=jnp.int32)
  target_out, window_caches = target_forward(target, drafter, verify_tokens_BT, positions_BT,
                                              state.target_caches, plan.cache_len,
                                              ctx.experts_fn, live_B=~state.done_B)
  logits_BTV = target.logits(target_out.hidden_BTD)
  accept_len_B, out_tokens_BT = accept(logits_BTV, drafts_BK, draft_len_B, draft_probs_BKV,
                                        state, req, plan, ctx.vocab_argmax)
  return (accept_len_B, out_tokens_BT, target_out, window_caches, draft, logits_BTV,
          draft_len_B, positions_BT)


def _finish_step(state, req, plan, drafter, accept_len_B, out_tokens_BT, target_out,
                 window_caches, draft, logits_BTV, draft_len_B, positions_BT):
  """Stops, tokens, lengths, caches, the drafter's extend and the metrics after acceptance."""
  k, lengths_B = plan.k, state.lengths_B
  running_B = ~state.done_B

  # Stop exactly where one-token-at-a-time decoding would: the first emitted token that is a
  # stop id, or that brings the sequence to its maximum length, ends it.
  offsets_T = jnp.arange(k + 1, dtype=jnp.int32)
  emitted_BT = offsets_T[None, :] <= accept_len_B[:, None]
  stop_tok_BT = is_stop(out_tokens_BT, req.stop_ids_BX)
  full_BT = lengths_B[:, None] + offsets_T + 1 >= req.max_len_B[:, None]
  ends_BT = emitted_BT & (stop_tok_BT | full_BT)
  any_end_B = jnp.any(ends_BT, axis=1)
  first_end_B = jnp.argmax(ends_BT, axis=1).astype(jnp.int32)
  num_emit_B = jnp.where(any_end_B, first_end_B + 1, accept_len_B + 1)
  end_reason_B = jnp.where(take_rows(stop_tok_BT, first_end_B), FINISH_STOP, FINISH_LENGTH)
  finish_B = jnp.where(running_B & any_end_B, end_reason_B, state.finish_B)

  # Slots past the new length hold garbage that is never read; a finished row writes there too.
  write_positions_BT = lengths_B[:, None] + offsets_T
  tokens_BS = set_row_items(state.tokens_BS, write_positions_BT, out_tokens_BT)
  emitted_at_BS = set_row_items(state.emitted_at_BS, write_positions_BT, state.step + 1)
  new_lengths_B = jnp.where(running_B, lengths_B + num_emit_B, lengths_B)
  # A finished row keeps its caches as they were: none of its window is committed.
  target_caches = cache_lib.commit(window_caches, jnp.where(running_B, num_emit_B, 0))

  if k > 0:
    draft = drafter.extend(draft, out_tokens_BT, positions_BT, num_emit_B, running_B, target_out)

  m = state.metrics
  run_i = running_B.astype(jnp.int32)
  if k > 0:
    positions_K = jnp.arange(k, dtype=jnp.int32)
    drafted_BK = (positions_K[None] < draft_len_B[:, None]).astype(jnp.int32) * run_i[:, None]
    accepted_BK = (positions_K[None] < (num_emit_B - 1)[:, None]).astype(jnp.int32)
    accepted_BK = accepted_BK * run_i[:, None]
  else:
    drafted_BK = accepted_BK = jnp.zeros_like(m.drafted_at_BK)
  metrics = Metrics(num_steps_B=m.num_steps_B + run_i,
                    num_drafted_B=m.num_drafted_B + jnp.sum(drafted_BK, axis=1),
                    num_accepted_B=m.num_accepted_B + run_i * (num_emit_B - 1),
                    drafted_at_BK=m.drafted_at_BK + drafted_BK,
                    accepted_at_BK=m.accepted_at_BK + accepted_BK)
  # The verify pass scored every window position with the target given the accepted prefix:
  # the same logits one-token decoding samples from, hence its log-probabilities.
  logprobs = (None if plan.num_logprobs is None else
              window_logprobs(logits_BTV, jnp.maximum(out_tokens_BT, 0), plan.num_logprobs))
  return DecodeState(tokens_BS=tokens_BS, lengths_B=new_lengths_B,
                     done_B=state.done_B | (running_B & any_end_B), finish_B=finish_B,
                     target_caches=target_caches, draft=draft, metrics=metrics,
                     step=state.step + 1, emitted_at_BS=emitted_at_BS), StepOutputs(
                         out_tokens_BT, num_emit_B, logprobs)


