"""Static token trees for speculation: their topology, the mask a verify pass attends with, and
greedy acceptance of the longest path the target agrees with.

A tree is spelled as vLLM's `speculative_token_tree` spells it: a list of paths, each a tuple of
child ranks from the root (the last committed token), `(0,)` the drafter's top candidate at
depth 1, `(1,)` its second, `(0, 0)` the top candidate after `(0,)`, and so on. Every path's
parent must be listed too. A chain of k drafts is `[(0,), (0, 0), ..., (0,) * k]`.

Nodes are numbered in the order the paths are listed after sorting by (depth, path): the
verify window is [root, node 1, ..., node N-1], node 0 being the root. A node attends to the
committed cache and to its ancestors in the window (itself included), never to its siblings:
`ancestor_mask`. Its position is the committed length + its depth.

Greedy acceptance (`greedy_accept`): a node is accepted when its parent is and its token is the
target's argmax at its parent, so that every accepted node is what one-token-at-a-time greedy
decoding would have emitted. The deepest accepted node wins (the lowest index among equally
deep ones, which cannot differ: siblings carry distinct tokens where the drafter's top-k does,
and at most one of them equals the parent's argmax); the step emits its path's tokens and the
target's argmax at it.

Shape letters: B batch, N nodes (root included), D the tree's depth (longest path).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jspec.speculative.verify import PLACEHOLDER_TOKEN


@dataclasses.dataclass(frozen=True)
class TokenTree:
  """A static tree over N nodes, node 0 the root: parent, depth and rank of each node
  (tuples, so that the tree is hashable and can key a compiled program)."""
  paths: tuple[tuple[int, ...], ...]   # node i > 0's path from the root; () for the root
  parents: tuple[int, ...]             # parents[0] = -1
  depths: tuple[int, ...]

  @classmethod
  def from_paths(cls, paths) -> "TokenTree":
    """The tree of `paths` (vLLM's spelling, see the module docstring). Refuses an empty
    list, a path of negative ranks, a repeated path, and a path whose parent is missing."""
    paths = [tuple(int(r) for r in p) for p in paths]
    if not paths:
      raise ValueError("a token tree needs at least one path, e.g. [(0,)]")
    for p in paths:
      if not p or any(r < 0 for r in p):
        raise ValueError(f"tree path {p} must be a non-empty tuple of ranks >= 0")
    if len(set(paths)) != len(paths):
      raise ValueError(f"tree paths repeat: {sorted(p for p in set(paths) if paths.count(p) > 1)}")
    known = set(paths)
    for p in paths:
      if len(p) > 1 and p[:-1] not in known:
        raise ValueError(f"tree path {p} has no parent {p[:-1]} in the list")
    ordered = [()] + sorted(paths, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(ordered)}
    parents = tuple([-1] + [index[p[:-1]] for p in ordered[1:]])
    return cls(tuple(ordered), parents, tuple(len(p) for p in ordered))

  @classmethod
  def chain(cls, k: int) -> "TokenTree":
    return cls.from_paths([(0,) * d for d in range(1, k + 1)])

  @property
  def num_nodes(self) -> int:
    return len(self.parents)

  @property
  def depth(self) -> int:
    return max(self.depths)

  def ancestors(self, node: int) -> list[int]:
    """The nodes from the root down to `node`, both included."""
    path = [node]
    while self.parents[path[-1]] >= 0:
      path.append(self.parents[path[-1]])
    return path[::-1]

  def ancestor_mask(self) -> np.ndarray:
    """[N, N] bool: node i attends to node j of the window iff j is i or one of its
    ancestors."""
    mask = np.zeros((self.num_nodes, self.num_nodes), bool)
    for i in range(self.num_nodes):
      mask[i, self.ancestors(i)] = True
    return mask

  def path_table(self) -> np.ndarray:
    """[N, D + 1] int32: row i lists node i's path from the root, padded with -1."""
    table = np.full((self.num_nodes, self.depth + 1), -1, np.int32)
    for i in range(self.num_nodes):
      nodes = self.ancestors(i)
      table[i, :len(nodes)] = nodes
    return table


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
  drafted_BD1 = jnp.take_along_axis(node_tokens_BN, jnp.maximum(path_BD1, 0), axis=1)
  next_B = jnp.take_along_axis(target_argmax_BN, best_B[:, None], axis=1)[:, 0]
  # Emitted: the path's drafts at depths 1..accept_len, i.e. drafted_BD1[:, 1:], then next.
  j_D1 = jnp.arange(tree.depth + 1, dtype=jnp.int32)[None, :]
  drafts_BD1 = jnp.pad(drafted_BD1[:, 1:], ((0, 0), (0, 1)))
  out_BD1 = jnp.where(j_D1 < accept_len_B[:, None], drafts_BD1,
                      jnp.where(j_D1 == accept_len_B[:, None], next_B[:, None],
                                PLACEHOLDER_TOKEN))
  return accept_len_B, out_BD1.astype(jnp.int32), path_BD1
