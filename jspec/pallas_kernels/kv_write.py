"""A step's new keys and values written into the KV cache in place, both in one Pallas (Triton)
kernel.

Why: XLA writes each of the two with a scatter whose out-of-range updates are dropped, which it
runs as two kernels (a select of the new rows against the slots they replace, then the
dynamic-update-slice): four kernels a layer in a decode step, each 1.1-1.6 µs on an H100 for a
few KB (BENCHMARKS.md, "KV cache writes in one kernel"). Here one program per (sequence, token,
KV head) stores its key and value rows where its position is in the cache, and skips them where
it is not (as the scatter drops them); the caches are aliased to the outputs, so nothing else
of them moves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform


def fits_kernel(head_dim: int) -> bool:
  """Whether a head's row is one Triton block."""
  return platform.triton_block(head_dim)


def _write_kernel(pos_ref, k_ref, v_ref, keys_in_ref, values_in_ref, keys_ref, values_ref, *,
                  slots: int):
  del keys_in_ref, values_in_ref  # the same buffers as keys_ref / values_ref (aliased)
  b, t, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  slot = pos_ref[b, t]

  @pl.when((slot >= 0) & (slot < slots))
  def _():
    keys_ref[b, head, slot, :] = k_ref[b, t, head, :].astype(keys_ref.dtype)
    values_ref[b, head, slot, :] = v_ref[b, t, head, :].astype(values_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(keys_BKSH: jax.Array, values_BKSH: jax.Array, k_BTKH: jax.Array,
             v_BTKH: jax.Array, positions_BT: jax.Array, *, interpret: bool | None = None):
  """(keys, values) [B, K, S, H] with k[b, t] and v[b, t] ([B, T, K, H]) stored at slot
  positions[b, t] of sequence b; rows whose position is outside [0, S) are dropped, as
  jspec.models.caches.write_slots drops them. Inside a program the outputs alias the caches,
  so XLA writes the rows in place where the old caches are not read after."""
  b, k_heads, slots, head_dim = keys_BKSH.shape
  t = k_BTKH.shape[1]
  if (values_BKSH.shape != keys_BKSH.shape or k_BTKH.shape != (b, t, k_heads, head_dim)
      or v_BTKH.shape != k_BTKH.shape or positions_BT.shape != (b, t)):
    raise ValueError(f"write_kv takes caches [B, K, S, H], new rows [B, T, K, H] and "
                     f"positions [B, T], got {keys_BKSH.shape}, {values_BKSH.shape}, "
                     f"{k_BTKH.shape}, {v_BTKH.shape}, {positions_BT.shape}")
  if not fits_kernel(head_dim):
    raise ValueError(f"write_kv needs head_dim a power of two >= 16, got {head_dim}")
  if interpret is None:
    interpret = not platform.on_gpu()
  cache = jax.ShapeDtypeStruct(keys_BKSH.shape, keys_BKSH.dtype)
  return pl.pallas_call(
      functools.partial(_write_kernel, slots=slots),
      out_shape=(cache, jax.ShapeDtypeStruct(values_BKSH.shape, values_BKSH.dtype)),
      grid=(b, t, k_heads), input_output_aliases={3: 0, 4: 1},
      compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret, name="write_kv",
  )(positions_BT.astype(jnp.int32), k_BTKH, v_BTKH, keys_BKSH, values_BKSH)
