"""jspec.shapes.packing: arrays of several dtypes packed into one int32 buffer come back bit for
bit, on the host and inside a program, and a wrong array is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.shapes.packing import Layout, TreeLayout, tree_shapes


def random_fields(rng):
  """Seeded fields of random shapes, every dtype a buffer carries, special floats included."""
  floats = rng.standard_normal(int(rng.integers(1, 9))).astype(np.float32)
  floats[0] = -0.0
  if floats.size > 2:
    floats[1], floats[2] = np.inf, np.nan
  return {
      "tokens": rng.integers(-2**31, 2**31 - 1, size=(int(rng.integers(1, 5)), 3), dtype=np.int32),
      "temperature": floats,
      "seeds": rng.integers(0, 2**32, size=(int(rng.integers(1, 6)),), dtype=np.uint32),
      "done": rng.random((2, int(rng.integers(1, 4)))) < 0.5,
      "scalar": np.asarray(rng.integers(-9, 9), np.int32),
      "empty": np.zeros((0, 4), np.float32),
  }


def same(a, b):
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("seed", range(8))
def test_host_round_trip_is_bit_exact(seed):
  fields = random_fields(np.random.default_rng(seed))
  layout = Layout.of(fields)
  buffer = layout.pack_host(fields)
  assert buffer.dtype == np.int32 and buffer.shape == (layout.size,)
  back = layout.unpack_host(buffer)
  assert list(back) == list(fields)
  for name in fields:
    assert same(back[name], fields[name]), name


@pytest.mark.parametrize("seed", range(4))
def test_unpacked_in_a_program_and_packed_back_is_bit_exact(seed):
  fields = random_fields(np.random.default_rng(100 + seed))
  layout = Layout.of(fields)
  inside = jax.jit(layout.unpack)(jnp.asarray(layout.pack_host(fields)))
  for name in fields:
    assert same(np.asarray(inside[name]), fields[name]), name
  again = jax.jit(layout.pack)(inside)
  assert np.array_equal(np.asarray(again), layout.pack_host(fields))


def test_a_pytree_with_none_leaves_packs_by_its_paths():
  tree = {"a": jnp.arange(6, dtype=jnp.int32).reshape(2, 3), "b": None,
          "c": (jnp.float32(2.5), jnp.asarray([True, False]))}
  layout = TreeLayout.of(jax.eval_shape(lambda: tree))
  host = layout.unpack_host(np.asarray(jax.jit(layout.pack)(tree)))
  assert host["b"] is None
  assert same(host["a"], np.arange(6, dtype=np.int32).reshape(2, 3))
  assert same(host["c"][0], np.asarray(2.5, np.float32))
  assert same(host["c"][1], np.asarray([True, False]))


def test_wrong_arrays_are_refused():
  with pytest.raises(TypeError, match="32-bit"):
    Layout.of({"x": np.zeros(3, np.int64)})
  layout = Layout.of({"x": np.zeros(3, np.int32)})
  with pytest.raises(ValueError, match="layout"):
    layout.pack_host({"x": np.zeros(4, np.int32)})
  with pytest.raises(ValueError, match="layout"):
    layout.pack_host({"x": np.zeros(3, np.float32)})
  with pytest.raises(ValueError, match="int32"):
    layout.unpack_host(np.zeros(4, np.int32))


def test_tree_shapes_tell_shape_dtype_and_structure_apart():
  """The planned-shapes check of the continuous scheduler's programs: equal for the same tree
  of arrays or shape structs (bf16 leaves too, which do not pack), different when one leaf's
  shape or dtype, or the structure, differs."""
  tree = {"a": jnp.zeros((2, 3), jnp.bfloat16), "b": (jnp.zeros((4,), jnp.int32), None)}
  assert tree_shapes(tree) == tree_shapes(jax.eval_shape(lambda: tree))
  assert tree_shapes(tree) != tree_shapes({**tree, "a": jnp.zeros((3, 2), jnp.bfloat16)})
  assert tree_shapes(tree) != tree_shapes({**tree, "a": jnp.zeros((2, 3), jnp.float32)})
  assert tree_shapes(tree) != tree_shapes({**tree, "b": (jnp.zeros((4,), jnp.int32),)})
