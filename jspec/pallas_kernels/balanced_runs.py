"""Equal runs of a persistent grid's work: each program takes the same number of K steps of the
items, in item order, so that no SM idles in a last round the items do not fill (the FP8
few-row kernel's balanced form, jspec.pallas_kernels.fp8_block_kernel.partials).

An item cut between programs is summed in pieces: each program that holds some of its steps
writes its partial to the item's next slot, and the readers sum the slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class BalancedRuns:
  """Equal runs of work items' K steps over the programs, in order (`partials(balanced=True)`):
  program p takes steps [first_step(p), first_step(p + 1)) of the items' num_items x k_steps
  steps; an item cut between programs leaves a partial in each, program p's in the item's
  slot `segment(p, step)`. The methods take int32 scalars or arrays (the kernel's indices, or
  every program at once in a test)."""
  num_items: int
  k_steps: int
  num_programs: int

  @property
  def total_steps(self) -> int:
    return self.num_items * self.k_steps

  @property
  def busy_programs(self) -> int:
    """Programs with a run: every step its own program where there are fewer steps than
    programs (the rest idle at the end, so that no idle program sits between an item's)."""
    return min(self.num_programs, self.total_steps)

  @property
  def segments(self) -> int:
    """The partial slots an item needs: the most programs one item's steps fall in, rounded up
    to a power of two (the q / k norm kernel's readers take a power of two)."""
    first = np.arange(self.num_items, dtype=np.int64) * self.k_steps
    owner = lambda step: ((step + 1) * self.busy_programs - 1) // self.total_steps
    spans = owner(first + self.k_steps - 1) - owner(first) + 1
    return 1 << int(spans.max() - 1).bit_length()

  def first_step(self, program):
    busy = jnp.int32(self.busy_programs)
    return lax.div(jnp.minimum(program, busy) * jnp.int32(self.total_steps), busy)

  def run_length(self, program):
    return self.first_step(program + 1) - self.first_step(program)

  def item_and_step(self, program, step):
    """(item, K step within it) of the program's step."""
    whole = self.first_step(program) + step
    return lax.div(whole, jnp.int32(self.k_steps)), lax.rem(whole, jnp.int32(self.k_steps))

  def segment(self, program, step):
    """The slot of the program's partial for its step's item: how many programs before it hold
    steps of the item (the owner of step t is the last program whose run starts at or before
    t, so programs with empty runs are skipped)."""
    item, _ = self.item_and_step(program, step)
    first = item * jnp.int32(self.k_steps)
    owner = lax.div((first + 1) * jnp.int32(self.busy_programs) - 1,
                    jnp.int32(self.total_steps))
    return program - owner
