"""Many small arrays moved between host and device as one int32 buffer.

Each host-to-device or device-to-host copy of a small array costs tens of µs on a GPU, almost
all of it fixed (one H200: 13 puts of a call's queue arrays took 0.99 ms, the same bytes as
one buffer 0.17 ms; 14 finished-row arrays back 1.0 ms, one buffer 0.35 ms). So a call's
inputs travel as one buffer, unpacked inside the program that reads them, and a dispatch's
outputs come back as one buffer, unpacked on the host as numpy views.

A `Layout` is static (hashable): each leaf's name, shape and dtype, in buffer order. 32-bit
leaves are bit-cast (exact); bool leaves travel as 0 / 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class Field:
  name: str
  shape: tuple[int, ...]
  dtype: str

  @property
  def size(self) -> int:
    return math.prod(self.shape)


def _check_dtype(name: str, dtype) -> str:
  dtype = np.dtype(dtype)
  if dtype != np.bool_ and dtype.itemsize != 4:
    raise TypeError(f"{name}: only 32-bit and bool leaves pack into int32 words, not {dtype}")
  return dtype.name


@dataclasses.dataclass(frozen=True)
class Layout:
  """Leaves in buffer order; `offsets[i]` is leaf i's first word."""
  fields: tuple[Field, ...]

  @classmethod
  def of(cls, arrays: dict) -> "Layout":
    """The layout of a dict of arrays (anything with .shape and .dtype), in its order."""
    return cls(tuple(Field(name, tuple(a.shape), _check_dtype(name, a.dtype))
                     for name, a in arrays.items()))

  @functools.cached_property
  def offsets(self) -> tuple[int, ...]:
    return tuple(np.cumsum([0] + [f.size for f in self.fields[:-1]]).tolist())

  @property
  def size(self) -> int:
    return sum(f.size for f in self.fields)

  def pack_host(self, arrays: dict) -> np.ndarray:
    """One int32 [size] buffer of numpy `arrays` (which must match the layout)."""
    out = np.empty((self.size,), np.int32)
    for f, start in zip(self.fields, self.offsets):
      a = np.asarray(arrays[f.name])
      if a.shape != f.shape or a.dtype.name != f.dtype:
        raise ValueError(f"{f.name}: {a.dtype}{list(a.shape)} is not the layout's "
                         f"{f.dtype}{list(f.shape)}")
      words = a.astype(np.int32) if a.dtype == np.bool_ else a.view(np.int32)
      out[start:start + f.size] = words.reshape(-1)
    return out

  def unpack(self, buffer: jax.Array) -> dict[str, jax.Array]:
    """The leaves of a packed device buffer (inside a traced program)."""
    out = {}
    for f, start in zip(self.fields, self.offsets):
      words = jax.lax.slice(buffer, (start,), (start + f.size,)).reshape(f.shape)
      if f.dtype == "bool":
        out[f.name] = words != 0
      elif f.dtype == "int32":
        out[f.name] = words
      else:
        out[f.name] = jax.lax.bitcast_convert_type(words, jnp.dtype(f.dtype))
    return out

  def pack(self, arrays: dict) -> jax.Array:
    """One int32 [size] device buffer of traced `arrays` (inside a program)."""
    words = []
    for f in self.fields:
      a = jnp.asarray(arrays[f.name])
      if a.dtype == jnp.bool_:
        a = a.astype(jnp.int32)
      elif a.dtype != jnp.int32:
        a = jax.lax.bitcast_convert_type(a, jnp.int32)
      words.append(a.reshape(-1))
    return jnp.concatenate(words) if words else jnp.zeros((0,), jnp.int32)

  def unpack_host(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
    """The leaves of a packed host buffer, as views where the dtype allows."""
    buffer = np.asarray(buffer)
    if buffer.shape != (self.size,) or buffer.dtype != _WORD:
      raise ValueError(f"a packed buffer is int32[{self.size}], not {buffer.dtype}"
                       f"{list(buffer.shape)}")
    out = {}
    for f, start in zip(self.fields, self.offsets):
      words = buffer[start:start + f.size]
      out[f.name] = (words != 0 if f.dtype == "bool" else words.view(f.dtype)).reshape(f.shape)
    return out


@dataclasses.dataclass(frozen=True)
class TreeLayout:
  """A pytree's leaves packed in flattening order (`layout` names them by their key paths)."""
  layout: Layout
  treedef: jax.tree_util.PyTreeDef

  @classmethod
  def of(cls, tree) -> "TreeLayout":
    """The layout of a pytree of arrays or shape / dtype structs."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return cls(Layout.of({jax.tree_util.keystr(path): x for path, x in leaves}), treedef)

  def pack(self, tree) -> jax.Array:
    """One int32 device buffer of a traced tree of this layout (inside a program)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return self.layout.pack({f.name: x for f, x in zip(self.layout.fields, leaves)})

  def unpack_host(self, buffer: np.ndarray):
    """The tree, its leaves numpy views of a packed host buffer."""
    leaves = self.layout.unpack_host(buffer)
    return jax.tree_util.tree_unflatten(self.treedef, [leaves[f.name]
                                                       for f in self.layout.fields])


def tree_shapes(tree):
  """A pytree's structure and each leaf's (shape, dtype), comparable with ==: whether a
  program's outputs are the shapes it was planned with."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, [(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]
