"""Many rows against a block-scaled FP8 weight on the FP8 tensor cores: prefill chunks and verify
windows of more than fp8_gemm.MAX_ROWS rows, y[M, N] = x[M, K] @ (w8[N, K] * scale).T, on Hopper
(Pallas Mosaic GPU).

Why: a prefill chunk (256 rows by default) is bound by the tensor cores, not by the weight's
bytes, so the decode kernel's float16 products gain nothing there, and scaling the e4m3 weight
into bf16 before XLA's dot writes and reads a bf16 copy of every weight in every chunk (a
4096-token prefill took 1.6x the bf16 time, BENCHMARKS.md). FP8 tensor cores do twice bf16's
operations a cycle. The checkpoints' own recipe (`"activation_scheme": "dynamic"`: DeepSeek-V3's
inference code, and what vLLM and SGLang run for these checkpoints) quantizes the activations
per row and 128 channels to e4m3 (fp8_gemm.quantize_activations) and multiplies e4m3 by e4m3.

How: a warpgroup multiplies 64 output columns (half a scale block of the weight's rows:
wgmma's M) by 128 rows of x (wgmma's N) in 128-K steps. A step's product lands in a fresh
float32 accumulator and is added to the sums times the step's scales, the weight block's (one
number for the 64 columns) times each row's for that 128-K group, so every scale is applied
where it is one number per row. The result is written transposed, straight into y's [M, N].
Two forms (uses_warp_specialized picks one), each splitting K into slices where its work is
too little to fill the SMs, the slices' float32 partials summed after:
  warp-specialized   a program per 128 x 128 tile, two compute warpgroups sharing the tile of
                     x and a third issuing the loads: 1.5x the products per byte loaded
                     (choose_tile_splits);
  items              each 64 x 128 product is a work item of the decode kernels' persistent
                     pipeline (jspec.pallas_kernels.decode_gemm), three programs per SM
                     (choose_splits): the first form, slower, kept for float32 results.
Both order their work so that the SMs busy at the same time share weight tiles (each tile
comes from HBM once, then from L2, whatever the row count).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import decode_gemm, platform, quantize_rows
from jspec.pallas_kernels.fp8_gemm import BLOCK, E4M3, check_operands, scale_lanes
from jspec.pallas_kernels.shared import smem_transforms

ROW_TILE = 128     # rows of x per work item: wgmma's N
COLUMN_TILE = 64   # output columns (weight rows) per work item: wgmma's M
# Two float32 [64, 128] register arrays (a step's product and the item's sums) take 128 of a
# thread's registers; a wider item would spill.
MIN_SLICE_STEPS = 8  # 128-K steps a K slice keeps at least (choose_splits)
# The warp-specialized form's pipeline depth: 3 to 5 measured within a few percent on an H200.
WARP_SPECIALIZED_STAGES = 4


@dataclasses.dataclass(frozen=True)
class PrefillTiling:
  """programs_per_sm: programs of the persistent grid sharing each SM (one waits for its
  products and applies their scales while another's run); num_stages: each one's pipeline
  depth (their shared memory together under the SM's)."""
  programs_per_sm: int = 3
  num_stages: int = 2


def fits_kernel(k: int, n: int, block: tuple[int, int]) -> bool:
  return tuple(block) == (BLOCK, BLOCK) and k % BLOCK == 0 and n % BLOCK == 0


def _result_form(splits: int, out_dtype, per_slice: bool = False):
  """(stored transposed, the kernel's result dtype). A 2-byte result goes straight into y's
  [M, N] order: over one K slice as y itself; with `per_slice` (the warp-specialized form)
  also over several, as [splits, M, N] partials each rounded to the result's type, then
  summed in float32 (one elementwise pass, where float32 partials needed a transposing one).
  Else float32 partials [splits, N, M] (Mosaic GPU has no transposed store for a float32
  tile), summed and transposed after.

  Why the 2-byte partials lose nothing that matters: each adds one rounding of its slice's
  sum, 2^-9 of it, while the e4m3 activations of this path already carry up to 2^-4 per
  element (fp8_gemm.quantize_activations). At Qwen3-8B's shapes in 256-row prefill chunks,
  five of a layer's six products take K slices, and their float32 transposes were about 5% of
  an FP8 prefill on an H100 (BENCHMARKS.md, "FP8 and MLA decode kernels under the
  profiler")."""
  two_bytes = jnp.dtype(out_dtype).itemsize == 2
  transposed = two_bytes and (splits == 1 or per_slice)
  return transposed, out_dtype if transposed else jnp.float32


def _combine(out, m: int, splits: int, out_dtype, per_slice: bool):
  """y [m, N] from a kernel's result in _result_form's form."""
  transposed, _ = _result_form(splits, out_dtype, per_slice)
  if not transposed:
    return jnp.sum(out, axis=0)[:, :m].T.astype(out_dtype)
  if out.ndim == 2:
    return out[:m]
  if splits == 1:
    return out[0, :m]
  return jnp.sum(out[:, :m].astype(jnp.float32), axis=0).astype(out_dtype)


def _slice_and_row(index, row_tiles: int):
  """(K slice, row tile) of a work index whose row tiles run fastest."""
  return lax.div(index, jnp.int32(row_tiles)), lax.rem(index, jnp.int32(row_tiles))


def _lanes(scale_smem):
  """[128] float32 over the rows' lanes, as a step's product [64, 128] takes them."""
  return plgpu.load(scale_smem.at[pl.ds(0, ROW_TILE)], layout=plgpu.Layout.WGMMA.reduce(0))


def _add_scaled_step(total, w_smem, x_smem, w_scale, x_scale_smem):
  """total + (w @ x^T for one 128-K step, in a fresh float32 accumulator) x the weight block's
  scale x each row's: w_smem [64 columns, 128] and x_smem [128 rows, 128] e4m3, the rows'
  scales over their lanes in SMEM ([128] float32). w_scale: the weight block's, loaded by the
  caller before this step's products (over the lanes as x's, or one scalar)."""
  def mma(acc):
    plgpu.wgmma(acc, w_smem, x_smem.T)
    return acc[...]

  part = pl.run_scoped(mma, plgpu.ACC((COLUMN_TILE, ROW_TILE)))
  scale_R = w_scale * _lanes(x_scale_smem)
  return total + part * lax.broadcast_in_dim(scale_R, part.shape, [1])


def choose_splits(items: int, k_steps: int, programs: int) -> int:
  """K slices (a power of two) for a product of few work items: doubled while the items do
  not fill the grid's programs and each slice keeps at least MIN_SLICE_STEPS steps. Each
  slice's float32 partials are summed outside, so no more than that."""
  splits = 1
  while (items * splits < programs and k_steps % (2 * splits) == 0
         and k_steps // (2 * splits) >= MIN_SLICE_STEPS):
    splits *= 2
  return splits


def _products(x8_MK, w8_NK, w_lanes_NbX, act_scale_KbM, out_dtype, tiling: PrefillTiling,
              splits: int):
  """The sum over K blocks of (x8 @ w8^T) * w scale * x row scale, in _result_form's form.

  x8_MK: e4m3, M a multiple of ROW_TILE; w_lanes_NbX: the weight's block scales repeated over
  ROW_TILE lanes (scale_lanes); act_scale_KbM: x's scale per 128-K group and row, rows last
  (one TMA block per step and row tile)."""
  m, k = x8_MK.shape
  n = w8_NK.shape[0]
  row_tiles, column_tiles = m // ROW_TILE, n // COLUMN_TILE
  slice_steps = k // BLOCK // splits
  tiles_per_scale_row = BLOCK // COLUMN_TILE
  stage_bytes = (COLUMN_TILE + ROW_TILE) * BLOCK + 2 * ROW_TILE * 4
  stages = decode_gemm._num_stages(
      decode_gemm.DecodeTiling(COLUMN_TILE, BLOCK, tiling.num_stages), stage_bytes)
  transposed, dtype = _result_form(splits, out_dtype)
  decode_gemm._check_aligned(((ROW_TILE, BLOCK), E4M3), ((COLUMN_TILE, BLOCK), E4M3),
                             ((ROW_TILE,), jnp.float32))

  def body(x_ref, w_ref, w_scale_ref, x_scale_ref, out_ref):
    # The pipeline's items are (column tile, (K slice, row tile)), row tiles fastest:
    # consecutive items, which run at the same time on neighbouring SMs, read the same weight
    # tile.
    def in_specs_for(item, delay_release):
      def row(i):
        return _slice_and_row(item(i)[1], row_tiles)[1]

      def step(i, s):
        return _slice_and_row(item(i)[1], row_tiles)[0] * slice_steps + s

      def spec(shape, index, transforms=()):
        return plgpu.BlockSpec(shape, index, transforms=transforms, delay_release=delay_release)

      return [
          spec((ROW_TILE, BLOCK), lambda i, s: (row(i), step(i, s)),
               smem_transforms(BLOCK, E4M3)),
          spec((COLUMN_TILE, BLOCK), lambda i, s: (item(i)[0], step(i, s)),
               smem_transforms(BLOCK, E4M3)),
          spec((None, ROW_TILE), lambda i, s: (item(i)[0] // tiles_per_scale_row, step(i, s))),
          spec((None, ROW_TILE), lambda i, s: (step(i, s), row(i))),
      ]

    def accumulate(column, slice_row, step, sums, smem_refs):
      x_smem, w_smem, w_scale_smem, x_scale_smem = smem_refs
      (total,) = sums
      return (_add_scaled_step(total, w_smem, x_smem, _lanes(w_scale_smem), x_scale_smem),)

    def epilogue(column, slice_row, sums, smem_refs, o_smem):
      (total,) = sums
      k_slice, row = _slice_and_row(slice_row, row_tiles)
      rows, columns = pl.ds(row * ROW_TILE, ROW_TILE), pl.ds(column * COLUMN_TILE, COLUMN_TILE)
      if transposed:
        decode_gemm._store_transposed(total, o_smem, out_ref.at[rows, columns])
        return
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      o_smem[...] = total
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, out_ref.at[k_slice, columns, rows])

    decode_gemm._slot_pipeline(
        num_slots=column_tiles, col_blocks=splits * row_tiles, k_steps=slice_steps,
        block_cols=COLUMN_TILE, tokens_pad=ROW_TILE, dtype=dtype, in_specs_for=in_specs_for,
        num_sums=1, stages=stages, epilogue=epilogue, operands_of=None, async_mma=False,
        accumulate=accumulate, programs=_programs(tiling),
        out_smem=None if transposed else plgpu.SMEM(
            (COLUMN_TILE, ROW_TILE), dtype, transforms=smem_transforms(ROW_TILE, dtype)),
    )(x_ref, w_ref, w_scale_ref, x_scale_ref)

  out_shape = (m, n) if transposed else (splits, n, m)
  return decode_gemm._kernel_call(body, out_shape, dtype, "fp8_prefill_gemm",
                                  _programs(tiling))(x8_MK, w8_NK, w_lanes_NbX, act_scale_KbM)


def choose_tile_splits(tiles: int, k_steps: int, num_sms: int) -> int:
  """K slices for the warp-specialized form (a power of two): doubled while the slices' tiles
  still fit one wave of programs, one per SM, and each slice keeps MIN_SLICE_STEPS steps."""
  splits = 1
  while (tiles * 2 * splits <= num_sms and k_steps % (2 * splits) == 0
         and k_steps // (2 * splits) >= MIN_SLICE_STEPS):
    splits *= 2
  return splits


def _products_warp_specialized(x8_MK, w8_NK, w_scale_NbKb, act_scale_KbM, out_dtype,
                               num_stages: int, splits: int):
  """As _products (the same results and output forms), on tiles of 128 output columns (a
  whole scale block's rows) x 128 rows over a K slice, a program each: two compute warpgroups
  take 64 columns each and share the tile of x, and a third issues the loads. Each loaded
  byte then feeds 1.5x the products of _products' items, which stay near 600 TFLOP/s on an
  H200, bound (by our reading, not a profile: BENCHMARKS.md) by their L2-to-SM traffic of
  about 7 TB/s there.

  w_scale_NbKb: the block scales as stored; a tile's 128 columns are one block row, so each
  step reads one scale as a scalar. Repeated over the rows' lanes first (as _products takes
  them), they cost about 2% of an FP8 prefill on an H100 (BENCHMARKS.md, "MLA prefill
  through cuDNN; …")."""
  m, k = x8_MK.shape
  n = w8_NK.shape[0]
  row_tiles, column_tiles = m // ROW_TILE, n // BLOCK
  slice_steps = k // BLOCK // splits
  slice_k = slice_steps * BLOCK
  wgmma_rows = COLUMN_TILE  # each compute warpgroup's half of a 128-column tile
  transposed, dtype = _result_form(splits, out_dtype, per_slice=True)

  def body(x_gmem, w_gmem, w_scale_gmem, x_scale_gmem, out_gmem, o_smem):
    wg = lax.axis_index("wg")

    def pipeline(step_body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          step_body, grid=(slice_steps,), memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((ROW_TILE, BLOCK), lambda s: (0, s),
                              transforms=smem_transforms(BLOCK, E4M3)),
              plgpu.BlockSpec((BLOCK, BLOCK), lambda s: (0, s),
                              transforms=smem_transforms(BLOCK, E4M3)),
              plgpu.BlockSpec((None, ROW_TILE), lambda s: (s, 0)),
          ],
          wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=num_stages,
          compute_context=compute_context)

    @plgpu.nd_loop((column_tiles * splits * row_tiles,), collective_axes="sm")
    def _tile_loop(loop_info):
      (tile,) = loop_info.index
      # Row tiles fastest, then K slices: the programs running at once share weight tiles.
      column, slice_row = lax.div(tile, jnp.int32(splits * row_tiles)), lax.rem(
          tile, jnp.int32(splits * row_tiles))
      k_slice, row = _slice_and_row(slice_row, row_tiles)
      rows, columns = pl.ds(row * ROW_TILE, ROW_TILE), pl.ds(column * BLOCK, BLOCK)
      my_columns = pl.ds(column * BLOCK + wg * wgmma_rows, wgmma_rows)

      def compute_context(run):
        zeros = plgpu.layout_cast(jnp.zeros((wgmma_rows, ROW_TILE), jnp.float32),
                                  plgpu.Layout.WGMMA)
        total = run(zeros)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if transposed:
          o_smem.at[wg].T[...] = total.astype(dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[k_slice, rows, my_columns])
        else:
          o_smem.at[wg][...] = total
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[k_slice, my_columns, rows])

      def step(indices, x_smem, w_smem, x_scale_smem, total):
        (s,) = indices
        w_scale = w_scale_gmem[column, k_slice * slice_steps + s]
        return _add_scaled_step(total, w_smem.at[pl.ds(wg * wgmma_rows, wgmma_rows)], x_smem,
                                w_scale, x_scale_smem)

      ks = pl.ds(k_slice * slice_k, slice_k)
      pipeline(step, compute_context)(
          x_gmem.at[rows, ks], w_gmem.at[columns, ks],
          x_scale_gmem.at[pl.ds(k_slice * slice_steps, slice_steps), rows])

    plgpu.wait_smem_to_gmem(0)

  o_shape = (2, ROW_TILE, wgmma_rows) if transposed else (2, wgmma_rows, ROW_TILE)
  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((splits, m, n) if transposed else (splits, n, m), dtype),
      grid=(platform.num_sms(),), grid_names=("sm",), num_threads=3, thread_name="wg",
      scratch_types=dict(o_smem=plgpu.SMEM(o_shape, dtype,
                                           transforms=smem_transforms(o_shape[-1], dtype))),
      interpret=platform.interpret_params(), kernel_name="fp8_prefill_gemm_ws",
  )(x8_MK, w8_NK, w_scale_NbKb.astype(jnp.float32), act_scale_KbM)


def _programs(tiling: PrefillTiling) -> int:
  return platform.num_sms() * tiling.programs_per_sm if platform.on_gpu() else 1


def uses_warp_specialized(dtype) -> bool:
  """The warp-specialized form for 2-byte results (a model's bf16 or float16), with K slices
  where its tiles are few: at Qwen3-8B's shapes on an H200 it was as fast as the items or
  faster at 256 and 1024 rows (BENCHMARKS.md, "FP8 prefill on the FP8 tensor cores"). The
  items for float32 results (a float32 model on the GPU), as first built and measured."""
  return jnp.dtype(dtype).itemsize == 2


@functools.partial(jax.jit, static_argnames=("tiling", "splits", "warp_specialized"))
def fp8_prefill_matmul(x_MK: jax.Array, w8_NK: jax.Array, scale_NbKb: jax.Array,
                       tiling: PrefillTiling = PrefillTiling(), splits: int | None = None,
                       warp_specialized: bool | None = None) -> jax.Array:
  """x @ (w8 * scale broadcast over its 128 x 128 blocks).T in x's dtype, x quantized per row
  and 128 columns to e4m3 first (fp8_gemm.quantize_activations' values, by the kernel of
  jspec.pallas_kernels.quantize_rows). Any number of rows; K and N in whole blocks.

  warp_specialized: the form of _products_warp_specialized (None: uses_warp_specialized's
  choice); else _products' with `tiling` and `splits` K slices (default: choose_splits)."""
  m, k, n = check_operands("fp8_prefill_matmul", x_MK, w8_NK, scale_NbKb)
  if not fits_kernel(k, n, (BLOCK, BLOCK)):
    raise ValueError(f"fp8_prefill_matmul takes K and N in multiples of {BLOCK}, got K={k}, "
                     f"N={n}")
  pad = -m % ROW_TILE
  # Padded rows are zeros: their products are zeros, sliced off below.
  x8_MK, act_scale_1KbM = quantize_rows.quantize_rows(x_MK, m + pad)
  act_scale_KbM = act_scale_1KbM[0]
  if warp_specialized is None:
    warp_specialized = uses_warp_specialized(x_MK.dtype)
  row_tiles = (m + pad) // ROW_TILE
  if splits is None and warp_specialized:
    splits = choose_tile_splits(row_tiles * (n // BLOCK), k // BLOCK, platform.num_sms())
  elif splits is None:
    splits = choose_splits(row_tiles * (n // COLUMN_TILE), k // BLOCK, _programs(tiling))
  if k // BLOCK % splits:
    raise ValueError(f"K={k} does not split into {splits} slices of whole {BLOCK}-blocks")
  if warp_specialized:
    out = _products_warp_specialized(x8_MK, w8_NK, scale_NbKb, act_scale_KbM, x_MK.dtype,
                                     num_stages=WARP_SPECIALIZED_STAGES, splits=splits)
  else:
    out = _products(x8_MK, w8_NK, scale_lanes(scale_NbKb, ROW_TILE), act_scale_KbM, x_MK.dtype,
                    tiling=tiling, splits=splits)
  return _combine(out, m, splits, x_MK.dtype, per_slice=warp_specialized)
