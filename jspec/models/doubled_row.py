"""A batch-1 step's one output row held as the first of two equal rows.

Why: XLA's GPU compiler rewrites a one-row product whose operands hold under 10 M elements into
a multiply and a reduction that writes the whole product to memory (skinny_gemm), so such a
product runs as a GEMM of two equal rows, the first kept. Built from the one row, that costs
two small kernels a layer around o_proj's GEMM: the concatenate of the row with itself before
it and the slice of the first row after it (1.1 and 1.2 µs each on an H200, Qwen3-30B-A3B;
BENCHMARKS.md). The attention kernel writes its output row twice instead
(short_attention's `copies`), and the norm after the residual add reads the first of the two
product rows (`rows_B2D`, whole) instead of a sliced copy.
"""

from __future__ import annotations


class DoubledRow:
  """An activation [1, 1, D] held as the first row of `rows_B2D` [1, 2, D], whose second row is
  the same product of the same input. `array()` is the activation; `+` takes it; a norm after
  a residual add reads the first row itself (jspec.models.norms.RMSNorm.add_and_norm)."""

  def __init__(self, rows_B2D):
    if rows_B2D.ndim != 3 or rows_B2D.shape[:2] != (1, 2):
      raise ValueError(f"a doubled row is [1, 2, D], got {rows_B2D.shape}")
    self.rows_B2D = rows_B2D
    self.shape = (1, 1, rows_B2D.shape[2])
    self.dtype = rows_B2D.dtype

  def array(self):
    return self.rows_B2D[:, :1]

  def __add__(self, other):
    return self.array() + other

  def __radd__(self, other):
    return other + self.array()
