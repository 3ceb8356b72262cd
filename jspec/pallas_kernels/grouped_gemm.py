"""Grouped GEMMs over the padded expert-sorted rows, in Pallas Mosaic GPU (Hopper wgmma).

Two kernels, each in two tilings:

  gate_up_swiglu:  act = silu(x @ w_gate[e]) * (x @ w_up[e])       (both GEMMs share x tiles;
                   SwiGLU runs in the epilogue, so one pass writes the activated rows)
  down_weighted:   out = routing_weight * (act @ w_down[e])          (weight in the epilogue)

Standard tiling (prefill): a tile is `block_rows` token rows x `block_cols` output columns;
token rows are wgmma's M dimension, so block_rows >= 64.

Operand-swapped tiling (decode/verify): the kernel computes the transpose, out^T = W^T x^T,
so the weight columns are wgmma's M dimension (64) and the token rows its N dimension, which
can be as small as 16 here: an expert that got 1 to 16 token copies costs a 16-wide tile,
not a 64-row one. The accumulator holds out^T and is written back through a transposed view
of the SMEM tile, so activations and outputs are [P, F] and [P, D] in both tilings.

Work is a persistent loop: each SM walks (tile, column block) pairs with stride = SM count.
Tiles are in expert order and the used ones come first, so the unused tail of the static
table is spread evenly and skipped without touching memory: an expert with no tokens has no
tile and its weights are never read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import platform
from jspec.pallas_kernels.shared import silu_mul, smem_transforms


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Block sizes of one grouped GEMM.

  swapped: tokens on wgmma's N dimension (decode/verify sizes).
  block_rows: token rows per tile (the routing plan's padding unit).
  block_cols: output columns per tile (the weights' N; wgmma M = 64 when swapped).
  block_k: contraction step of the pipeline.
  num_stages: TMA pipeline depth (tiles in flight per SM).
  """

  swapped: bool
  block_rows: int
  block_cols: int
  block_k: int
  num_stages: int


def _check_divisible(name, size, block):
  if size % block:
    raise ValueError(f"{name}={size} must be a multiple of the block size {block}")


def _persistent_loop(num_tiles_max: int, num_col_blocks: int, tile_expert_ref, body):
  """Calls body(tile, col_block, expert) for every used tile, strided over the SMs."""

  @plgpu.nd_loop((num_tiles_max * num_col_blocks,), collective_axes="sm")
  def _loop(info: plgpu.NDLoopInfo):
    (work,) = info.index
    tile = lax.div(work, jnp.int32(num_col_blocks))
    col_block = lax.rem(work, jnp.int32(num_col_blocks))
    expert = tile_expert_ref[tile]

    @pl.when(expert >= 0)
    def _():
      body(tile, col_block, expert)


def _store_tile(value, out_gmem_slice, dtype, transpose: bool):
  """Registers -> swizzled SMEM -> one TMA store; `transpose` stores value.T.

  The swapped kernels hold out^T in registers; writing it through a transposed view of the
  SMEM tile keeps every array in HBM row-major [rows, features] for both tilings.
  """
  rows, cols = value.shape[::-1] if transpose else value.shape

  @functools.partial(pl.run_scoped,
                     o_smem=plgpu.SMEM((rows, cols), dtype,
                                       transforms=smem_transforms(cols, dtype)))
  def _(o_smem):
    if transpose:
      o_smem.T[...] = value.astype(dtype)
    else:
      o_smem[...] = value.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem_slice)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel_call(body, out_shape, dtype, tiling_name):
  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(out_shape, dtype),
      grid=(platform.num_sms(),),
      grid_names=("sm",),
      interpret=platform.interpret_params(),
      kernel_name=tiling_name,
  )


