"""Static token trees (jspec.speculative.tree): the topology read from vLLM-style paths, the
ancestor mask a verify pass attends with, and greedy acceptance of the deepest path the target
agrees with, against brute force over random trees and against the chain's greedy_verify."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.speculative.tree import TokenTree, greedy_accept
from jspec.speculative.verify import PLACEHOLDER_TOKEN, greedy_verify


def random_tree(rng, max_nodes=16, max_width=3, max_depth=5) -> TokenTree:
  """A random tree of up to `max_nodes` paths, each a child of one already drawn."""
  paths = [(0,)]
  while len(paths) < int(rng.integers(1, max_nodes + 1)):
    parent = paths[int(rng.integers(0, len(paths) + 1)) - 1] if rng.random() < 0.8 else ()
    if len(parent) >= max_depth:
      continue
    taken = {p[-1] for p in paths if p[:-1] == parent}
    free = [r for r in range(max_width) if r not in taken]
    if free:
      paths.append(parent + (int(rng.choice(free)),))
  order = rng.permutation(len(paths))
  return TokenTree.from_paths([paths[i] for i in order])


def test_paths_become_breadth_first_nodes_with_parents_and_depths():
  tree = TokenTree.from_paths([(1,), (0, 0), (0,), (0, 1), (0, 0, 0)])
  assert tree.paths == ((), (0,), (1,), (0, 0), (0, 1), (0, 0, 0))
  assert tree.parents == (-1, 0, 0, 1, 1, 3)
  assert tree.depths == (0, 1, 1, 2, 2, 3)
  assert tree.num_nodes == 6 and tree.depth == 3
  assert TokenTree.chain(3) == TokenTree.from_paths([(0,), (0, 0), (0, 0, 0)])
  assert hash(tree) == hash(TokenTree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]))


@pytest.mark.parametrize("paths, match", [
    ([], "at least one path"), ([(0,), ()], "non-empty"), ([(0,), (-1,)], "ranks >= 0"),
    ([(0,), (0,)], "repeat"), ([(0,), (1, 0)], "no parent \\(1,\\)")])
def test_bad_trees_are_refused(paths, match):
  with pytest.raises(ValueError, match=match):
    TokenTree.from_paths(paths)


def test_a_node_attends_to_itself_and_its_ancestors_only():
  rng = np.random.default_rng(0)
  for _ in range(30):
    tree = random_tree(rng)
    mask = tree.ancestor_mask()
    for i, j in itertools.product(range(tree.num_nodes), repeat=2):
      prefix = tree.paths[i][:len(tree.paths[j])] == tree.paths[j]
      assert mask[i, j] == prefix, (tree.paths[i], tree.paths[j])
    table = tree.path_table()
    for i in range(tree.num_nodes):
      nodes = [n for n in table[i] if n >= 0]
      assert [tree.paths[n] for n in nodes] == [tree.paths[i][:d] for d in range(
          tree.depths[i] + 1)]


def brute_force(tree, tokens, argmax):
  """The definition, walked in NumPy: accepted nodes, the deepest (lowest index), its path."""
  accepted = [True]
  for i in range(1, tree.num_nodes):
    p = tree.parents[i]
    accepted.append(accepted[p] and tokens[i] == argmax[p])
  best = max((i for i in range(tree.num_nodes) if accepted[i]),
             key=lambda i: (tree.depths[i], -i))
  path = tree.ancestors(best)
  emitted = [int(tokens[n]) for n in path[1:]] + [int(argmax[best])]
  return tree.depths[best], emitted, path


@pytest.mark.parametrize("seed", range(6))
def test_greedy_acceptance_takes_the_deepest_path_the_target_agrees_with(seed):
  rng = np.random.default_rng(seed)
  tree = random_tree(rng)
  batch, vocab = 24, 3  # a small vocabulary: many nodes match their parent's argmax
  tokens = rng.integers(0, vocab, (batch, tree.num_nodes)).astype(np.int32)
  argmax = rng.integers(0, vocab, (batch, tree.num_nodes)).astype(np.int32)
  accept_len, out, path = jax.jit(lambda t, a: greedy_accept(tree, t, a))(tokens, argmax)
  for b in range(batch):
    depth, emitted, nodes = brute_force(tree, tokens[b], argmax[b])
    assert int(accept_len[b]) == depth
    np.testing.assert_array_equal(np.asarray(out[b]),
                                  emitted + [PLACEHOLDER_TOKEN] * (tree.depth - depth))
    np.testing.assert_array_equal(np.asarray(path[b]), nodes + [-1] * (tree.depth - depth))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_chain_tree_accepts_what_greedy_verify_accepts(k):
  """Node tokens [last, d1..dk] and the target's argmax at each: the chain's tree gives
  greedy_verify's accepted length and tokens."""
  rng = np.random.default_rng(k)
  batch, vocab = 64, 3
  drafts = rng.integers(0, vocab, (batch, k)).astype(np.int32)
  argmax = rng.integers(0, vocab, (batch, k + 1)).astype(np.int32)
  logits = jax.nn.one_hot(argmax, vocab) * 5.0
  want_len, want_out = greedy_verify(jnp.asarray(drafts), jnp.full((batch,), k, jnp.int32),
                                     logits)
  tokens = np.concatenate([np.zeros((batch, 1), np.int32), drafts], axis=1)
  got_len, got_out, path = greedy_accept(TokenTree.chain(k), jnp.asarray(tokens),
                                         jnp.asarray(argmax))
  np.testing.assert_array_equal(np.asarray(got_len), np.asarray(want_len))
  np.testing.assert_array_equal(np.asarray(got_out), np.asarray(want_out))
  for b in range(batch):
    assert list(np.asarray(path[b])) == list(range(int(got_len[b]) + 1)) + [-1] * (
        k - int(got_len[b]))


