"""A separate, smaller model of the target's vocabulary as the drafter (vLLM "draft_model").

The draft model keeps its own cache, over the same positions as the target's, and drafts k
tokens autoregressively inside the loop. Its cache follows the shared invariant (positions
0 .. L-2 committed) without a separate extend pass: each step's first forward covers the two
positions L-2 and L-1. Position L-1 is the last committed token, never seen by the draft;
position L-2 is either already there (rewritten with the same token: same keys and values)
or, after a step that accepted every draft, the last draft d_k, which the chain never fed.
One two-token forward thus refreshes exactly what acceptance left unwritten, whatever the
acceptance length, at the cost of one extra row in a memory-bound step.
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.models import caches as cache_lib
from jspec.models.tree_attention import tree_layout
from jspec.speculative import tree as tree_lib
from jspec.shapes.chunks import in_chunks
from jspec.speculative.drafters.base import DraftState, Drafter, TargetOut, to_vocab


class DraftModelDrafter(Drafter):

  def __init__(self, target, model, plan, ctx):
    self.model, self.plan, self.ctx = model, plan, ctx
    self.vocab_size = target.cfg.vocab_size
    self.padded_vocab = target.cfg.padded_vocab_size

  def _logits(self, hidden_BTD):
    return to_vocab(self.model.logits(hidden_BTD), self.vocab_size, self.padded_vocab)

  def prefill(self, tokens_BP, prompt_lens_B, first_B, target_out: TargetOut,
              chunk: int) -> DraftState:
    batch, prompt_bucket = tokens_BP.shape
    positions_BP = jnp.broadcast_to(jnp.arange(prompt_bucket, dtype=jnp.int32), tokens_BP.shape)
    caches = cache_lib.constrain(self.model.init_caches(batch, self.plan.cache_len,
                                                        self.ctx.dtype),
                                 self.ctx.draft_cache_shardings)
    # Only the caches are kept: the first draft comes from the next step's own forward.
    _, caches = in_chunks(
        lambda t, p, c: self.model(t, p, c, prompt_bucket, self.ctx.draft_experts_fn,
                                   seq_lens_B=prompt_lens_B),
        (tokens_BP, positions_BP), caches, chunk)
    return DraftState(caches=caches)

  def prefill_chunk(self, draft: DraftState, tokens_BC, positions_BC, next_tokens_BC,
                    prompt_lens_B, last_B, target_out: TargetOut) -> DraftState:
    """The draft model over the chunk's prompt tokens (padding masked), as `prefill`."""
    del next_tokens_BC, last_B, target_out
    _, caches = self.model(tokens_BC, positions_BC, draft.caches, self.plan.cache_len,
                           self.ctx.draft_experts_fn, seq_lens_B=prompt_lens_B)
    return draft.replace(caches=caches)

  def _refresh(self, draft: DraftState, tokens_BS, lengths_B):
    """The two-token forward over positions L-2 and L-1 (the module docstring says why):
    (the logits at L-1 [B, 1, V], the caches)."""
    positions_B2 = lengths_B[:, None] - 2 + jnp.arange(2, dtype=jnp.int32)
    tokens_B2 = jnp.take_along_axis(tokens_BS, positions_B2, axis=1)
    hidden_B2D, caches = self.model(tokens_B2, positions_B2, draft.caches, self.plan.cache_len,
                                    self.ctx.draft_experts_fn)
    return self._logits(hidden_B2D[:, 1:]), caches

  def propose(self, draft: DraftState, tokens_BS, lengths_B, choose, live_B=None):
    del live_B  # a draft model's layers feed each other: it routes every row
    plan, model, fn = self.plan, self.model, self.ctx.draft_experts_fn
    batch = lengths_B.shape[0]
    logits_B1V, caches = self._refresh(draft, tokens_BS, lengths_B)
    token_B, probs_BV = choose(logits_B1V[:, 0], 0)
    drafts, probs = [token_B], [probs_BV]
    for j in range(1, plan.k):
      positions_B1 = (lengths_B + j - 1)[:, None]  # draft j-1 sits at L + j - 1
      hidden_B1D, caches = model(token_B[:, None], positions_B1, caches, plan.cache_len, fn)
      token_B, probs_BV = choose(self._logits(hidden_B1D)[:, 0], j)
      drafts.append(token_B)
      probs.append(probs_BV)
    probs_BKV = None if probs[0] is None else jnp.stack(probs, axis=1)
    draft_len_B = jnp.full((batch,), plan.k, jnp.int32)
    return jnp.stack(drafts, axis=1), draft_len_B, probs_BKV, draft.replace(caches=caches)

  def propose_tree(self, draft: DraftState, tokens_BS, lengths_B, tree, choose, live_B=None):
    """The two-token refresh as `propose`, the root's children from its last logits; then,
    depth by depth, one pass over the nodes with children (node i's keys at slot L + i - 1,
    jspec.speculative.tree.draft_layout)."""
    del live_B
    plan, model, fn = self.plan, self.model, self.ctx.draft_experts_fn
    logits_B1V, caches = self._refresh(draft, tokens_BS, lengths_B)
    tokens, probs = choose((0,), logits_B1V)
    for depth in range(1, tree.depth):
      nodes, layout = tree_lib.draft_layout(tree, depth)
      tokens_BW = jnp.stack([tokens[i] for i in nodes], axis=1)
      positions_BW = jnp.broadcast_to((lengths_B + depth - 1)[:, None], tokens_BW.shape)
      with tree_layout(layout):
        hidden_BWD, caches = model(tokens_BW, positions_BW, caches, plan.cache_len, fn)
      more, more_probs = choose(nodes, self._logits(hidden_BWD))
      tokens.update(more)
      probs = tree_lib.join_probs(probs, more_probs)
    drafts_BK = jnp.stack([tokens[i] for i in range(1, tree.num_nodes)], axis=1)
    return drafts_BK, probs, draft.replace(caches=caches)

  def accept_tree(self, draft: DraftState, path_BD1, lengths_B) -> DraftState:
    """The accepted drafts' rows (node i at slot L + i - 1) moved to their positions' slots,
    so that the cache is by position again up to the deepest accepted node's parent (that
    node itself, never fed, is the next step's refresh)."""
    path_BD = jnp.where(path_BD1[:, 1:] > 0, path_BD1[:, 1:] - 1, -1)
    return draft.replace(caches=cache_lib.compact(draft.caches, path_BD, lengths_B,
                                                  cache_lib.kv_writers(self.model)))

