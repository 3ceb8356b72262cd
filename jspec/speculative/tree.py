"""Token trees in the loop: the attention layouts of a tree's draft and verify passes, and greedy
acceptance of the longest path the target agrees with. The topology (`TokenTree`, vLLM's
`speculative_token_tree` spelling) lives in jspec.token_tree.

A verify window is [root, node 1, ..., node N-1], node 0 being the last committed token. A node
attends to the committed cache and to its ancestors in the window (itself included), never to
its siblings: `TokenTree.ancestor_mask`. Its position is the committed length - 1 + its depth.

Greedy acceptance (`greedy_accept`): a node is accepted when its parent is and its token is the
target's argmax at its parent, so that every accepted node is what one-token-at-a-time greedy
decoding would have emitted. The deepest accepted node wins (the lowest index among equally
deep ones, which cannot differ: siblings carry distinct tokens where the drafter's top-k does,
and at most one of them equals the parent's argmax); the step emits its path's tokens and the
target's argmax at it.

Shape letters: B batch, N nodes (root included), D the tree's depth (longest path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.tree_attention import TreeLayout
from jspec.speculative.sampling import sample
from jspec.speculative.verify import PLACEHOLDER_TOKEN, residual_probs as verify_residual
from jspec.token_tree import TokenTree


def greedy_accept(tree: TokenTree, node_tokens_BN, target_argmax_BN):
  """Greedy acceptance over a verify window laid out as `tree` (node 0: the last committed
  token): `target_argmax_BN` is the target's argmax at each node. Returns (accept_len_B,
  out_tokens_BD1, path_BD1): the accepted depth, the tokens to emit (the accepted path's
  drafts, then the argmax at its last node, then PLACEHOLDER_TOKEN), and the window's nodes
  from the root to the last accepted one (-1 past it): the rows of the window whose keys and
  values the cache keeps, in order."""
  parents = np.asarray(tree.parents)
  nodes = tree.num_nodes
  # accepted[i]: node i's token is its parent's argmax and the parent is accepted (breadth
  # first order: a parent's index is below its children's, so one pass in index order works).
  accepted = [jnp.ones(node_tokens_BN.shape[:1], bool)]
  for i in range(1, nodes):
    p = int(parents[i])
    accepted.append(accepted[p] & (node_tokens_BN[:, i] == target_argmax_BN[:, p]))
  accepted_BN = jnp.stack(accepted, axis=1)
  depth_N = jnp.asarray(tree.depths, jnp.int32)
  # The deepest accepted node, the lowest index among equals: maximise depth * N - index.
  score_BN = jnp.where(accepted_BN, depth_N * nodes - jnp.arange(nodes), -1)
  best_B = jnp.argmax(score_BN, axis=1).astype(jnp.int32)
  accept_len_B = depth_N[best_B]
  path_BD1 = jnp.asarray(tree.path_table())[best_B]
  next_B = jnp.take_along_axis(target_argmax_BN, best_B[:, None], axis=1)[:, 0]
  return accept_len_B, _emitted(node_tokens_BN, path_BD1, accept_len_B, next_B), path_BD1


def _emitted(node_tokens_BN, path_BD1, accept_len_B, next_B):
  """[B, D+1] the tokens a step emits: the accepted path's drafts at depths 1..accept_len,
  then `next_B`, then PLACEHOLDER_TOKEN."""
  drafted_BD1 = jnp.take_along_axis(node_tokens_BN, jnp.maximum(path_BD1, 0), axis=1)
  j_D1 = jnp.arange(path_BD1.shape[1], dtype=jnp.int32)[None, :]
  drafts_BD1 = jnp.pad(drafted_BD1[:, 1:], ((0, 0), (0, 1)))
  out_BD1 = jnp.where(j_D1 < accept_len_B[:, None], drafts_BD1,
                      jnp.where(j_D1 == accept_len_B[:, None], next_B[:, None],
                                PLACEHOLDER_TOKEN))
  return out_BD1.astype(jnp.int32)


def verify_layout(tree: TokenTree) -> TreeLayout:
  """The target's verify pass: node i at slot start + i (start = the committed length - 1,
  the root's position), seeing its ancestors."""
  mask = tree.ancestor_mask()
  return TreeLayout(tuple(range(tree.num_nodes)), tuple(tuple(bool(v) for v in row)
                                                        for row in mask))


