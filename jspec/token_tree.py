"""A static token tree: its topology read from vLLM's `speculative_token_tree` paths.

A tree is spelled as vLLM spells it: a list of paths, each a tuple of child ranks from the root
(the last committed token), `(0,)` the drafter's top candidate at depth 1, `(1,)` its second,
`(0, 0)` the top candidate after `(0,)`, and so on. Every path's parent must be listed too. A
chain of k drafts is `[(0,), (0, 0), ..., (0,) * k]`. Nodes are numbered in the order the paths
sort by (depth, path), node 0 being the root. No jspec import: the configuration validates trees
with it (jspec.config), the loop verifies them (jspec.speculative.tree).
"""

from __future__ import annotations

import ast
import dataclasses

import numpy as np


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

  @classmethod
  def parse(cls, value) -> "TokenTree":
    """A tree from vLLM's spelling: a list of paths, or that list as a string
    ("[(0,), (1,), (0, 0)]", as vLLM's `speculative_token_tree` takes it)."""
    if isinstance(value, str):
      try:
        value = ast.literal_eval(value)
      except (ValueError, SyntaxError) as err:
        raise ValueError(f"speculative_token_tree={value!r} is not a list of paths, e.g. "
                         "'[(0,), (1,), (0, 0)]'") from err
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in value):
      raise ValueError(f"speculative_token_tree={value!r} must be a list of paths (tuples of "
                       "child ranks), e.g. [(0,), (1,), (0, 0)]")
    if any(isinstance(r, bool) or not isinstance(r, int) for p in value for r in p):
      raise ValueError(f"speculative_token_tree={value!r}: ranks must be integers")
    return cls.from_paths(value)

  def nodes_at(self, depth: int) -> tuple[int, ...]:
    return tuple(i for i, d in enumerate(self.depths) if d == depth)

  def children(self, node: int) -> tuple[int, ...]:
    return tuple(i for i, p in enumerate(self.parents) if p == node)

  def rank(self, node: int) -> int:
    """Node's place among its parent's candidates (0: the top one)."""
    return self.paths[node][-1]
