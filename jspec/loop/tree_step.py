"""A step's draft and verify over a token tree (greedy), returned as a chain's would be.

The drafter proposes the tree's nodes (jspec.speculative.drafters: `propose_tree`); the target
runs one pass over [root, nodes] with the tree's mask (jspec.models.tree_attention); greedy
acceptance takes the deepest node whose path the target agrees with
(jspec.speculative.tree.greedy_accept); the caches move that path's rows to the slots its
positions name. What comes back is laid out as a chain of the path: tokens, the target's
outputs and logits along it, padded to the window's N rows. From there `decode_step` goes on
as for a chain (stops, lengths, metrics by depth, the drafter's extend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models import caches as cache_lib
from jspec.models.tree_attention import tree_layout
from jspec.speculative import tree as tree_lib
from jspec.speculative.verify import PLACEHOLDER_TOKEN


def tree_window(target, drafter, state, last_token_B, plan, ctx, forward):
  """(accept_len_B, out_tokens_BN, target_out, caches, draft, logits_BNV, draft_len_B) for
  one greedy step over `plan.tree`; `forward(tokens, positions, caches)` runs the target
  (jspec.loop.step.target_forward)."""
  tree, lengths_B = plan.tree, state.lengths_B
  nodes = tree.num_nodes
  drafts_BK, draft = drafter.propose_tree(state.draft, state.tokens_BS, lengths_B, tree)
  tokens_BN = jnp.concatenate([last_token_B[:, None], drafts_BK], axis=1)
  positions_BN = lengths_B[:, None] - 1 + jnp.asarray(tree.depths, jnp.int32)
  with tree_layout(tree_lib.verify_layout(tree)):
    target_out, caches = forward(tokens_BN, positions_BN, state.target_caches)
  logits_BNV = target.logits(target_out.hidden_BTD)
  accept_len_B, out_BD1, path_BD1 = tree_lib.greedy_accept(tree, tokens_BN,
                                                           ctx.vocab_argmax(logits_BNV))
  caches = cache_lib.compact(caches, path_BD1, lengths_B - 1)
  draft = drafter.accept_tree(draft, path_BD1, lengths_B)

  pad = nodes - out_BD1.shape[1]
  out_BN = jnp.pad(out_BD1, ((0, 0), (0, pad)), constant_values=PLACEHOLDER_TOKEN)
  rows_BN = jnp.pad(jnp.maximum(path_BD1, 0), ((0, 0), (0, pad)))
  along = lambda x: jnp.take_along_axis(x, rows_BN.reshape(rows_BN.shape + (1,) * (x.ndim - 2)),
                                        axis=1)
  target_out = jax.tree.map(along, target_out)
  draft_len_B = jnp.full(lengths_B.shape, tree.depth, jnp.int32)
  return accept_len_B, out_BN, target_out, caches, draft, along(logits_BNV), draft_len_B
