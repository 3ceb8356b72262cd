"""The residual add and RMSNorm before a softmax-routed MoE layer, and its router's product, in
one Pallas (Triton) kernel.

Why: at batch 1 a MoE layer's input norm (jspec.pallas_kernels.residual_norm's
`add_rms_norm`) and its router product (jspec.pallas_kernels.router_topk's `router_partials`)
are two kernels whose cost is their launch and the latency of their first reads: about 2.0 and
4.1 µs a layer for Qwen3-30B-A3B on an H200, for 8 KB of rows and 0.5 MB of router
(BENCHMARKS.md, "Softmax routing in two kernels ..."). Here the router's slices are the grid:
program (m, s) reads row m of x and of the delta whole (the norm needs the row's sum of
squares), writes h = x + delta and norm(h) for the columns of slice s, and multiplies that
slice of norm(h) with router rows of slice s, as router_partials does:

  add_norm_router_partials(x [M, D], delta [M, D], scale [D], router [D, E])
      -> (h [M, D], norm(h) [M, D], float32 partial logits [M, S, E])

h and norm(h) are computed as `rms_norm` computes them, the partials as `router_partials`
computes them from norm(h); router_topk.select turns the partials into the routing.

`quantize`: norm(h) in e4m3 too, with its scales in the FP8 kernel's lanes (as
residual_norm's quantize forms write them, each program its slice's 128-groups), for FP8
experts that multiply it on the FP8 tensor cores (fp8_experts' act_lanes_X).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform, router_topk
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3
from jspec.pallas_kernels.fp8_gemm import MAX_ROWS, act_lanes_size
from jspec.pallas_kernels.residual_norm import (fits_kernel as norm_fits, row_chunk, scaled_norm,
                                                store_e4m3)


def fits(num_tokens: int, hidden: int, num_experts: int, top_k: int) -> bool:
  """Rows the norm kernel takes, and a router the routing kernels take."""
  return norm_fits(hidden) and router_topk.fits_kernel(num_tokens, hidden, num_experts, top_k)


def _kernel(x_ref, delta_ref, scale_ref, router_ref, h_ref, out_ref, parts_ref, *quantized,
            eps: float, zero_centered: bool, slice_rows: int, interpret: bool):
  m, s = pl.program_id(0), pl.program_id(1)
  width = x_ref.shape[1]
  chunk = row_chunk(width)

  def added(cols):  # x + delta rounded to the stream's dtype, as rms_norm's add
    x = x_ref[m, cols]
    return (x.astype(jnp.float32) + delta_ref[m, cols].astype(jnp.float32)).astype(x.dtype)

  # The slice's router rows, scale and pieces of h are loaded first: the row's sum of squares
  # below is a block reduction (a barrier), which loads placed after it would wait for, so
  # they would start one memory latency later.
  steps = [pl.ds(s * slice_rows + i * router_topk.ROW_CHUNK, router_topk.ROW_CHUNK)
           for i in range(slice_rows // router_topk.ROW_CHUNK)]  # router_partials' loop steps
  routers = [router_ref[cols, :] for cols in steps]
  scales = [scale_ref[cols] for cols in steps]
  slice_h = [added(cols) for cols in steps]
  pieces = [added(pl.ds(c * chunk, chunk)) for c in range(width // chunk)]  # the whole row
  # quantize: the slice's 128-groups read again whole (the steps above are 64 columns)
  groups = ([pl.ds(s * slice_rows + g * BLOCK, BLOCK) for g in range(slice_rows // BLOCK)]
            if quantized else [])
  group_h = [(added(cols), scale_ref[cols]) for cols in groups]
  squares = jnp.float32(0.0)
  for piece in pieces:  # in rms_norm's pieces and order
    h32 = piece.astype(jnp.float32)
    squares += jnp.sum(h32 * h32)
  inv_rms = jax.lax.rsqrt(squares / width + eps)
  experts = router_ref.shape[1]
  acc_CE = jnp.zeros((router_topk.ROW_CHUNK, experts), jnp.float32)
  stores = []
  for cols, router_CE, scale, h in zip(steps, routers, scales, slice_h):
    out = scaled_norm(h, scale, inv_rms, zero_centered)
    stores.append((cols, h, out))
    acc_CE = acc_CE + out.astype(jnp.float32)[:, None] * router_CE.astype(jnp.float32)
  # Stored after every load: a load placed after a store to h or norm(h) cannot be moved
  # before it (they could alias), and the store waits for its values, so the steps' router
  # rows were read one after another (BENCHMARKS.md, "Norm kernels' loads before their
  # stores").
  for cols, h, out in stores:
    h_ref[m, cols] = h
    out_ref[m, cols] = out
  for cols, (h, scale) in zip(groups, group_h):
    store_e4m3(scaled_norm(h, scale, inv_rms, zero_centered), cols, m, *quantized,
                interpret=interpret)
  parts_ref[m, s, :] = jnp.sum(acc_CE, axis=0)


def quantizes(rows: int, width: int, slices: int | None = None) -> bool:
  """Whether the kernel takes `quantize` for these rows: at most fp8_gemm.MAX_ROWS, each slice
  whole 128-groups."""
  slices = slices or router_topk.num_slices(width)
  return rows <= MAX_ROWS and width % (slices * BLOCK) == 0


@functools.partial(jax.jit, static_argnames=("eps", "zero_centered", "slices", "interpret",
                                             "quantize"))
def add_norm_router_partials(x_MD: jax.Array, delta_MD: jax.Array, scale_D: jax.Array,
                             router_DE: jax.Array, *, eps: float, zero_centered: bool = False,
                             slices: int | None = None, interpret: bool | None = None,
                             quantize: bool = False):
  """(h, norm(h), float32 partial router logits [M, S, E]) for h = x + delta (see the module
  docstring); S = router_topk.num_slices(D) unless given. `interpret` None: off GPU.
  quantize (where `quantizes`): norm(h)'s e4m3 form [M, D] and its lanes [D/128 x L]
  (fp8_gemm.act_lanes') follow."""
  rows, width = x_MD.shape
  experts = router_DE.shape[1]
  if (delta_MD.shape != x_MD.shape or delta_MD.dtype != x_MD.dtype or scale_D.shape != (width,)
      or router_DE.shape[0] != width or not fits(rows, width, experts, 1)):
    raise ValueError(f"add_norm_router_partials takes x and delta [M <= "
                     f"{router_topk.MAX_TOKENS}, D] of one dtype, scale [D] and a router [D, E] "
                     f"(E a power of two in [8, {router_topk.MAX_EXPERTS}], D a multiple of "
                     f"{router_topk.ROW_CHUNK}); got {x_MD.shape} {x_MD.dtype}, "
                     f"{delta_MD.shape} {delta_MD.dtype}, {scale_D.shape}, {router_DE.shape}")
  slices = slices or router_topk.num_slices(width)
  if width % (slices * router_topk.ROW_CHUNK) or slices & (slices - 1):
    raise ValueError(f"slices must be a power of two that cuts the router's {width} rows "
                     f"into whole loop steps of {router_topk.ROW_CHUNK}, got {slices}")
  if quantize and not quantizes(rows, width, slices):
    raise ValueError(f"add_norm_router_partials quantizes up to {MAX_ROWS} rows in slices of "
                     f"whole {BLOCK}-groups, got {rows} rows of {width} in {slices} slices")
  if interpret is None:
    interpret = not platform.on_gpu()
  row = jax.ShapeDtypeStruct((rows, width), x_MD.dtype)
  out_shape = (row, row, jax.ShapeDtypeStruct((rows, slices, experts), jnp.float32))
  if quantize:
    lanes = act_lanes_size(rows, width) // (width // BLOCK)
    out_shape += (jax.ShapeDtypeStruct((rows, width), E4M3),
                  jax.ShapeDtypeStruct((width // BLOCK, lanes), jnp.float32))
  out = pl.pallas_call(
      functools.partial(_kernel, eps=eps, zero_centered=zero_centered,
                        slice_rows=width // slices, interpret=interpret),
      out_shape=out_shape, grid=(rows, slices),
      compiler_params=pltriton.CompilerParams(num_warps=router_topk.NUM_WARPS, num_stages=2),
      interpret=interpret, name="add_norm_router" + ("_e4m3" if quantize else ""),
  )(x_MD, delta_MD, scale_D, router_DE)
  if quantize:
    *out, lanes_2d = out
    return (*out, lanes_2d.reshape(-1))
  return out


@functools.partial(jax.jit, static_argnames=("eps", "zero_centered", "top_k", "norm", "plan",
                                             "interpret", "quantize"))
def add_norm_route_softmax(x_MD, delta_MD, scale_D, router_DE, *, eps: float,
                           zero_centered: bool, top_k: int, norm: bool, plan: bool = False,
                           interpret: bool | None = None, quantize: bool = False):
  """(h, norm(h), routing): routing as router_topk.route_softmax (plan: route_softmax_plan)
  of norm(h), the norm and the router product in one kernel. quantize: (h, norm(h), routing,
  norm(h) in e4m3, its lanes), add_norm_router_partials'."""
  interpret = not platform.on_gpu() if interpret is None else interpret
  if not 1 <= top_k <= router_DE.shape[1]:
    raise ValueError(f"top_k must be in [1, {router_DE.shape[1]}], got {top_k}")
  h_MD, normed_MD, parts_MSE, *quantized = add_norm_router_partials(
      x_MD, delta_MD, scale_D, router_DE, eps=eps, zero_centered=zero_centered,
      interpret=interpret, quantize=quantize)
  routing = router_topk.select(parts_MSE, x_MD.dtype, router_DE.dtype, top_k=top_k, norm=norm,
                               plan=plan, interpret=interpret)
  return h_MD, normed_MD, routing, *quantized