def draft_layout(tree: TokenTree, depth: int) -> tuple[tuple[int, ...], TreeLayout]:
  """(nodes, layout) of a drafter's pass at `depth` >= 1: the nodes there that have children,
  whose outputs give those children. Node i's keys go to slot start + i - 1, where start is
  the slot of node 1 (a chain's first draft pass), and each node sees its ancestors below the
  root (their passes ran at the depths before). A chain's tree reproduces the chain's slots
  and causal masks exactly."""
  nodes = tuple(i for i in tree.nodes_at(depth) if tree.children(i))
  visible = tuple(tuple(u + 1 in tree.ancestors(i) for u in range(tree.num_nodes - 1))
                  for i in nodes)
  return nodes, TreeLayout(tuple(i - 1 for i in nodes), visible, start_shift=depth - 1)


def branch_nodes(tree: TokenTree) -> tuple[int, ...]:
  """The nodes with children (the root first), in index order: the rows of a sampled tree's
  draft distributions."""
  return tuple(i for i in range(tree.num_nodes) if tree.children(i))


def join_probs(probs_BPV, more_BWV):
  """Draft distributions of the branch nodes so far, with the next depth's appended (passes
  run depth by depth, so concatenation keeps `branch_nodes` order); None when greedy."""
  if probs_BPV is None or more_BWV is None:
    return None
  return jnp.concatenate([probs_BPV, more_BWV], axis=1)


def greedy_children(tree: TokenTree, parents: tuple[int, ...], logits_BWV) -> dict:
  """{child: tokens [B]} for the children of `parents` (logits_BWV[:, w] is parents[w]'s):
  the child of rank r takes the parent's r-th most likely token (ties to the lower token id,
  as argmax)."""
  width = 1 + max(tree.rank(c) for p in parents for c in tree.children(p))
  logits_BWV = logits_BWV.astype(jnp.float32)
  top_BWR = (top_ids(logits_BWV, width) if width <= MAX_REDUCED_RANKS
             else jax.lax.top_k(logits_BWV, width)[1].astype(jnp.int32))
  return {c: top_BWR[:, w, tree.rank(c)]
          for w, p in enumerate(parents) for c in tree.children(p)}


# The widest rank `greedy_children` takes by reductions (`top_ids`, whose rounds grow with k):
# timed up to 4 (BENCHMARKS.md); wider ranks keep XLA's top-k.
MAX_REDUCED_RANKS = 4


def top_ids(x_XV, k: int):
  """The ids of the k largest values along the last axis, in `jax.lax.top_k`'s order (larger
  first, ties to the lower id; a NaN above every number, as argmax places it), as int32
  [..., k]: k rounds of the largest value not yet taken and the lowest id holding it, row
  reductions that XLA fuses with the masking of the ids already taken. Why: XLA's GPU top-k
  kernel took 25-69 µs for k = 1..4 over a 32k-token draft vocabulary at batch 1 (one row a
  block), five calls in a 16-node tree's step (BENCHMARKS.md); a reduction takes a few."""
  if k == 1:  # argmax's own order: the first of the largest, a NaN first
    return jnp.argmax(x_XV, axis=-1).astype(jnp.int32)[..., None]
  v = x_XV.shape[-1]
  id_XV = jax.lax.broadcasted_iota(jnp.int32, x_XV.shape, x_XV.ndim - 1)
  nan_XV = jnp.isnan(x_XV)
  picks, taken_XV = [], jnp.zeros(x_XV.shape, bool)
  for _ in range(k):
    # NaN ranks above +inf (top_k's order): the round's largest is NaN while one is left.
    any_nan_X1 = jnp.any(nan_XV & ~taken_XV, axis=-1, keepdims=True)
    top_X1 = jnp.max(jnp.where(taken_XV | nan_XV, -jnp.inf, x_XV), axis=-1, keepdims=True)
    holds_XV = ~taken_XV & jnp.where(any_nan_X1, nan_XV, x_XV == top_X1)
    picks.append(jnp.min(jnp.where(holds_XV, id_XV, v), axis=-1))
    taken_XV = taken_XV | (id_XV == picks[-1][..., None])
  return jnp.stack(picks, axis=-1)


