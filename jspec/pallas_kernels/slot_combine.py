"""The FP8 expert path's last step in one Pallas (Triton) kernel: the down kernel's K-slice
partials summed, each slot's token scale applied, and each token's slots added in pick order:

  y [T, D] = sum_k [slot_TK[t, k] >= 0] x scale[s, t] x sum_p down[p, s, :, t],
             s = slot_TK[t, k],   down [P, S, D, N] float32, scale [S, N] float32

Why: XLA runs it as one fusion that gathers each token's values across the down kernel's
[S, D, N] order; on DeepSeek-V3's shapes (8 slots, D = 7168, N = 8) it took 5.2 µs a MoE layer
at batch 1 on an H200 for 7168 outputs (BENCHMARKS.md, "Norm kernels' loads before their
stores ..."). Here a program takes a block of D for one token and reads only its slots' rows.
Off by default (fp8_experts.COMBINE_KERNEL) until it is timed on a GPU.

The same float32 operations as the XLA form (jspec.pallas_kernels.fp8_experts and
decode_routing.combine_slots) in the same order, but for the order of three or more partials
(summed first to last here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform

MAX_BLOCK = 1024  # output columns a program writes (a power of two dividing D, at most this)
MIN_BLOCK = 64


def block_columns(dim: int) -> int:
  return min(dim & -dim, MAX_BLOCK)


def fits(dim: int) -> bool:
  return block_columns(dim) >= MIN_BLOCK


def _kernel(slot_ref, scale_ref, down_ref, out_ref, *, splits: int, top_k: int, block: int):
  t, d = pl.program_id(0), pl.program_id(1)
  cols = pl.ds(pl.multiple_of(d * block, block), block)
  total = jnp.zeros((block,), jnp.float32)
  for k in range(top_k):  # pick order, as combine_slots adds them
    slot = slot_ref[t, k]
    s = jnp.maximum(slot, 0)
    down = down_ref[0, s, cols, t]
    for p in range(1, splits):
      down = down + down_ref[p, s, cols, t]
    total = total + jnp.where(slot >= 0, down * scale_ref[s, t], 0.0)
  out_ref[t, cols] = total.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def combine_down_partials(down_PSDN: jax.Array, scale_SN: jax.Array, slot_TK: jax.Array,
                          dtype, interpret: bool | None = None) -> jax.Array:
  """y [T, D] in `dtype` from the down kernel's float32 partials [P, S, D, N], the slots' token
  scales [S, N] (routing weight times the activation's row scale) and the decode plan's
  slot_TK [T, K] (-1: adds nothing)."""
  splits, slots, dim, rows = down_PSDN.shape
  tokens, top_k = slot_TK.shape
  if (down_PSDN.dtype != jnp.float32 or scale_SN.shape != (slots, rows) or tokens > rows
      or not fits(dim)):
    raise ValueError(f"combine_down_partials takes float32 partials [P, S, D, N] (D with a "
                     f"power-of-two factor of at least {MIN_BLOCK}), scales [S, N] and slots "
                     f"[T <= N, K]; got {down_PSDN.shape} {down_PSDN.dtype}, "
                     f"{scale_SN.shape}, {slot_TK.shape}")
  if interpret is None:
    interpret = not platform.on_gpu()
  block = block_columns(dim)
  return pl.pallas_call(
      functools.partial(_kernel, splits=splits, top_k=top_k, block=block),
      out_shape=jax.ShapeDtypeStruct((tokens, dim), dtype),
      grid=(tokens, dim // block),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="fp8_down_combine",
  )(slot_TK.astype(jnp.int32), scale_SN.astype(jnp.float32), down_PSDN)
