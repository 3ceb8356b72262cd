"""Building blocks shared by every model family: RoPE and attention over a KV cache (the MLP is
jspec.models.mlp's).
Their parameters come from jspec.models.params, their projections (FP8 or not) from
jspec.models.linear, their norms from jspec.models.norms.

Shape letters: B batch, T query tokens, S cache slots, D hidden, N query heads, K kv heads,
G query heads per kv head, H head dim, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.models import quantization
from jspec.models import rope as rope_lib
from jspec.models.rope import rope
from jspec.models.caches import KVCache, write_slots
from jspec.models.decode_attention import MAX_ROWS_PER_KV_HEAD, grouped_attention
from jspec.models.linear import (QKV_NAMES, as_values, fp8_operands, fp8_rows_fit, linear,
                                 project_many_named, project_named, project_to_norm)
from jspec.models.norms import RMSNorm
from jspec.models.params import param
from jspec.models.row_kernels import takes_rows
from jspec.models.tree_attention import active_layout
from jspec.pallas_kernels import short_attention as short_kernel

# Whether a batch-1 tp step's row goes to o_proj's K-slice partials written twice by the
# attention kernel (Attention._doubles_row); off: doubled by k_slice_partials (timed both ways).
DOUBLED_ROW = True
# Whether the q / k / v kernel writes a step's keys and values into the cache itself, one kernel
# fewer a layer (Attention._writes_kv).
FUSED_KV_WRITE = True


def write_cache(cache_BKSH, new_BTKH, positions_BT):
  """Scatters the new keys (or values) into each sequence's slots at their absolute positions,
  all < S (the loop stops a sequence before its verify window could pass the cache bucket)."""
  return write_slots(cache_BKSH, new_BTKH, positions_BT, slot_axis=2)


class Attention(nnx.Module):
  """GQA with q/k RMSNorm over head_dim (Qwen3; optional where `cfg.use_qk_norm` is False),
  biases on the q/k/v projections where `cfg.attention_bias` (GLM-4.5, Qwen2) and on o_proj
  where `cfg.o_proj_bias` (Llama), scaled RoPE where `cfg.rope_scaling` (Llama-3's "llama3",
  YaRN), attending over a contiguous per-slot cache.

  Subclasses change the projections (`_project`) and the output gate; the cache handling and
  the attention itself (`_attend`) are shared by every family with a KV cache.
  """

  norm_cls = RMSNorm

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # With more tp shards than KV heads, k/v projections are replicated (every shard computes
    # the K heads, a few MB per layer) and their outputs repeated into the cache's K*R heads,
    # which are split over tp like the query heads: each shard then holds its own group's head.
    self.kv_replicas = cfg.kv_head_replicas
    kv_axis = "kv_heads" if self.kv_replicas == 1 else None
    self.fp8_block = cfg.fp8_block
    block = lambda name: quantization.block_for(cfg, "self_attn." + name)
    # Set by jspec.models.qkv_fusion.fuse_qkv once the weights are loaded: q, k and v then
    # live in one qkv_proj [D, K, G + 2, H] and q_proj, k_proj, v_proj are gone.
    self.fused_qkv = False
    self._init_query(cfg, dtype, rngs)
    self.k_proj, self.k_proj_scale = linear(rngs, (d, k, h), dtype,
                                            ("embed", kv_axis, "head_dim"), 1, block("k_proj"))
    self.v_proj, self.v_proj_scale = linear(rngs, (d, k, h), dtype,
                                            ("embed", kv_axis, "head_dim"), 1, block("v_proj"))
    self.o_proj, self.o_proj_scale = linear(rngs, (n, h, d), dtype,
                                            ("q_heads", "head_dim", "embed"), 2, block("o_proj"),
                                            scale=(n * h) ** -0.5)
    self.use_qk_norm = cfg.use_qk_norm
    if self.use_qk_norm:
      self.q_norm = self.norm_cls(h, cfg.rms_norm_eps, dtype, "head_dim")
      self.k_norm = self.norm_cls(h, cfg.rms_norm_eps, dtype, "head_dim")
    self.has_bias = cfg.attention_bias
    if self.has_bias:
      self.q_bias = param(rngs, (n, h), dtype, ("q_heads", "head_dim"), scale=0.1)
      self.k_bias = param(rngs, (k, h), dtype, (kv_axis, "head_dim"), scale=0.1)
      self.v_bias = param(rngs, (k, h), dtype, (kv_axis, "head_dim"), scale=0.1)
    self.has_o_bias = cfg.o_proj_bias
    if self.has_o_bias:
      self.o_bias = param(rngs, (d,), dtype, ("embed",), scale=0.1)
    self.rope_theta = cfg.rope_theta
    self.rotary_dim = cfg.rotary_dim
    # Scaled RoPE: frequencies fixed when the layer is built (constants of the program). Plain
    # RoPE keeps `rope` below, whose frequencies XLA computes.
    self.inv_freq, self.rope_attention_factor = None, 1.0
    if cfg.rope_scaling:
      inv_freq, self.rope_attention_factor = rope_lib.inv_frequencies(
          cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
      self.inv_freq = tuple(float(f) for f in inv_freq)
    self.num_kv_heads = cfg.cache_kv_heads
    # Optional kernel for decode/verify steps (jspec.models.decode_attention), set by the LLM:
    # (q [B,T,N,H], new k, v [B,T,K,H], cache k, v [B,K,S,H], first position [B]) -> [B,T,N,H],
    # for steps of at most MAX_ROWS_PER_KV_HEAD query rows per KV head. None: XLA's attention.
    self.window_attention = None
    # Optional kernel for the same steps over caches of at most short_attention.MAX_SLOTS
    # slots (jspec.models.decode_attention.sharded_short_attention), set by the LLM: (q, the
    # written cache k, v, first position [B]) -> [B,T,N,H]. None: as above.
    self.short_attention = None
    # Optional fused attention for steps of more than MAX_ROWS_PER_KV_HEAD query rows per KV
    # head, the prefill chunks (jspec.models.prefill_attention), set by the LLM: (q [B,T,N,H],
    # cache k, v [B,K,S,H] of the first kv_window slots, positions [B,T]) -> [B,T,N,H], or None.
    self.prefill_attention = None
    # Optional products for steps with few rows (jspec.models.projections), set by the LLM:
    # (x [B, T, K], w [K, N]) -> [B, T, N], the FP8 form with the block scale third. None: XLA's.
    # fp8_add_norm: o_proj's FP8 product with the residual add and norm after it, its K slices
    # summed in the norm's kernel (jspec.models.fp8_row_kernels.sharded_fp8_add_rms_norm).
    # fp8_e4m3_o: a step's attention kernel writes o_proj's input in e4m3 too.
    self.projection = None
    self.fp8_projection = self.fp8_add_norm = None
    self.fp8_e4m3_o = False
    # Each FP8 scale repeated over the kernel's lanes, by weight name, set in a program before
    # a loop of steps (jspec.models.projections.with_loop_constants).
    self.fp8_lanes = None
    # Optional kernels for the q / k norms and RoPE of steps with few rows, set by the LLM
    # (jspec.models.row_kernels): qk_kernel (q, k, positions, q and k norm scales or None) ->
    # (q, k), for steps of more than qk_kernel_above rows; qkv_kernel (x, qkv_proj, its
    # product's function, ...) the same on the fused product or its K slices' partials, v too
    # (fused layers without biases); fp8_qkv_kernel on one FP8 call's K-slice partials.
    self.qk_kernel = self.qkv_kernel = self.fp8_qkv_kernel = None
    self.qk_kernel_above = 0
    # Optional kernel writing a step's keys and values into the cache, set by the LLM
    # (jspec.models.row_kernels.sharded_kv_write): (keys, values, k, v, positions) -> (keys,
    # values), for steps of few rows. None: two XLA scatters.
    self.kv_write = None
    # Optional products for weights split over tp (jspec.sharding.tensor_parallel), set by
    # the LLM: q, k and v per shard, o_proj's partial sums reduced by one all-reduce; FP8
    # weights' through fp8_tp (jspec.models.fp8_tensor_parallel). None: XLA's partitioner.
    self.tp_products = self.fp8_tp = None
    self.head_dim = h

  def _dense(self, x, name: str, spec: str, in_axes: int = 1):
    return project_named(self, x, name, spec, in_axes, self.projection)

  def _dense_qkv(self, x_BTD, q_spec: str):
    """The q, k and v projections of x: one product where they are one matrix (qkv_fusion), one
    FP8 kernel call where they go to the kernel (linear.project_many_named), else three."""
    tp = self.tp_products
    if self.fused_qkv:
      qkv_BTKCH = self._fused_product(x_BTD)
      b, t, k, c, h = qkv_BTKCH.shape
      return (qkv_BTKCH[:, :, :, :c - 2].reshape(b, t, k * (c - 2), h),
              qkv_BTKCH[:, :, :, c - 2], qkv_BTKCH[:, :, :, c - 1])
    specs = (("q_proj", q_spec), ("k_proj", "btd,dkh->btkh"), ("v_proj", "btd,dkh->btkh"))
    if tp is not None and self.q_proj_scale is None:
      # Each shard its own heads; with KV heads fewer than the shards, k and v are whole on
      # every shard (kv_replicas) and keep XLA's product.
      q = tp.column(x_BTD, self.q_proj[...], split=1)
      if self.kv_replicas > 1:
        return (q, *(self._dense(x_BTD, name, spec) for name, spec in specs[1:]))
      return (q, tp.column(x_BTD, self.k_proj[...], split=1),
              tp.column(x_BTD, self.v_proj[...], split=1))
    # An FP8 call's K-slice sum goes into the fusions that read q, k and v (their norms, RoPE
    # and the cache writes): one kernel fewer a layer; with gate / up's, 0.982x Qwen3-8B's FP8
    # batch-1 step on an H100 (BENCHMARKS.md, "FP8 K-slice sums fused into their readers; …").
    sharded = self.kv_replicas == 1 and self.fp8_tp and self.fp8_tp.layer_column(
        self, x_BTD, QKV_NAMES, 0)  # FP8 over tp: each shard its heads' q, k and v, one call
    return sharded or project_many_named(self, x_BTD, specs, self.projection,
                                         fp8_sum_apart=False)

  def _fused_product(self, x_BTD):
    """The fused q / k / v product [B, T, K, G + 2, H]."""
    if self.tp_products is not None:  # each shard its own KV heads and their query heads
      return self.tp_products.column(x_BTD, self.qkv_proj[...], split=1)
    return self._dense(x_BTD, "qkv_proj", "btd,dkch->btkch")

  def _init_query(self, cfg, dtype, rngs):
    d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    self.q_proj, self.q_proj_scale = linear(rngs, (d, n, h), dtype,
                                            ("embed", "q_heads", "head_dim"), 1,
                                            quantization.block_for(cfg, "self_attn.q_proj"))

  def _project(self, x_BTD):
    """(queries [B,T,N,H], keys, values [B,T,K,H], output gate [B,T,N,H] or None)."""
    q_BTNH, k_BTKH, v_BTKH = self._dense_qkv(x_BTD, "btd,dnh->btnh")
    if self.has_bias:
      q_BTNH, k_BTKH, v_BTKH = (q_BTNH + self.q_bias[...], k_BTKH + self.k_bias[...],
                                v_BTKH + self.v_bias[...])
    return q_BTNH, k_BTKH, v_BTKH, None

  def __call__(self, x_BTD, positions_BT, cache: KVCache, kv_window: int,
               sum_later: bool = False):
    """Writes this call's keys/values at `positions_BT`, then attends causally.

    sum_later: the output may be o_proj's FP8 product before the sum of its K slices (a
    linear.SlicedFp8Product, where `fp8_add_norm` is set) or, at tp, of its shards (a
    PartialSum), for a caller whose residual add and RMSNorm read it next
    (RMSNorm.add_and_norm); else an array.

    A query at position p sees every slot j <= p: slots below the sequence's committed length
    were written by earlier calls, the rest by this call, so no separate length mask is needed
    and stale slots past p (rejected drafts, padding) are never read. Only the first
    `kv_window` slots are read (static): prefill from position 0 needs no more than its bucket.
    """
    q_BTNH, k_BTKH, v_BTKH, gate_BTNH = self._project_rotated(x_BTD, positions_BT, cache)
    if isinstance(k_BTKH, KVCache):  # k and v went into the cache with q (_writes_kv)
      cache, k_BTKH, v_BTKH = k_BTKH, None, None
    tokens = q_BTNH.shape[1]
    out_BTNH, cache = self._attend(q_BTNH, k_BTKH, v_BTKH, positions_BT, cache, kv_window,
                                   copies=2 if self._doubles_row(q_BTNH) else 1,
                                   quantize=gate_BTNH is None and self._quantizes_out(q_BTNH))
    if gate_BTNH is not None:
      out_BTNH = out_BTNH * jax.nn.sigmoid(gate_BTNH)
    fp8_row = self.fp8_tp and self.fp8_tp.layer_row(self, out_BTNH, "o_proj", 2, sum_later)
    if self.tp_products is not None and self.o_proj_scale is None:
      out_BTD = self.tp_products.row(out_BTNH, self.o_proj[...], in_axes=2, defer=True,
                                     tokens=tokens)
    elif fp8_row is not None:
      out_BTD = fp8_row
    elif sum_later:  # an FP8 product's K slices may be left to the norm after the residual add
      out_BTD = project_to_norm(self, out_BTNH, "o_proj", "btnh,nhd->btd", 2, self.projection)
    else:
      out_BTD = self._dense(out_BTNH, "o_proj", "btnh,nhd->btd", in_axes=2)
    if self.has_o_bias:
      out_BTD = out_BTD + self.o_bias[...]
    return out_BTD, cache

  def _doubles_row(self, q_BTNH) -> bool:
    """Whether a batch-1 step's one row goes to o_proj's tp product as the two equal rows its
    K-slice partials take, written twice by the short-context attention kernel instead of
    concatenated after it: one kernel fewer a layer (BENCHMARKS.md, "A batch-1 tp step's row
    written twice …"; on one GPU no faster). Since 2026-12-02 the product's own doubling is a
    broadcast, no kernel (skinny_gemm.twice): the copies are untimed against that at tp = 2."""
    b, t = q_BTNH.shape[:2]
    return (DOUBLED_ROW and b * t == 1 and self.short_attention is not None
            and self.tp_products is not None and self.o_proj_scale is None
            and not self.has_o_bias
            and self.tp_products.takes_doubled_row(self.o_proj.shape[0] * self.o_proj.shape[1]))

  def _quantizes_out(self, q_BTNH) -> bool:
    """Whether a step's short-context attention also writes its output in e4m3 for o_proj's
    FP8 kernel (linear.E4m3Rows; `fp8_e4m3_o`, set by the LLM): 128-wide heads, o_proj FP8 and
    taking the step's rows (at most fp8_gemm.MAX_ROWS: decode, verify windows, short prompt
    chunks)."""
    return (self.fp8_e4m3_o and self.head_dim == 128 and self.o_proj_scale is not None
            and fp8_rows_fit(self, q_BTNH, ("o_proj",), 2))

  def _writes_kv(self, x_BTD) -> bool:
    """Whether the q / k / v kernel writes the step's keys and values into the cache: where the
    KV write kernel would and nothing reads them apart (trees, window kernels, KV replicas)."""
    return (FUSED_KV_WRITE and self.kv_write is not None and self.kv_replicas == 1
            and self.window_attention is None and active_layout(x_BTD.shape[1]) is None)

  def _project_rotated(self, x_BTD, positions_BT, cache: KVCache | None = None):
    """(q, k normed and rotated, v, gate): one kernel where `qkv_kernel` (or `fp8_qkv_kernel`)
    takes the step; given the `cache` where _writes_kv, (q, the cache written, None, None);
    x may be e4m3 rows (decoder.takes_e4m3), which only fp8_qkv_kernel reads."""
    e4m3_BTD, x_BTD = x_BTD, as_values(x_BTD)
    kernel = None
    if self.qkv_kernel is not None and takes_rows(x_BTD, ndim=3):
      kernel = functools.partial(self.qkv_kernel, x_BTD, self.qkv_proj[...],
                                 self._fused_product, positions_BT, *self._norm_scales())
    elif self.fp8_qkv_kernel is not None and fp8_rows_fit(self, x_BTD, QKV_NAMES):
      kernel = functools.partial(
          self.fp8_qkv_kernel, e4m3_BTD, *fp8_operands(self, QKV_NAMES, x_BTD.shape[-1]),
          positions_BT, *self._norm_scales(), q_heads=self.q_proj.shape[0],
          kv_heads=self.k_proj.shape[0])
    if kernel is not None:
      written = cache is not None and self._writes_kv(x_BTD)
      q_BTNH, *kv = kernel(caches=(cache.keys, cache.values) if written else None)
      return (q_BTNH, KVCache(*kv), None, None) if written else (q_BTNH, *kv, None)
    q_BTNH, k_BTKH, v_BTKH, gate_BTNH = self._project(x_BTD)
    return (*self._norm_and_rope(q_BTNH, k_BTKH, positions_BT), v_BTKH, gate_BTNH)

  def _norm_scales(self):
    return (self.q_norm.scale[...], self.k_norm.scale[...]) if self.use_qk_norm else (None,) * 2

  def _norm_and_rope(self, q_BTNH, k_BTKH, positions_BT):
    """q and k normed over head_dim (where the family does) and rotated: one kernel where
    `qk_kernel` is set and takes the step's rows, else XLA's fusions."""
    if self.qk_kernel is not None and takes_rows(q_BTNH, ndim=4, above=self.qk_kernel_above):
      return self.qk_kernel(q_BTNH, k_BTKH, positions_BT, *self._norm_scales())
    if self.use_qk_norm:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    return self._rope(q_BTNH, positions_BT), self._rope(k_BTKH, positions_BT)

  def takes_qk_kernel(self) -> bool:
    """Whether this layer's norms and RoPE are the kernel's: plain RMSNorms (or none) and
    plain RoPE over whole heads of a width it takes."""
    from jspec.pallas_kernels.row_norms import fits_heads
    return (self.inv_freq is None and self.rotary_dim in (None, self.head_dim)
            and self.norm_cls is RMSNorm and fits_heads(self.head_dim))

  def _rope(self, x_BTNH, positions_BT):
    if self.inv_freq is None:
      return rope(x_BTNH, positions_BT, self.rope_theta, self.rotary_dim)
    dim = self.rotary_dim
    rotated = rope_lib.apply_rope(x_BTNH[..., :dim], positions_BT,
                                  jnp.asarray(self.inv_freq, jnp.float32),
                                  self.rope_attention_factor)
    if dim == x_BTNH.shape[-1]:
      return rotated
    return jnp.concatenate([rotated, x_BTNH[..., dim:]], axis=-1)

  def _attend(self, q_BTNH, k_BTKH, v_BTKH, positions_BT, cache: KVCache, kv_window: int,
              copies: int = 1, quantize: bool = False):
    """(the attention output, the cache with the step's keys and values): [B, T, N, H], or
    [B, copies x T, N, H] where the short-context kernel takes the step (`copies` of its
    output one after another; `quantize`: its linear.E4m3Rows)."""
    if self.kv_replicas > 1:  # copy r of head j at r*j .. r*j+r-1: query group order is kept
      k_BTKH = jnp.repeat(k_BTKH, self.kv_replicas, axis=2)
      v_BTKH = jnp.repeat(v_BTKH, self.kv_replicas, axis=2)
    tree = active_layout(q_BTNH.shape[1])
    if tree is not None:  # a token tree's window: its slots, XLA's masked attention (the
      # short-context kernel with the tree's mask made a 7-node tree's step 1.02x slower)
      cache = self._write_kv(cache, k_BTKH, v_BTKH, tree.slots(positions_BT))
      return grouped_attention(self.num_kv_heads, q_BTNH, cache.keys, cache.values,
                               tree.visible_BTS(positions_BT, kv_window), kv_window), cache
    cache = self._write_kv(cache, k_BTKH, v_BTKH, positions_BT)
    cache_k, cache_v = cache.keys, cache.values
    b, t, n, h = q_BTNH.shape
    group = n // self.num_kv_heads
    if self.window_attention is not None and group * t <= MAX_ROWS_PER_KV_HEAD:
      # Reads only the slots below the step's first position, plus the step's own tokens
      # (positions within a step are consecutive).
      out_BTNH = self.window_attention(q_BTNH, k_BTKH, v_BTKH, cache_k, cache_v,
                                       positions_BT[:, 0])
      return out_BTNH, cache
    if (self.short_attention is not None and kv_window <= short_kernel.MAX_SLOTS
        and short_kernel.fits_kernel(cache_k.shape[2], h, group * t)):
      # The whole cache goes in (a slice would be copied); the kernel reads only the slots
      # below each row's position, all below kv_window.
      return self.short_attention(q_BTNH, cache_k, cache_v, positions_BT[:, 0], copies=copies,
                                  quantize=quantize), cache
    keys_BKSH = cache_k[:, :, :kv_window]
    values_BKSH = cache_v[:, :, :kv_window]
    if self.prefill_attention is not None and group * t > MAX_ROWS_PER_KV_HEAD:
      return self.prefill_attention(q_BTNH, keys_BKSH, values_BKSH, positions_BT), cache
    visible_BTS = jnp.arange(kv_window)[None, None, :] <= positions_BT[:, :, None]
    out_BTNH = grouped_attention(self.num_kv_heads, q_BTNH, cache_k, cache_v, visible_BTS,
                                 kv_window)
    return out_BTNH, cache

  def _write_kv(self, cache: KVCache, k_BTKH, v_BTKH, slots_BT) -> KVCache:
    """The cache with the step's keys and values at `slots_BT` [B, T] (None: written with q,
    _writes_kv)."""
    if k_BTKH is None:
      return cache
    if self.kv_write is not None and takes_rows(k_BTKH, ndim=4):
      return KVCache(*self.kv_write(cache.keys, cache.values, k_BTKH, v_BTKH, slots_BT))
    return KVCache(write_cache(cache.keys, k_BTKH, slots_BT),
                   write_cache(cache.values, v_BTKH, slots_BT))

