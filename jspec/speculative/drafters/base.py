"""The surface every drafter offers the loop, and the state it carries between steps.

A drafter proposes up to k tokens per sequence each step and keeps whatever it needs (its own
caches, its last logits) in a `DraftState`. The loop calls only these methods and never
names a drafter:

  prefill(tokens_BP, prompt_lens_B, first_B, target_out, chunk) -> DraftState
      after the target's prefill: the prompt, each sequence's first sampled token, and the
      target's hidden states over the prompt (`TargetOut`), run `chunk` positions at a time;
  propose(draft, tokens_BS, lengths_B, choose) -> (drafts_BK, draft_len_B, probs_BKV, draft)
      the drafts for the next verify window; `choose(logits_BV, j)` picks draft j (0-based)
      from logits over the target's padded vocabulary, with the request's sampling settings
      and the draft random stream, and returns (tokens_B, probs_BV or None when greedy);
  extend(draft, out_tokens_BT, positions_BT, num_emit_B, running_B, target_out) -> DraftState
      after verification: the window's emitted tokens (the first num_emit_B of each row) and
      the target's hidden states at the window positions;
  aux_layers: the target layers whose *input* hidden states the drafter reads (EAGLE-3);
      the loop asks the target for them in prefill and verify;
  propose_tree(draft, tokens_BS, lengths_B, tree, choose), accept_tree(draft, path_BD1,
      lengths_B): a token tree's drafts (and their draft distributions) and, after
      verification, the accepted path (drafters whose caches hold draft passes by slot move
      that path's rows into place);
  prefill_chunk(draft, tokens_BC, positions_BC, next_tokens_BC, prompt_lens_B, last_B,
                target_out) -> DraftState
      continuous batching (jspec.loop.rounds): one chunk of prompt positions of the
      rows being filled, their state zeroed before their first chunk; next_tokens_BC[b, c] is
      the token after position c (the row's first sampled token after its prompt's last
      position), positions at or past prompt_lens_B are padding, and last_B is the chunk
      index of the prompt's last position (meaningful in the row's last chunk only).

Invariant (shared with jspec.loop.state): between steps, for a running sequence of
length L, a drafter with caches holds entries for positions 0 .. L-2 computed from committed
tokens; entries past that are stale and are overwritten before they are read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class DraftState:
  """Per-sequence drafter state; fields a drafter does not use are () or None.

  caches: the drafter's per-layer caches (sharded by the draft's own rules).
  logits_BV: the first draft's float32 logits, computed at the end of the previous step.
  feedback_BD: the hidden state a hidden-state head feeds to its second draft step.
  """
  caches: tuple = ()
  logits_BV: jax.Array | None = None
  feedback_BD: jax.Array | None = None


@struct.dataclass
class TargetOut:
  """What a target forward hands the drafter: its final (post-norm) hidden states [B, T, D]
  and, when the drafter asked for `aux_layers`, each of those layers' input [B, T, D]."""
  hidden_BTD: jax.Array
  aux_BTD: tuple = ()


class Drafter:
  """Defaults: no state, no target hidden states needed."""

  aux_layers: tuple[int, ...] = ()
  # Whether `prefill` reads its target_out. Where it does not, the loop learns the drafter's
  # state layout without tracing a target forward for it (jspec.loop.slots.draft_state_shape):
  # that trace was about a sixth of a 36-layer model's first call on a CPU. A drafter that
  # reads target_out and says False gets None there and fails as it is traced.
  prefill_reads_target: bool = False

  def prefill(self, tokens_BP, prompt_lens_B, first_B, target_out: TargetOut,
              chunk: int) -> DraftState:
    return DraftState()

  def extend(self, draft: DraftState, out_tokens_BT, positions_BT, num_emit_B, running_B,
             target_out: TargetOut) -> DraftState:
    return draft

  def propose(self, draft: DraftState, tokens_BS, lengths_B, choose, live_B=None):
    """(drafts_BK, draft_len_B, probs_BKV or None, draft). live_B: the rows still running
    (None: all), which a drafter may skip work for (an MoE head's routing)."""
    raise NotImplementedError

  def prefill_chunk(self, draft: DraftState, tokens_BC, positions_BC, next_tokens_BC,
                    prompt_lens_B, last_B, target_out: TargetOut) -> DraftState:
    return draft

  def propose_tree(self, draft: DraftState, tokens_BS, lengths_B, tree, choose, live_B=None):
    """(node_tokens_BK, probs_BPV, draft): drafts for a token tree's nodes 1..N-1
    (jspec.speculative.tree), K = N - 1. `choose(parents, logits_BWV)` -> ({child: tokens_B},
    probs_BWV or None when greedy) picks the children of `parents` from their logits; probs_BPV
    stacks the draft distributions at `tree.branch_nodes` (None when greedy). live_B: as
    `propose`'s."""
    raise ValueError(f"{type(self).__name__} drafts no token trees")

  def accept_tree(self, draft: DraftState, path_BD1, lengths_B) -> DraftState:
    """After a tree's verification: `path_BD1` the accepted nodes from the root (-1 past the
    accepted depth), `lengths_B` the lengths before the step."""
    return draft


def to_vocab(logits_BTV, vocab_size: int, padded_size: int):
  """Logits over a drafter's own (possibly differently padded) vocabulary, laid out over the
  target's padded vocabulary: the true `vocab_size` columns kept, -inf for every padding column,
  so a draft distribution meets the target's column for column in verification."""
  kept_BTV = logits_BTV[..., :vocab_size]
  pad = padded_size - vocab_size
  if pad == 0:
    return kept_BTV
  fill = jnp.full(kept_BTV.shape[:-1] + (pad,), -jnp.inf, kept_BTV.dtype)
  return jnp.concatenate([kept_BTV, fill], axis=-1)


def take_rows(x_BT, index_B):
  """x[b, index_B[b]] for every row b (the trailing axes kept)."""
  return jnp.take_along_axis(x_BT, index_B[:, None, *([None] * (x_BT.ndim - 2))],
                             axis=1)[:, 0]
