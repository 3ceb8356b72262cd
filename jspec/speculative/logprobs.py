"""Log-probabilities as vLLM returns them (`SamplingParams.logprobs`, `prompt_logprobs`).

Per position: the chosen token's log-probability under the target's raw log-softmax (vLLM's
default logprobs mode: before temperature, top-k and top-p), its rank in the vocabulary, and
the top-N alternatives. Generated tokens take them from the verify pass that scored them (the
same logits vanilla decoding samples from); prompt tokens from a separate pass over the
prompts, chunked so that no [prompt x vocab] array ever exists.

The vocabulary is the padded one (jspec.models.layers.mask_padded_vocab): padding columns have
-inf logits, hence -inf log-probabilities, so they never outrank a real token nor enter the
top N (N <= MAX_LOGPROBS is far below any vocabulary).

Shape letters: N rows, V padded vocabulary, X alternatives (static), B batch, T positions,
C positions per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jspec.models import caches as cache_lib
from jspec.shapes.chunks import in_chunks

# Logits rows computed at once by the prompt pass: [rows x V] float32 at a time.
PROMPT_LOGITS_ROWS = 512


@struct.dataclass
class TokenLogprobs:
  logprob_N: jax.Array      # float32: the chosen token's log-probability
  rank_N: jax.Array         # int32: 1 for the most likely token (`token_logprobs`)
  top_ids_NX: jax.Array     # int32: the X most likely tokens, most likely first
  top_logprobs_NX: jax.Array


def token_logprobs(logits_NV, tokens_N, num_top: int) -> TokenLogprobs:
  """The chosen tokens' log-probabilities, ranks and the top `num_top` (static) alternatives.

  Rank counts the tokens at least as likely as the chosen one (itself included), as vLLM's
  `batched_count_greater_than` does: 1 for the argmax, ties share the worse rank.
  """
  logp_NV = jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1)
  chosen_N = jnp.take_along_axis(logp_NV, tokens_N[:, None].astype(jnp.int32), axis=1)[:, 0]
  rank_N = jnp.sum(logp_NV >= chosen_N[:, None], axis=-1, dtype=jnp.int32)
  if num_top:
    top_logprobs_NX, top_ids_NX = jax.lax.top_k(logp_NV, num_top)
  else:
    top_logprobs_NX = jnp.zeros((logp_NV.shape[0], 0), jnp.float32)
    top_ids_NX = jnp.zeros((logp_NV.shape[0], 0), jnp.int32)
  return TokenLogprobs(chosen_N, rank_N, top_ids_NX.astype(jnp.int32), top_logprobs_NX)


def window_logprobs(logits_BTV, tokens_BT, num_top: int) -> TokenLogprobs:
  """`token_logprobs` over every position of a [B, T] window, fields shaped [B, T, ...]."""
  batch, width, vocab = logits_BTV.shape
  flat = token_logprobs(logits_BTV.reshape(batch * width, vocab), tokens_BT.reshape(-1),
                        num_top)
  return jax.tree.map(lambda x: x.reshape(batch, width, *x.shape[1:]), flat)


def _chunk_logprobs(target, hidden_BCD, next_BC, num_top: int, rows: int) -> TokenLogprobs:
  """Logprobs of a chunk's next tokens, its logits made `rows` rows at a time."""
  batch, chunk, _ = hidden_BCD.shape
  step = max(1, min(chunk, rows // batch))
  while chunk % step:  # a divisor of the chunk, so that every piece has one shape
    step -= 1

  def piece(args):
    hidden_BcD, next_Bc = args
    return window_logprobs(target.logits(hidden_BcD), next_Bc, num_top)

  split = lambda x: jnp.moveaxis(x.reshape(batch, chunk // step, step, *x.shape[2:]), 1, 0)
  out = jax.lax.map(piece, (split(hidden_BCD), split(next_BC)))
  return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(batch, chunk, *y.shape[3:]), out)


def prompt_logprobs_fn(target_graphdef, experts_fn, dtype, cache_shardings, batch: int,
                       length: int, chunk: int, num_top: int, rows: int = PROMPT_LOGITS_ROWS):
  """fn(target_state, tokens_BT) -> TokenLogprobs [B, T]: at position i, the log-probability
  of token i + 1 given tokens 0..i (the last position's is meaningless). The prompt runs
  through the target `chunk` tokens at a time, and each chunk's logits `rows` rows at a time."""

  def fn(target_state, tokens_BT):
    target = nnx.merge(target_graphdef, target_state)
    positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens_BT.shape)
    next_BT = jnp.concatenate([tokens_BT[:, 1:], tokens_BT[:, :1]], axis=1)
    caches = cache_lib.constrain(target.init_caches(batch, length, dtype), cache_shardings)
    # Every position is "valid": padding after a prompt cannot reach its positions.
    full_B = jnp.full((batch,), length, jnp.int32)

    def forward(tokens, positions, next_tokens, caches):
      hidden, caches = target(tokens, positions, caches, length, experts_fn, seq_lens_B=full_B)
      return _chunk_logprobs(target, hidden, next_tokens, num_top, rows), caches

    out, _ = in_chunks(forward, (tokens_BT, positions_BT, next_BT), caches, chunk)
    return out

  return fn
