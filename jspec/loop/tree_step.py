"""A step's draft and verify over a token tree, returned as a chain's would be.

The drafter proposes the tree's nodes (jspec.speculative.drafters: `propose_tree`); the target
runs one pass over [root, nodes] with the tree's mask (jspec.models.tree_attention); greedy
acceptance takes the deepest node whose path the target agrees with
(jspec.speculative.tree.greedy_accept), sampled requests walk the tree by multi-candidate
rejection sampling (jspec.speculative.tree.sampled_accept: lossless); the caches move that
path's rows to the slots its positions name. What comes back is laid out as a chain of the
path: tokens, the target's outputs and logits along it, padded to the window's N rows. From
there `decode_step` goes on as for a chain (stops, lengths, metrics by depth, the drafter's
extend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models import caches as cache_lib
from jspec.models.tree_attention import tree_layout
from jspec.speculative import sampling, tree as tree_lib
from jspec.speculative.verify import PLACEHOLDER_TOKEN


def _processed_rows(logits_BWV, req, plan):
  return sampling.processed_rows(logits_BWV, req.temperature_B, req.top_k_B, req.top_p_B,
                                 plan.any_filtered)


def children_chooser(tree, req, lengths_B, plan, draft_stream_B):
  """choose(parents, logits_BWV) for the drafter: greedy programs take each parent's top-ranked
  tokens; sampled ones draw every child from the parent's processed draft distribution, with
  the draft stream's key at the child's position folded with its rank."""
  if plan.all_greedy:
    return lambda parents, logits_BWV: (tree_lib.greedy_children(tree, parents, logits_BWV),
                                        None)

  def keys_fn(depth: int, rank: int):
    keys_B = sampling.position_keys(draft_stream_B, (lengths_B + depth - 1)[:, None])[:, 0]
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, rank)

  def choose(parents, logits_BWV):
    probs_BWV = _processed_rows(logits_BWV, req, plan)
    return tree_lib.sampled_children(tree, parents, probs_BWV, keys_fn), probs_BWV

  return choose


def tree_window(target, drafter, state, req, last_token_B, plan, ctx, forward, streams):
  """(accept_len_B, out_tokens_BN, target_out, caches, draft, logits_BNV, draft_len_B) for
  one step over `plan.tree`; `forward(tokens, positions, caches)` runs the target
  (jspec.loop.step.target_forward); `streams` (target, draft): the requests' stream keys."""
  tree, lengths_B = plan.tree, state.lengths_B
  nodes = tree.num_nodes
  choose = children_chooser(tree, req, lengths_B, plan, streams[1])
  drafts_BK, draft_probs_BPV, draft = drafter.propose_tree(state.draft, state.tokens_BS,
                                                           lengths_B, tree, choose,
                                                           live_B=~state.done_B)
  tokens_BN = jnp.concatenate([last_token_B[:, None], drafts_BK], axis=1)
  positions_BN = lengths_B[:, None] - 1 + jnp.asarray(tree.depths, jnp.int32)
  with tree_layout(tree_lib.verify_layout(tree)):
    target_out, caches = forward(tokens_BN, positions_BN, state.target_caches)
  logits_BNV = target.logits(target_out.hidden_BTD)
  if plan.all_greedy:
    accept_len_B, out_BD1, path_BD1 = tree_lib.greedy_accept(tree, tokens_BN,
                                                             ctx.vocab_argmax(logits_BNV))
  else:
    target_probs_BNV = _processed_rows(logits_BNV, req, plan)
    keys_BD1 = sampling.position_keys(
        streams[0], lengths_B[:, None] + jnp.arange(tree.depth + 1, dtype=jnp.int32))
    accept_len_B, out_BD1, path_BD1 = tree_lib.sampled_accept(
        tree, tokens_BN, target_probs_BNV, draft_probs_BPV, keys_BD1)
  caches = cache_lib.compact(caches, path_BD1, lengths_B - 1, cache_lib.kv_writers(target))
  draft = drafter.accept_tree(draft, path_BD1, lengths_B)

  pad = nodes - out_BD1.shape[1]
  out_BN = jnp.pad(out_BD1, ((0, 0), (0, pad)), constant_values=PLACEHOLDER_TOKEN)
  rows_BN = jnp.pad(jnp.maximum(path_BD1, 0), ((0, 0), (0, pad)))
  along = lambda x: jnp.take_along_axis(x, rows_BN.reshape(rows_BN.shape + (1,) * (x.ndim - 2)),
                                        axis=1)
  target_out = jax.tree.map(along, target_out)
  draft_len_B = jnp.full(lengths_B.shape, tree.depth, jnp.int32)
  return accept_len_B, out_BN, target_out, caches, draft, along(logits_BNV), draft_len_B