@pytest.mark.parametrize("seed", range(4))
def test_verify_and_draft_layouts_see_exactly_the_ancestors(seed):
  """Brute force over random trees: a verify query sees the slots below start and its
  ancestors' window slots; a draft pass's query at depth d sees those of its ancestors below
  the root, where the passes before it wrote them (node i at start + i - 1)."""
  from jspec.speculative.tree import draft_layout, verify_layout
  rng = np.random.default_rng(seed)
  tree, slots = random_tree(rng), 40
  start_B = rng.integers(0, 20, size=3)
  layout = verify_layout(tree)
  positions_BN = start_B[:, None] + np.asarray(tree.depths)[None]
  got = np.asarray(layout.visible_BTS(jnp.asarray(positions_BN), slots))
  np.testing.assert_array_equal(np.asarray(layout.slots(jnp.asarray(positions_BN))),
                                start_B[:, None] + np.arange(tree.num_nodes))
  for b, start in enumerate(start_B):
    for i in range(tree.num_nodes):
      want = {s for s in range(slots) if s < start} | {start + a for a in tree.ancestors(i)}
      assert set(np.flatnonzero(got[b, i])) == want
  for depth in range(1, tree.depth):
    nodes, layout = draft_layout(tree, depth)
    positions_BW = np.repeat((start_B + depth - 1)[:, None], len(nodes), axis=1)
    got = np.asarray(layout.visible_BTS(jnp.asarray(positions_BW), slots))
    for b, start in enumerate(start_B):
      for w, i in enumerate(nodes):
        assert tree.children(i)
        want = ({s for s in range(slots) if s < start}
                | {start + a - 1 for a in tree.ancestors(i) if a > 0})
        assert set(np.flatnonzero(got[b, w])) == want


@pytest.mark.parametrize("seed", range(3))
def test_compaction_moves_the_accepted_path_to_consecutive_slots(seed):
  from jspec.models.caches import compact_slots
  rng = np.random.default_rng(seed)
  tree = random_tree(rng)
  batch, slots, heads, width = 4, 40, 2, 3
  cache = rng.standard_normal((batch, heads, slots, width)).astype(np.float32)
  start_B = rng.integers(0, 20, size=batch)
  leaves = [i for i in range(tree.num_nodes) if not tree.children(i)]
  paths = np.full((batch, tree.depth + 1), -1, np.int32)
  for b in range(batch):
    node = tree.ancestors(int(rng.choice(leaves)))[:int(rng.integers(1, tree.depth + 2))]
    paths[b, :len(node)] = node
  got = np.asarray(compact_slots(jnp.asarray(cache), jnp.asarray(paths), jnp.asarray(start_B), 2))
  want = cache.copy()
  for b in range(batch):
    for j, node in enumerate(paths[b]):
      if node >= 0:
        want[b, :, start_B[b] + j] = cache[b, :, start_B[b] + node]
  np.testing.assert_array_equal(got, want)