def sampled_children(tree: TokenTree, parents: tuple[int, ...], probs_BWV, keys_fn) -> dict:
  """{child: tokens [B]}: every child of a parent an independent draw from the parent's draft
  distribution probs_BWV[:, w], child c with keys_fn(depth(c), rank(c)) [B]. Siblings may
  repeat a token; the verification (`sampled_accept`) is exact for independent draws."""
  return {c: sample(probs_BWV[:, w], keys_fn(tree.depths[c], tree.rank(c)))
          for w, p in enumerate(parents) for c in tree.children(p)}


def _children_table(tree: TokenTree) -> np.ndarray:
  """[N, C] each node's children in rank order, padded with -1 (C >= 1)."""
  width = max(1, max(len(tree.children(i)) for i in range(tree.num_nodes)))
  table = np.full((tree.num_nodes, width), -1, np.int32)
  for i in range(tree.num_nodes):
    kids = sorted(tree.children(i), key=tree.rank)
    table[i, :len(kids)] = kids
  return table


def sampled_accept(tree: TokenTree, tokens_BN, target_probs_BNV, draft_probs_BPV, keys_BD1):
  """Lossless verification of a sampled tree (SpecInfer's multi-candidate speculative
  sampling, Miao et al. 2023, Theorem 4.2): from the root down, a node's children, each an
  independent draw from the draft distribution q at the node, are tried in rank order; child
  x is accepted with probability min(1, p(x) / q(x)), and after each rejection p becomes
  norm(max(p - q, 0)). The first accepted child becomes the node and the walk goes on with
  its own children and the target's distribution there; where every child is rejected (or a
  node has none) the next token is drawn from the current p. Each emitted token is thus
  distributed as the target's, whatever q and however many children each node has (zero
  included): the argument of the chain's rejection sampling, applied per candidate.

  target_probs_BNV: the target's processed distributions at the window's nodes;
  draft_probs_BPV: the drafter's at `branch_nodes(tree)`; keys_BD1: the target stream's keys
  at positions L .. L + D (the token each depth decides). Returns greedy_accept's triple."""
  nodes, depth = tree.num_nodes, tree.depth
  children_NC = jnp.asarray(_children_table(tree))
  slot = np.zeros(nodes, np.int32)
  slot[list(branch_nodes(tree))] = np.arange(len(branch_nodes(tree)))
  slot_N = jnp.asarray(slot)
  p_BNV = target_probs_BNV.astype(jnp.float32)
  q_BPV = draft_probs_BPV.astype(jnp.float32)
  batch = tokens_BN.shape[0]
  rows_B = jnp.arange(batch)
  fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
  uniform = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))

  node_B = jnp.zeros((batch,), jnp.int32)
  alive_B = jnp.ones((batch,), bool)
  p_BV = p_BNV[:, 0]
  path = [node_B]
  for d in range(depth):
    kids_BC = children_NC[node_B]
    q_BV = q_BPV[rows_B, slot_N[node_B]]
    chosen_B = jnp.full((batch,), -1, jnp.int32)
    for i in range(kids_BC.shape[1]):
      child_B = kids_BC[:, i]
      trying_B = alive_B & (child_B >= 0) & (chosen_B < 0)
      token_B = tokens_BN[rows_B, jnp.maximum(child_B, 0)]
      u_B = uniform(fold(keys_BD1[:, d], 2 + i))
      take_B = trying_B & (u_B * q_BV[rows_B, token_B] < p_BV[rows_B, token_B])
      chosen_B = jnp.where(take_B, child_B, chosen_B)
      p_BV = jnp.where((trying_B & ~take_B)[:, None], verify_residual(p_BV, q_BV), p_BV)
    moved_B = chosen_B >= 0
    node_B = jnp.where(moved_B, chosen_B, node_B)
    p_BV = jnp.where(moved_B[:, None], p_BNV[rows_B, node_B], p_BV)
    alive_B = moved_B
    path.append(jnp.where(moved_B, chosen_B, -1))
  path_BD1 = jnp.stack(path, axis=1)
  accept_len_B = jnp.sum(path_BD1[:, 1:] >= 0, axis=1).astype(jnp.int32)
  bonus_key_B = fold(keys_BD1[rows_B, accept_len_B], 1)
  next_B = sample(p_BV, bonus_key_B)
  return accept_len_B, _emitted(tokens_BN, path_BD1, accept_len_B, next_B), path_BD1
