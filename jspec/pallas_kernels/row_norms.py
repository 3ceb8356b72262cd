"""The small row-wise steps around a layer's products, each in one Pallas (Triton) kernel.

Why: in a batch-1 decode step each of these is a few thousand elements, and XLA runs q / k
norms with RoPE as five kernels. A kernel on an H200 costs 1.1-2.3 µs however little it does,
so these small kernels were about 0.77 ms of Qwen3-8B's 4.80 ms step (BENCHMARKS.md, "FP8 and
MLA decode on an H200 against their targets; ..."). Here each group is one kernel (the residual
add and RMSNorm: jspec.pallas_kernels.residual_norm):

  qk_norm_rope   the q and k RMSNorms over head_dim (optional) and their rotary embedding;
  qkv_norm_rope  the same read from a fused q / k / v product, its v copied out beside them;
  qkv_partials_norm_rope  the same read from a q / k / v product's K-slice partials (an FP8
                 call's, or a fused bf16 product's), each value summed as it is read (so that
                 the sum is no kernel of its own).

They round where the modules of jspec.models.norms and jspec.models.layers round (normalising
in float32, the cast, the scale), so they stand in for them; only the order of the float32
sums differs. One program per row and head: the steps that call them have at most a few
hundred rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import platform


def _qk_kernel(pos_ref, freq_ref, *refs, eps: float, q_heads: int, kv_heads: int,
               normed: bool, group: int | None, partials: bool = False, row_scaled: bool = False,
               tokens: int | None = None):
  """Program (m, j): head j of row m, a query head for j < N, else key head j - N, else (the
  fused layout) value head j - N - K, copied as it is.

  group None: q [M, N, H] and k [M, K, H] apart. Else one array [M, K x (G + 2), H], a
  layer's fused q / k / v product (jspec.models.qkv_fusion): for each KV head its G query
  heads, its key, its value; the value heads go out as they are, so that no slice of the
  product runs as a kernel of its own.
  partials: one float32 array [S, (N + 2K) x H, R], the K-slice partials of a q / k / v
  product, rows last, its heads in the fused layout's order where `group` is given, else q's,
  k's, v's (fp8_gemm.fp8_partials_many); each value their sum over S (times the row's scale
  where row_scaled) cast to the outputs' type.
  tokens: the keys and values go into the KV caches [B, K, S, H] (aliased in and out) at row
  m's position, as jspec.pallas_kernels.kv_write writes them (rows m = b x tokens + t, a
  position outside the cache dropped), instead of out as arrays."""
  if partials:
    parts_ref, *refs = refs
    srcs = (parts_ref, parts_ref)
    row_scale_ref = refs.pop(0) if row_scaled else None
  else:
    srcs, refs = (refs[:2], refs[2:]) if group is None else ((refs[0], refs[0]), refs[1:])
  q_src, k_src = srcs
  q_scale_ref = k_scale_ref = None
  if normed:
    q_scale_ref, k_scale_ref, *refs = refs
  if tokens is not None:
    refs = refs[:-5] + refs[-3:]  # the caches' inputs are their outputs' buffers
  q_out_ref, k_out_ref, *v_out = refs
  m, j = pl.program_id(0), pl.program_id(1)
  position = pos_ref[m]  # the row's RoPE position, and its cache slot where `tokens`

  def store(ref, head, part, x):  # q's rows, and k's and v's where they go to no cache
    if tokens is None or ref is q_out_ref:
      ref[m, head, part] = x.astype(ref.dtype)
      return

    @pl.when((position >= 0) & (position < ref.shape[2]))
    def _():
      ref[m // tokens, head, position, part] = x.astype(ref.dtype)
  half = freq_ref.shape[0]
  angle = position.astype(jnp.float32) * freq_ref[pl.ds(0, half)]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  first, second = pl.ds(0, half), pl.ds(half, half)

  def read(src_ref, src_head, start, size):
    if not partials:
      return src_ref[m, src_head, pl.ds(start, size)]
    x = jnp.sum(src_ref[:, pl.ds(src_head * 2 * half + start, size), m], axis=0)
    if row_scaled:
      x = x * row_scale_ref[m]
    return x.astype(q_out_ref.dtype)

  def rotate(src_ref, src_head, scale_ref, dst_ref, head):
    x1, x2 = read(src_ref, src_head, 0, half), read(src_ref, src_head, half, half)
    dtype = x1.dtype
    if normed:  # RMSNorm over head_dim: float32, cast, scale in the parameter dtype
      a, b = x1.astype(jnp.float32), x2.astype(jnp.float32)
      inv_rms = jax.lax.rsqrt((jnp.sum(a * a) + jnp.sum(b * b)) / (2 * half) + eps)
      x1 = (scale_ref[first].astype(jnp.float32)
            * (a * inv_rms).astype(dtype).astype(jnp.float32)).astype(dtype)
      x2 = (scale_ref[second].astype(jnp.float32)
            * (b * inv_rms).astype(dtype).astype(jnp.float32)).astype(dtype)
    a, b = x1.astype(jnp.float32), x2.astype(jnp.float32)
    # rotate-half: [a, b] -> [a cos - b sin, b cos + a sin] (transformers' apply_rotary_pos_emb)
    store(dst_ref, head, first, a * cos - b * sin)
    store(dst_ref, head, second, b * cos + a * sin)

  # Each output head's head in its source: q's and k's arrays apart; the FP8 partials' q, k,
  # v heads one after another; the fused layout's groups of G query heads, key, value.
  if partials and group is None:
    q_head, k_head = (lambda n: n), (lambda i: q_heads + i)
    v_head = lambda i: q_heads + kv_heads + i
  elif group is None:
    q_head, k_head, v_head = (lambda n: n), (lambda i: i), None
  else:
    q_head = lambda n: (n // group) * (group + 2) + n % group
    k_head = lambda i: i * (group + 2) + group
    v_head = lambda i: k_head(i) + 1

  @pl.when(j < q_heads)
  def _():
    rotate(q_src, q_head(j), q_scale_ref, q_out_ref, j)

  @pl.when((j >= q_heads) & (j < q_heads + kv_heads))
  def _():
    rotate(k_src, k_head(j - q_heads), k_scale_ref, k_out_ref, j - q_heads)

  if v_out:
    @pl.when(j >= q_heads + kv_heads)
    def _():
      i = j - q_heads - kv_heads
      store(v_out[0], i, pl.ds(0, 2 * half), read(q_src, v_head(i), 0, 2 * half))


def inv_frequencies(head_dim: int, theta: float) -> jax.Array:
  """RoPE's frequencies [H/2] in float32, by jspec.models.rope.rope's expression."""
  return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def fits_heads(head_dim: int) -> bool:
  """Whether heads of this width fit qk_norm_rope: halves a power of two, at least 16."""
  half = head_dim // 2
  return head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0


def _qk_call(name: str, heads, out_shape, positions_M, scales, *, q_heads: int, kv_heads: int,
             group: int | None, head_dim: int, eps: float, theta: float, interpret,
             partials: bool = False, row_scaled: bool = False, caches=None):
  """The pallas_call of _qk_kernel over `heads` (its head inputs) after the checks both forms
  share: both norm scales or neither, heads the kernel takes. `caches`: (keys, values) [B, K,
  S, H] that the rows' keys and values go into (rows b x T + t), in place of out_shape's
  last two: (q, keys, values)."""
  if (scales[0] is None) != (scales[1] is None):
    raise ValueError(f"{name} takes both norm scales or neither")
  if not fits_heads(head_dim):
    raise ValueError(f"{name} needs head_dim / 2 a power of two >= 16, got {head_dim}")
  if interpret is None:
    interpret = not platform.on_gpu()
  normed = scales[0] is not None
  rows = positions_M.shape[0]
  tokens, aliases, cache_inputs = None, {}, ()
  if caches is not None:
    keys, values = caches
    b, k, _, h = keys.shape
    if (values.shape != keys.shape or (k, h) != (kv_heads, head_dim) or rows % b
        or len(out_shape) != 3):
      raise ValueError(f"{name} writes keys and values into caches [B, K, S, H] of its "
                       f"{kv_heads} KV heads of {head_dim} for rows B x T, got "
                       f"{keys.shape}, {values.shape} for {rows} rows")
    tokens, cache_inputs = rows // b, (keys, values)
    first = 2 + len(heads) + (2 if normed else 0)
    aliases = {first: 1, first + 1: 2}
    out_shape = (out_shape[0], jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                 jax.ShapeDtypeStruct(values.shape, values.dtype))
  kernel = functools.partial(_qk_kernel, eps=eps, q_heads=q_heads, kv_heads=kv_heads,
                             normed=normed, group=group, partials=partials,
                             row_scaled=row_scaled, tokens=tokens)
  return pl.pallas_call(
      kernel, out_shape=out_shape,
      grid=(rows, q_heads + kv_heads * (len(out_shape) - 1)),  # a program per output head
      compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
      input_output_aliases=aliases, interpret=interpret, name=name,
  )(positions_M.astype(jnp.int32), inv_frequencies(head_dim, theta), *heads,
    *(scales if normed else ()), *cache_inputs)


@functools.partial(jax.jit, static_argnames=("eps", "theta", "interpret"))
def qk_norm_rope(q_MNH: jax.Array, k_MKH: jax.Array, positions_M: jax.Array,
                 q_scale_H: jax.Array | None = None, k_scale_H: jax.Array | None = None, *,
                 eps: float = 1e-6, theta: float, interpret: bool | None = None):
  """Queries [M, N, H] and keys [M, K, H] of rows at `positions_M`, each head RMSNormed over H
  by its scale (none where the scales are None) and then rotated by plain RoPE over the whole
  head (jspec.models.rope.rope): (q, k) in their dtypes."""
  rows, q_heads, head_dim = q_MNH.shape
  if k_MKH.shape[0] != rows or k_MKH.shape[2] != head_dim or positions_M.shape != (rows,):
    raise ValueError(f"qk_norm_rope takes q [M, N, H], k [M, K, H] and positions [M], got "
                     f"{q_MNH.shape}, {k_MKH.shape}, {positions_M.shape}")
  return _qk_call("qk_norm_rope", (q_MNH, k_MKH),
                  (jax.ShapeDtypeStruct(q_MNH.shape, q_MNH.dtype),
                   jax.ShapeDtypeStruct(k_MKH.shape, k_MKH.dtype)),
                  positions_M, (q_scale_H, k_scale_H), q_heads=q_heads,
                  kv_heads=k_MKH.shape[1], group=None, head_dim=head_dim, eps=eps, theta=theta,
                  interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "theta", "interpret"))
def qkv_norm_rope(qkv_MKCH: jax.Array, positions_M: jax.Array,
                  q_scale_H: jax.Array | None = None, k_scale_H: jax.Array | None = None, *,
                  eps: float = 1e-6, theta: float, interpret: bool | None = None,
                  caches: tuple | None = None):
  """qk_norm_rope on a fused q / k / v product [M, K, G + 2, H] (for each KV head its G query
  heads, its key, its value: jspec.models.qkv_fusion): (q [M, K x G, H], k [M, K, H], v
  [M, K, H]), q and k normed and rotated, v as it is. One kernel where slicing q, k and v
  out of the product would take three more. `caches` (keys, values) [B, K, S, H]: k and v
  written into them at the rows' positions instead (rows b x T + t; kv_write's writes, in
  the same kernel): (q, keys, values)."""
  rows, kv_heads, width, head_dim = qkv_MKCH.shape
  group = width - 2
  if positions_M.shape != (rows,) or group < 1:
    raise ValueError(f"qkv_norm_rope takes qkv [M, K, G + 2, H] and positions [M], got "
                     f"{qkv_MKCH.shape}, {positions_M.shape}")
  q_heads = kv_heads * group
  row_heads = lambda n: jax.ShapeDtypeStruct((rows, n, head_dim), qkv_MKCH.dtype)
  return _qk_call("qkv_norm_rope", (qkv_MKCH.reshape(rows, kv_heads * width, head_dim),),
                  (row_heads(q_heads), row_heads(kv_heads), row_heads(kv_heads)),
                  positions_M, (q_scale_H, k_scale_H), q_heads=q_heads, kv_heads=kv_heads,
                  group=group, head_dim=head_dim, eps=eps, theta=theta, interpret=interpret,
                  caches=caches)


@functools.partial(jax.jit,
                   static_argnames=("q_heads", "kv_heads", "group", "dtype", "eps", "theta",
                                    "interpret"))
def qkv_partials_norm_rope(parts_SNR: jax.Array, positions_M: jax.Array,
                           row_scale_M: jax.Array | None = None,
                           q_scale_H: jax.Array | None = None,
                           k_scale_H: jax.Array | None = None, *, q_heads: int, kv_heads: int,
                           dtype, eps: float = 1e-6, theta: float, group: int | None = None,
                           interpret: bool | None = None, caches: tuple | None = None):
  """qk_norm_rope on the K-slice partials of one call for q, k and v ([S, (N + 2K) x H, R]
  float32, R >= M rows): q's N heads, k's K, v's K (fp8_gemm.fp8_partials_many), or with
  `group` G = N / K the fused layout's K groups of G query heads, key, value
  (jspec.models.qkv_fusion). Each value is the sum of its S partials times its row's scale
  (where given), cast to `dtype`, as one product gives q, k and v; then (q [M, N, H], k
  [M, K, H], v [M, K, H]) as qk_norm_rope gives q and k, v as it is. The sums are read where
  they are used: no kernel of their own, no pass of XLA's over q, k and v. `caches`: as
  qkv_norm_rope's."""
  splits, width, padded = parts_SNR.shape
  rows = positions_M.shape[0]
  head_dim = width // (q_heads + 2 * kv_heads)
  if (parts_SNR.dtype != jnp.float32 or head_dim * (q_heads + 2 * kv_heads) != width
      or padded < rows or splits & (splits - 1) or (group and group * kv_heads != q_heads)
      or (row_scale_M is not None and row_scale_M.shape != (rows,))):
    raise ValueError(f"qkv_partials_norm_rope takes float32 partials [S (a power of two), "
                     f"(N + 2K) x H, R >= M], positions [M] and row scales [M] or None, got "
                     f"{parts_SNR.shape} {parts_SNR.dtype}, {positions_M.shape}, "
                     f"{None if row_scale_M is None else row_scale_M.shape} for N={q_heads}, "
                     f"K={kv_heads}, G={group}")
  row_heads = lambda n: jax.ShapeDtypeStruct((rows, n, head_dim), dtype)
  heads = (parts_SNR,) + (() if row_scale_M is None else (row_scale_M.astype(jnp.float32),))
  return _qk_call("qkv_partials_norm_rope", heads,
                  (row_heads(q_heads), row_heads(kv_heads), row_heads(kv_heads)),
                  positions_M, (q_scale_H, k_scale_H), q_heads=q_heads, kv_heads=kv_heads,
                  group=group, head_dim=head_dim, eps=eps, theta=theta, interpret=interpret,
                  partials=True, row_scaled=row_scale_M is not None, caches=caches)
