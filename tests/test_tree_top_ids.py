"""tree.top_ids, the greedy tree's children by rank: on random logits with many ties, -inf runs,
whole rows of -inf and NaNs, the ids of a NumPy sort in its documented order (NaN first, then
larger values, ties to the lower id), which is jax.lax.top_k's on NaN-free logits (compared
there too: on a GPU top_k's k = 1 places NaN elsewhere)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.speculative.tree import top_ids


def _logits(rng, shape, kind):
  if kind == "normal":
    return rng.standard_normal(shape).astype(np.float32)
  if kind == "ties":  # few distinct values: most ranks are decided by the id
    return rng.integers(-3, 3, shape).astype(np.float32)
  x = rng.integers(-2, 2, shape).astype(np.float32)
  x[rng.random(shape) < 0.6] = -np.inf  # masked vocabulary: fewer finite values than k
  if kind == "nan":
    x[rng.random(shape) < 0.05] = np.nan
  x[..., 0, :] = -np.inf  # a row with no finite value at all
  return x


@pytest.mark.parametrize("kind", ["normal", "ties", "inf", "nan"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
def test_top_ids_equal_top_k_in_order(kind, k):
  rng = np.random.default_rng(k * 10 + len(kind))
  for trial in range(3):
    shape = (int(rng.integers(1, 4)), int(rng.integers(2, 6)), int(rng.integers(k, 40)))
    x = jnp.asarray(_logits(rng, shape, kind))
    got = np.asarray(jax.jit(top_ids, static_argnums=1)(x, k))
    assert got.dtype == np.int32 and got.shape == shape[:-1] + (k,)
    np.testing.assert_array_equal(got, _numpy_top_ids(np.asarray(x), k),
                                  err_msg=f"{kind} k={k} trial {trial}")
    if kind != "nan":
      np.testing.assert_array_equal(got, np.asarray(jax.lax.top_k(x, k)[1]))


def _numpy_top_ids(x, k):
  rows = x.reshape(-1, x.shape[-1])
  ids = np.arange(x.shape[-1])
  order = [np.lexsort((ids, -np.where(np.isnan(r), 0, r), ~np.isnan(r)))[:k] for r in rows]
  return np.asarray(order, np.int32).reshape(x.shape[:-1] + (k,))


@pytest.mark.parametrize("paths", [
    [(0,), (1,), (2,), (0, 0), (0, 1)],                      # ranks by reductions (<= 4)
    [(0,), (1,), (2,), (3,), (4,), (5,), (0, 0), (1, 0)]])   # 6 at the root: XLA's top-k
def test_greedy_children_take_their_parents_ranked_tokens(paths):
  """Child of rank r gets its parent's r-th most likely token (ties to the lower id), whichever
  way the ranks are computed."""
  from jspec.speculative.tree import greedy_children
  from jspec.token_tree import TokenTree
  tree = TokenTree.from_paths(paths)
  rng = np.random.default_rng(len(paths))
  parents = tuple(i for i in range(tree.num_nodes) if tree.children(i))
  logits = rng.integers(-4, 4, (3, len(parents), 50)).astype(np.float32)  # many ties
  children = greedy_children(tree, parents, jnp.asarray(logits))
  ranked = _numpy_top_ids(logits, 8)
  assert set(children) == {c for p in parents for c in tree.children(p)}
  for w, p in enumerate(parents):
    for c in tree.children(p):
      np.testing.assert_array_equal(np.asarray(children[c]), ranked[:, w, tree.rank(c)])