def gate_up_swiglu(x_PD: jax.Array, w_gate_EDF: jax.Array, w_up_EDF: jax.Array,
                   tile_expert_N: jax.Array, tiling: Tiling) -> jax.Array:
  """act_PF = silu(x @ w_gate[e]) * (x @ w_up[e]) per tile."""
  num_rows, dim = x_PD.shape
  _, _, ffn = w_gate_EDF.shape
  dtype = x_PD.dtype
  bm, bn, bk = tiling.block_rows, tiling.block_cols, tiling.block_k
  num_tiles_max = tile_expert_N.shape[0]
  assert num_tiles_max * bm == num_rows, (num_tiles_max, bm, num_rows)
  _check_divisible("D", dim, bk)
  _check_divisible("F", ffn, bn)
  x_spec = plgpu.BlockSpec((bm, bk), lambda k: (0, k), transforms=smem_transforms(bk, dtype),
                           delay_release=1)
  w_spec = plgpu.BlockSpec((bk, bn), lambda k: (k, 0), transforms=smem_transforms(bn, dtype),
                           delay_release=1)
  acc_shape = (bn, bm) if tiling.swapped else (bm, bn)

  def body(tile_expert_ref, x_ref, w_gate_ref, w_up_ref, act_ref):
    def tile_body(tile, col_block, expert):
      rows = pl.ds(tile * bm, bm)
      cols = pl.ds(col_block * bn, bn)

      def step(_, x_smem, g_smem, u_smem, acc_g, acc_u):
        if tiling.swapped:
          plgpu.wgmma(acc_g, g_smem.T, x_smem.T)
          plgpu.wgmma(acc_u, u_smem.T, x_smem.T)
        else:
          plgpu.wgmma(acc_g, x_smem, g_smem)
          plgpu.wgmma(acc_u, x_smem, u_smem)
        plgpu.wgmma_wait(2)  # This step's two groups may run on; the previous step's are done.

      def acc_scope(acc_g, acc_u):
        plgpu.emit_pipeline(
            lambda idx, x_smem, g_smem, u_smem: step(idx, x_smem, g_smem, u_smem, acc_g, acc_u),
            grid=(dim // bk,),
            in_specs=[x_spec, w_spec, w_spec],
            max_concurrent_steps=tiling.num_stages,
        )(x_ref.at[rows], w_gate_ref.at[expert, :, cols], w_up_ref.at[expert, :, cols])
        return acc_g[...], acc_u[...]

      gate, up = pl.run_scoped(acc_scope, plgpu.ACC(acc_shape), plgpu.ACC(acc_shape))
      act = silu_mul(gate, up)
      _store_tile(act, act_ref.at[rows, cols], dtype, transpose=tiling.swapped)

    _persistent_loop(num_tiles_max, ffn // bn, tile_expert_ref, tile_body)

  out_shape = (num_rows, ffn)
  name = "moe_gate_up_swapped" if tiling.swapped else "moe_gate_up"
  return _kernel_call(body, out_shape, dtype, name)(tile_expert_N, x_PD, w_gate_EDF, w_up_EDF)


def down_weighted(act: jax.Array, w_down_EFD: jax.Array, row_weight_P: jax.Array,
                  tile_expert_N: jax.Array, tiling: Tiling) -> jax.Array:
  """out_PD = row_weight * (act_PF @ w_down[e]) per tile."""
  _, ffn, dim = w_down_EFD.shape
  num_rows = row_weight_P.shape[0]
  dtype = act.dtype
  bm, bn, bk = tiling.block_rows, tiling.block_cols, tiling.block_k
  num_tiles_max = tile_expert_N.shape[0]
  assert num_tiles_max * bm == num_rows, (num_tiles_max, bm, num_rows)
  _check_divisible("F", ffn, bk)
  _check_divisible("D", dim, bn)
  a_spec = plgpu.BlockSpec((bm, bk), lambda k: (0, k), transforms=smem_transforms(bk, dtype),
                           delay_release=1)
  w_spec = plgpu.BlockSpec((bk, bn), lambda k: (k, 0), transforms=smem_transforms(bn, dtype),
                           delay_release=1)
  acc_shape = (bn, bm) if tiling.swapped else (bm, bn)

  def body(tile_expert_ref, weight_ref, act_ref, w_down_ref, out_ref):
    def tile_body(tile, col_block, expert):
      rows = pl.ds(tile * bm, bm)
      cols = pl.ds(col_block * bn, bn)

      def step(_, a_smem, w_smem, acc):
        if tiling.swapped:
          plgpu.wgmma(acc, w_smem.T, a_smem.T)
        else:
          plgpu.wgmma(acc, a_smem, w_smem)
        plgpu.wgmma_wait(1)

      def acc_scope(acc):
        a_gmem = act_ref.at[rows]
        plgpu.emit_pipeline(
            lambda idx, a_smem, w_smem: step(idx, a_smem, w_smem, acc),
            grid=(ffn // bk,),
            in_specs=[a_spec, w_spec],
            max_concurrent_steps=tiling.num_stages,
        )(a_gmem, w_down_ref.at[expert, :, cols])
        return acc[...]

      # The tile's routing weights travel by TMA while the pipeline runs.
      @functools.partial(pl.run_scoped, weight_smem=plgpu.SMEM((bm,), jnp.float32),
                         weight_barrier=plgpu.Barrier())
      def _(weight_smem, weight_barrier):
        plgpu.copy_gmem_to_smem(weight_ref.at[rows], weight_smem, weight_barrier)
        out = pl.run_scoped(acc_scope, plgpu.ACC(acc_shape))
        plgpu.barrier_wait(weight_barrier)
        if tiling.swapped:
          weight = plgpu.load(weight_smem, layout=plgpu.Layout.WGMMA.reduce(0))
          out = out * lax.broadcast_in_dim(weight, acc_shape, [1])
          _store_tile(out, out_ref.at[rows, cols], dtype, transpose=True)
        else:
          weight = plgpu.load(weight_smem, layout=plgpu.Layout.WGMMA.reduce(1))
          out = out * lax.broadcast_in_dim(weight, acc_shape, [0])
          _store_tile(out, out_ref.at[rows, cols], dtype, transpose=False)

    _persistent_loop(num_tiles_max, dim // bn, tile_expert_ref, tile_body)

  out_shape = (num_rows, dim)
  name = "moe_down_swapped" if tiling.swapped else "moe_down"
  return _kernel_call(body, out_shape, dtype, name)(tile_expert_N, row_weight_P, act, w_down_EFD)
