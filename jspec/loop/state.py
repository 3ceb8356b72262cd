"""The decoding state carried by the jitted loop, and the per-request inputs beside it.

Invariant between loop steps, for a running sequence of length L (tokens_BS[b, :L] valid):
  - the target's KV cache holds positions 0 .. L-2; the last token t_{L-1} is fed by the next
    verify step together with the drafts;
  - a drafter with caches holds positions 0 .. L-2 (an MTP / EAGLE head: each computed from
    the target's hidden state by draft extend, with its outputs at position L-2 in
    `draft.logits_BV` / `draft.feedback_BD`: the first draft's distribution and the hidden
    state fed to the second draft step; jspec.speculative.drafters).
Rejected drafts leave stale cache slots past L-2; they are never read (attention sees slots
<= the query position, all rewritten first) and are overwritten by later steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_REASONS = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}


@struct.dataclass
class RequestInputs:
  """Per-sequence settings, fixed for the whole generation (padded rows: max_len_B = 0)."""
  temperature_B: jax.Array
  top_k_B: jax.Array
  top_p_B: jax.Array
  max_len_B: jax.Array     # stop with 'length' once the sequence holds this many tokens
  stop_ids_BX: jax.Array   # EOS ids (unless ignore_eos) and stop_token_ids, padded with -1
  seeds_B: jax.Array       # uint32 seed per request (keys are made on device)


@struct.dataclass
class Metrics:
  num_steps_B: jax.Array        # verify steps taken while running
  num_drafted_B: jax.Array      # draft tokens proposed
  num_accepted_B: jax.Array     # draft tokens emitted
  drafted_at_BK: jax.Array      # steps in which a draft was proposed at position j
  accepted_at_BK: jax.Array     # steps in which the draft at position j was emitted

  @classmethod
  def zeros(cls, batch: int, k: int) -> "Metrics":
    z = jnp.zeros((batch,), jnp.int32)
    zk = jnp.zeros((batch, max(k, 1)), jnp.int32)
    return cls(z, z, z, zk, zk)


@struct.dataclass
class DecodeState:
  tokens_BS: jax.Array
  lengths_B: jax.Array
  done_B: jax.Array
  finish_B: jax.Array
  target_caches: tuple
  draft: "DraftState"  # jspec.speculative.drafters.base.DraftState
  metrics: Metrics
  step: jax.Array              # the loop's clock: decode steps (rounds, under continuous batching)
  # Per token position, the clock value after which the token there was available: 0 for a
  # first token sampled by the batched prefill, step + 1 for a token emitted by step `step`.
  # Read back with the tokens, it times each token (jspec.timing).
  emitted_at_BS: jax.Array
