"""Attention over a token tree: where each window token's keys go, and what each one sees.

A chain's verify window stores token t at slot = position and attends causally. A tree's
window holds several tokens per position (siblings share a depth), so a token's slot and its
RoPE position part: the window's tokens go to consecutive slots from `start`, each at the
position its depth gives, and each attends to the committed slots below `start` and to its
ancestors' slots in the window (itself included), never to a sibling's. After acceptance the
loop moves the accepted path's rows to the slots its positions name (`compact`), so the cache
is again by position.

The layout reaches the attention layers as a trace-time context (`tree_layout`) rather than an
argument: every family's layer stack would otherwise pass it through. A layer that finds a
layout whose width matches its window writes its keys at the layout's slots (GQA layers
through the cache-write kernel where it runs) and attends with the layout's table through
XLA's masked attention (the fused attention kernels assume a causal window; the short-context
kernel given the tree's mask was measured slower, BENCHMARKS.md).

Shape letters: B batch, T window tokens (the layout's queries), M window slots the layout
names, S cache slots.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TreeLayout:
  """One forward's window over a tree (static, hashable).

  write_offsets[t]: query t's slot is start + write_offsets[t].
  visible[t][u]: query t sees window slot start + u (u < M), beside every slot below start.
  start_shift: start = the first query's RoPE position - start_shift (positions are by depth).
  """
  write_offsets: tuple[int, ...]
  visible: tuple[tuple[bool, ...], ...]
  start_shift: int = 0

  @property
  def width(self) -> int:
    return len(self.write_offsets)

  def start(self, positions_BT):
    return positions_BT[:, 0] - self.start_shift

  def slots(self, positions_BT):
    """[B, T] the slots the window's keys and values go to."""
    return self.start(positions_BT)[:, None] + jnp.asarray(self.write_offsets, jnp.int32)

  def visible_BTS(self, positions_BT, num_slots: int):
    """[B, T, S] bool: which of the first `num_slots` slots each query attends to."""
    offset_BS = (jnp.arange(num_slots, dtype=jnp.int32)[None, :]
                 - self.start(positions_BT)[:, None])
    table_TM = jnp.asarray(np.asarray(self.visible, bool))
    inside_BS = (offset_BS >= 0) & (offset_BS < table_TM.shape[1])
    seen_BTS = jnp.take(table_TM, jnp.clip(offset_BS, 0, table_TM.shape[1] - 1), axis=1)
    seen_BTS = jnp.moveaxis(seen_BTS, 0, 1)  # take gives [T, B, S]
    return (offset_BS < 0)[:, None, :] | (inside_BS[:, None, :] & seen_BTS)


# Per thread (a context variable): programs may be traced on a worker thread while another
# thread traces its own.
_ACTIVE: contextvars.ContextVar[TreeLayout | None] = contextvars.ContextVar("tree_layout",
                                                                           default=None)


@contextlib.contextmanager
def tree_layout(layout: TreeLayout | None) -> Iterator[None]:
  """Attention layers traced inside see `layout` (None: causal windows, as outside)."""
  token = _ACTIVE.set(layout)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active_layout(width: int) -> TreeLayout | None:
  """The layout for a window of `width` tokens, if one is active and has that width."""
  layout = _ACTIVE.get()
  return layout if layout is not None and layout.width == width else None

