"""A decode step's q / k norms, RoPE, KV write and short-context attention in one Pallas
(Triton) kernel, read from the q / k / v product's K-slice partials.

Why: a decode step ran these as two kernels a layer, row_norms.qkv_partials_norm_rope (sum the
partials, norm and rotate q and k, write k and v into the cache) and then
short_attention's, which reads q back. The first is a few thousand values whose kernel costs
2.1-2.6 µs a layer on an H200 however little it does (BENCHMARKS.md, "The step timer's slope
…" and "The K-slice partials capped …": 2.1 µs a Qwen3-30B-A3B layer, 2.6 a Qwen3-8B FP8
one), where the attention's programs each need only their own KV head's G query heads.

How: program (b, KV head[, split]) sums its G query heads' partials and norms and rotates
them as the row kernel does, each column from its own value and its rotate-half partner's (read twice, swapped: no
concatenate of halves, which Triton lacks). It computes the step's key and value too; the
program whose blocks hold the step's slot writes them into the cache, and each uses them in
place of that slot's stale row as it reads its blocks (short_attention.attend_and_store's
`new_kv`), so no program waits on another's store. The attention and its outputs are short_attention's, split over programs
and merged (mla_merge) as it chooses.

One token a sequence (a decode step); verify windows and tp's doubled rows keep the two
kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import fp8_gemm, mla_merge, platform, row_norms
from jspec.pallas_kernels import short_attention as short
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3
from jspec.pallas_kernels.fp8_gemm import act_lanes_size


def _kernel(start_ref, freq_ref, parts_ref, *refs, q_heads: int, kv_heads: int, group: int,
            fused_layout: bool, normed: bool, row_scaled: bool, eps: float, dtype,
            block_rows: int, **attend):
  """parts_ref [S, heads, H, R]: the partials with their heads apart (the fused layout's K
  groups of G query heads, key, value; else q's N heads, k's K, v's K)."""
  refs = list(refs)
  b, kv = pl.program_id(0), pl.program_id(1)
  row_scale = refs.pop(0)[b] if row_scaled else None
  q_scale_ref, k_scale_ref = (refs.pop(0), refs.pop(0)) if normed else (None, None)
  keys_ref, values_ref, *out_refs = refs[2:]  # the caches' inputs are their outputs' buffers
  start = start_ref[b]  # the step's position: its RoPE angle and its cache slot
  if fused_layout:
    first_q, k_head = kv * (group + 2), kv * (group + 2) + group
    v_head = k_head + 1
  else:
    first_q, k_head, v_head = kv * group, q_heads + kv, q_heads + kv_heads + kv
  head_dim = parts_ref.shape[2]
  col = jnp.arange(head_dim)
  swapped = (col + head_dim // 2) % head_dim  # each column's partner in rotate-half
  read = functools.partial(_summed, parts_ref, b=b, row_scale=row_scale, dtype=dtype)
  rope = functools.partial(_norm_rope, position=start, freq_ref=freq_ref, eps=eps,
                           dtype=dtype)

  def query_rows():  # [block_rows, H]: the G query heads, normed and rotated; padding zeros
    row_ids = jnp.arange(block_rows)
    heads = jnp.where(row_ids < group, first_q + row_ids, first_q)[:, None]
    mask = jnp.broadcast_to((row_ids < group)[:, None], (block_rows, head_dim))
    return rope(read(heads, col[None, :], mask), read(heads, swapped[None, :], mask),
                q_scale_ref)

  def key_and_value():  # the step's, written into the cache by the program whose slot it is
    k_H = rope(read(k_head, col), read(k_head, swapped), k_scale_ref)
    v_H = read(v_head, col)
    block_slots = attend["block_slots"]
    first, last = short.program_blocks(start, block_slots, keys_ref.shape[2], attend["splits"])

    @pl.when((start >= first * block_slots) & (start < last * block_slots))
    def _():
      keys_ref[b, kv, start, :] = k_H
      values_ref[b, kv, start, :] = v_H
    return k_H, v_H

  short.attend_and_store(query_rows(), start, keys_ref, values_ref, out_refs, rows=group,
                         block_rows=block_rows, group=group, new_kv=key_and_value, **attend)


def _summed(parts_ref, heads, cols, mask=None, *, b, row_scale, dtype):
  """parts[:, heads, cols, b] (index arrays, or a head and its columns) summed over S in order,
  as XLA sums the slices' axis, times the row's scale where given, cast to dtype (as
  row_norms.qkv_partials_norm_rope reads them); masked entries zeros."""
  x = None
  for s in range(parts_ref.shape[0]):
    part = pltriton.load(parts_ref.at[s, heads, cols, b], mask=mask,
                         other=None if mask is None else 0.0)
    x = part if x is None else x + part
  if row_scale is not None:
    x = x * row_scale
  return x.astype(dtype)


def _norm_rope(x, partner, scale_ref, *, position, freq_ref, eps: float, dtype):
  """x [..., H] (heads) RMSNormed over H by scale_ref (none where None) and rotated by RoPE at
  `position`, rounded where row_norms' kernel rounds, in dtype. partner: x with its halves
  swapped (rotate-half's other operand), read as such: each column's result is then its own
  elementwise expression, with no concatenate of halves, which Triton lacks."""
  head_dim = x.shape[-1]
  half = head_dim // 2
  col = jnp.arange(head_dim)
  first = col < half
  swapped = (col + half) % head_dim
  if scale_ref is not None:  # RMSNorm over head_dim: float32, cast, scale in the param dtype
    a, p = x.astype(jnp.float32), partner.astype(jnp.float32)
    squares = a * a
    # the halves' sums apart, then added, as the row kernel sums them
    total = (jnp.sum(jnp.where(first, squares, 0.0), axis=-1)
             + jnp.sum(jnp.where(first, 0.0, squares), axis=-1))
    inv_rms = jnp.expand_dims(jax.lax.rsqrt(total / (2 * half) + eps), -1)
    scale, scale_p = (pltriton.load(scale_ref.at[c]).astype(jnp.float32) for c in (col, swapped))
    x = (scale * (a * inv_rms).astype(dtype).astype(jnp.float32)).astype(dtype)
    partner = (scale_p * (p * inv_rms).astype(dtype).astype(jnp.float32)).astype(dtype)
  angle = position.astype(jnp.float32) * pltriton.load(freq_ref.at[col % half])
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  a, p = x.astype(jnp.float32), partner.astype(jnp.float32)
  # rotate-half: [a, b] -> [a cos - b sin, b cos + a sin] (transformers' apply_rotary_pos_emb)
  return jnp.where(first, a * cos - p * sin, a * cos + p * sin).astype(dtype)


@functools.partial(jax.jit, static_argnames=(
    "q_heads", "kv_heads", "fused_layout", "dtype", "eps", "theta", "scale", "quantize",
    "splits", "block_slots", "interpret"))
def rope_attention(parts_SNR: jax.Array, start_B: jax.Array, keys_BKSH: jax.Array,
                   values_BKSH: jax.Array, row_scale_B: jax.Array | None = None,
                   q_scale_H: jax.Array | None = None, k_scale_H: jax.Array | None = None, *,
                   q_heads: int, kv_heads: int, dtype, eps: float = 1e-6, theta: float,
                   scale: float, fused_layout: bool = False, quantize: bool = False,
                   splits: int | None = None, block_slots: int | None = None,
                   interpret: bool | None = None):
  """A decode step (one token a sequence at start_B) from its q / k / v product's K-slice
  partials to its attention output: (out, keys, values).

  parts_SNR, row_scale_B, q_scale_H, k_scale_H, q_heads, kv_heads, dtype, eps, theta and
  fused_layout (row_norms' `group`) as row_norms.qkv_partials_norm_rope takes them, one row a
  sequence; the caches [B, K, S, H] in dtype, the step's keys and values written into them
  at start_B (a start outside the cache writes nothing), as that kernel writes them.
  out: short_attention's output [B, N, H] in dtype of the normed, rotated queries over slots
  0 .. start (scale, quantize, splits, block_slots as short_attention takes them; quantize:
  (out, its e4m3 rows [B, N x H], their lanes))."""
  num_splits, width, padded = parts_SNR.shape
  b, k, slots, head_dim = keys_BKSH.shape
  group = q_heads // kv_heads
  if (parts_SNR.dtype != jnp.float32 or width != head_dim * (q_heads + 2 * kv_heads)
      or num_splits & (num_splits - 1) or padded < b or group * kv_heads != q_heads
      or k != kv_heads or values_BKSH.shape != keys_BKSH.shape or start_B.shape != (b,)
      or keys_BKSH.dtype != dtype or values_BKSH.dtype != dtype
      or (row_scale_B is not None and row_scale_B.shape != (b,))):
    raise ValueError(
        f"rope_attention takes float32 partials [S (a power of two), (N + 2K) x H, R >= B], "
        f"starts [B], caches [B, K, S, H] in {jnp.dtype(dtype).name} and row scales [B] or "
        f"None, got {parts_SNR.shape} {parts_SNR.dtype}, {start_B.shape}, {keys_BKSH.shape} "
        f"{keys_BKSH.dtype}, {values_BKSH.shape} {values_BKSH.dtype}, "
        f"{None if row_scale_B is None else row_scale_B.shape} for N={q_heads}, K={kv_heads}")
  if (q_scale_H is None) != (k_scale_H is None):
    raise ValueError("rope_attention takes both norm scales or neither")
  if not (row_norms.fits_heads(head_dim) and short.fits_kernel(slots, head_dim, group)):
    raise ValueError(f"rope_attention takes heads whose halves are powers of two >= 16, "
                     f"caches of a multiple of {short.MIN_ROWS} slots and at most "
                     f"{short.MAX_ROWS} query heads a KV head, got H={head_dim}, S={slots}, "
                     f"G={group}")
  if quantize and (head_dim != BLOCK or b > fp8_gemm.MAX_ROWS):
    raise ValueError(f"rope_attention quantizes {BLOCK}-wide heads of up to "
                     f"{fp8_gemm.MAX_ROWS} sequences, got H={head_dim}, B={b}")
  if interpret is None:
    interpret = not platform.on_gpu()
  fitting = short.choose_block_slots(slots, head_dim, keys_BKSH.dtype.itemsize)
  if splits is None and block_slots is None:
    splits, block_slots = short.choose_splits(b, kv_heads, slots, platform.num_sms())
    block_slots = block_slots and min(block_slots, fitting)
  block_slots = block_slots or fitting
  splits = splits or 1
  if slots % block_slots or not 1 <= splits <= slots // block_slots:
    raise ValueError(f"block_slots {block_slots} must divide the cache's {slots} slots and "
                     f"splits ({splits}) be 1 to its blocks")
  normed = q_scale_H is not None
  kernel = functools.partial(
      _kernel, q_heads=q_heads, kv_heads=kv_heads, group=group, fused_layout=fused_layout,
      normed=normed, row_scaled=row_scale_B is not None, eps=eps, dtype=jnp.dtype(dtype),
      block_rows=max(short.MIN_ROWS, 1 << (group - 1).bit_length()), block_slots=block_slots,
      slots=slots, scale=scale, copies=1, splits=splits, out_token_major=False,
      interpret=interpret)
  inputs = (start_B.astype(jnp.int32), row_norms.inv_frequencies(head_dim, theta),
            parts_SNR.reshape(num_splits, -1, head_dim, padded))
  inputs += tuple(x.astype(jnp.float32) for x in (row_scale_B,) if x is not None)
  inputs += (q_scale_H, k_scale_H) if normed else ()
  caches = (jax.ShapeDtypeStruct(keys_BKSH.shape, dtype),) * 2
  if splits == 1:
    out_shape = (jax.ShapeDtypeStruct((b, q_heads, head_dim), dtype),)
    if quantize:
      lanes = act_lanes_size(b, q_heads * head_dim) // q_heads
      out_shape += (jax.ShapeDtypeStruct((b, q_heads, head_dim), E4M3),
                    jax.ShapeDtypeStruct((q_heads, lanes), jnp.float32))
  else:
    out_shape = (jax.ShapeDtypeStruct((b, splits, q_heads, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((b, splits, q_heads), jnp.float32))
  keys, values, *out = pl.pallas_call(
      kernel, out_shape=caches + out_shape, grid=(b, kv_heads, splits),
      compiler_params=pltriton.CompilerParams(num_warps=short.NUM_WARPS,
                                              num_stages=short.NUM_STAGES),
      input_output_aliases={len(inputs): 0, len(inputs) + 1: 1}, interpret=interpret,
      name="rope_attention" + ("_split" if splits > 1 else "_e4m3" if quantize else ""),
  )(*inputs, keys_BKSH, values_BKSH)
  if splits > 1:
    return mla_merge.merge_chunks(*out, dtype=dtype, interpret=interpret,
                                  quantize=quantize), keys, values
  if quantize:
    return (out[0], out[1].reshape(b, -1), out[2].reshape(-1)), keys, values
  return out[0], keys, values
