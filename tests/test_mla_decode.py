"""MLA flash-decoding (jspec.pallas_kernels.mla_decode, interpreted on CPU) against a float32
NumPy reference: decode and verify windows (T = 1..5), ragged and odd lengths, lengths that end
mid-block, idle sequences, slots past the window holding garbage, one chunk or several merged;
the same for the wgmma form (jspec.pallas_kernels.mla_decode_wgmma), which also lowers here for
Hopper as the GPU compiles it, and greedy MTP tokens through it in a whole model. Then the MLA
layer through the kernel (alone and under shard_map on a dp x tp mesh) against its
XLA path, greedy MTP tokens through the kernel against vanilla decoding, and
attention_backend "auto"."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jspec
from jspec.bench.presets import PRESETS
from helpers import cached_llm, fixture_dir, greedy, reference
from jspec.config import MLAConfig, ModelConfig
from jspec.models import decode_attention
from jspec.models.caches import MLACache
from jspec.models.mla import MLAttention
from jspec.models.moe_backends import experts_reference
from jspec.pallas_kernels import mla_decode as kernel_lib
from jspec.pallas_kernels.mla_decode import (MLATiling, choose_splits, min_split_slots,
                                             mla_decode)
from jspec.sharding.rules import MeshConfig, ShardingRules


def _reference(q_BTNL, cache_BSL, positions_BT, latent_dim, scale):
  """Row (t, n) of sequence b: softmax over slots j <= positions[b, t] of q . row_j, times the
  rows' first C values; no visible slot -> zeros. float64."""
  b, t, n, _ = q_BTNL.shape
  out = np.zeros((b, t, n, latent_dim))
  for i, j in np.ndindex(b, t):
    visible = min(positions_BT[i, j] + 1, cache_BSL.shape[1])
    if visible <= 0:
      continue
    rows = cache_BSL[i, :visible].astype(np.float64)
    scores = q_BTNL[i, j].astype(np.float64) @ rows.T * scale
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out[i, j] = (p / p.sum(axis=-1, keepdims=True)) @ rows[:, :latent_dim]
  return out


# (batch, T, heads, C, R, slots, splits, block_slots): T = 1..5 (k = 0..4), one chunk and
# several (the merge), 16- and 32-slot blocks, row counts under a tile and over one.
CASES = [
    (1, 1, 4, 32, 16, 48, 1, 16),
    (2, 2, 8, 32, 16, 80, 2, 32),
    (3, 3, 4, 16, 16, 64, 3, 16),
    (2, 4, 8, 32, 8, 96, None, 32),
    (4, 5, 4, 32, 16, 80, 4, 16),
    (1, 5, 16, 16, 16, 112, 2, 32),   # 80 rows of one sequence: five row tiles of 16
    (2, 5, 16, 16, 16, 112, 2, 32),   # 80 rows a sequence in a batch: two row tiles of 64
]


@pytest.mark.parametrize("seed", range(len(CASES)))
def test_kernel_matches_the_float32_reference(seed):
  b, t, n, c, r, s, splits, block_slots = CASES[seed]
  rng = np.random.default_rng(seed)
  q = (rng.standard_normal((b, t, n, c + r)) * (c + r) ** -0.25).astype(np.float32)
  cache = rng.standard_normal((b, s, c + r)).astype(np.float32)
  # Last positions: odd, ending mid-block, at the cache's end, and one idle sequence (-1).
  last = rng.integers(t - 1, s, b)
  last[0] = s - 1 if seed % 2 else min(s - 1, t - 1 + 2 * block_slots + 5)
  if b > 2:
    last[1] = -1
  positions = np.where(last[:, None] < 0, -1, last[:, None] - t + 1 + np.arange(t))
  want = _reference(q, cache, positions, c, 0.37)
  # Slots past each window hold garbage (stale drafts, padding): they must not be read.
  past = np.arange(s)[None, :, None] > np.maximum(last, 0)[:, None, None]
  cache = np.where(past, 1e4, cache).astype(np.float32)
  tiling = MLATiling(block_slots=block_slots)
  got = mla_decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(positions, jnp.int32),
                   latent_dim=c, scale=0.37, splits=splits, tiling=tiling, interpret=True)
  assert got.shape == (b, t, n, c) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  if b > 2:
    assert np.all(np.asarray(got)[1] == 0)  # idle: zeros, not NaN


def test_kernel_returns_the_cache_dtype_with_float32_sums():
  """bfloat16 in and out; the sums in float32 keep the error at bfloat16's rounding."""
  rng = np.random.default_rng(7)
  q = (rng.standard_normal((2, 2, 4, 48)) * 48 ** -0.25).astype(np.float32)
  cache = rng.standard_normal((2, 300, 48)).astype(np.float32)
  positions = np.array([[297, 298], [150, 151]])
  as_bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)
  q16, cache16 = as_bf16(q), as_bf16(cache)
  want = _reference(np.asarray(q16, np.float32), np.asarray(cache16, np.float32), positions, 32,
                    0.2)
  for splits in (1, 3):
    got = mla_decode(q16, cache16, jnp.asarray(positions), latent_dim=32, scale=0.2,
                     splits=splits, interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("batch, row_tiles, slots, sms, min_slots, splits", [
    (1, 2, 8320, 132, 256, 32),   # batch 1 at 8k: one chunk per 256 slots, not more
    (1, 2, 32896, 132, 256, 66),  # at 32k the SMs bound it: 132 programs, one wave
    (1, 2, 8320, 132, 114, 66),   # 64-row tiles of DeepSeek-V3's rows: the SMs bound it
    (1, 1, 8320, 132, 29, 132),   # a tp = 8 shard's 16 rows: a chunk per SM
    (8, 2, 8320, 132, 256, 8),    # 128 programs; 9 chunks would start a second wave for 12
    (32, 2, 8320, 132, 256, 2),
    (32, 8, 32896, 132, 256, 1),  # verify windows at batch 32 fill the GPU without splitting
    (4, 1, 100, 132, 256, 1),     # a short cache: one chunk
    (1, 1, 100, 132, 29, 3),      # ... unless its chunks still outweigh their partials
])
def test_splits_fill_one_wave_of_programs(batch, row_tiles, slots, sms, min_slots, splits):
  assert choose_splits(batch, row_tiles, slots, sms, min_slots=min_slots) == splits
  assert choose_splits(batch, row_tiles, slots, sms, programs_per_sm=2,
                       min_slots=min_slots) >= splits


@pytest.mark.parametrize("rows, batch, block_rows, tile", [
    (16, 1, 0, 16), (16, 32, 0, 16),        # a decode step at 16 heads
    (64, 1, 0, 16), (64, 8, 0, 64),         # a verify window of 4 at 16 heads
    (32, 1, 0, 16), (32, 2, 0, 32),         # ... of 2
    (128, 1, 0, 16), (128, 4, 0, 64),       # 128 heads
    (8, 3, 0, 16),                          # fewer rows than Triton's smallest dot
    (128, 1, 32, 32), (128, 4, 32, 32), (20, 4, 64, 32),   # a tiling's bound is kept
])
def test_row_tiles_are_16_rows_for_one_sequence_and_up_to_64_for_more(rows, batch, block_rows,
                                                                        tile):
  assert kernel_lib.rows_block(rows, MLATiling(block_rows=block_rows), batch) == tile


@pytest.mark.parametrize("block, stages, row_bytes, slots, fitted", [
    (64, 3, 1152, 8320, 64),    # DeepSeek-V3's bf16 rows: the default tiling's 144 KiB
    (64, 3, 2304, 8320, 32),    # float32 rows: 64-slot blocks would stage 288 KiB
    (64, 2, 2304, 8320, 64),    # one block in flight
    (64, 3, 1152, 48, 32),      # a cache of 48 slots: no block past its end
    (64, 3, 1152, 20, 16),      # 16 at least
    (64, 5, 4608, 8320, 16),
])
def test_blocks_in_flight_fit_the_shared_memory(block, stages, row_bytes, slots, fitted):
  assert kernel_lib.fitting_block_slots(block, stages, row_bytes, slots) == fitted
  assert ((stages - 1) * fitted * row_bytes <= kernel_lib.STAGED_BYTES
          or fitted == kernel_lib.MIN_ROWS)


@pytest.mark.parametrize("tile_rows, latent_dim, row_bytes", [
    (16, 512, 1152), (64, 512, 1152), (128, 512, 1152), (16, 32, 80), (64, 256, 640)])
def test_a_chunk_is_no_shorter_than_its_partial_output_is_heavy(tile_rows, latent_dim,
                                                               row_bytes):
  """min_split_slots: the fewest latent rows that weigh at least a chunk's float32 output."""
  slots = min_split_slots(tile_rows, latent_dim, row_bytes)
  partial_bytes = tile_rows * latent_dim * 4
  assert slots * row_bytes >= partial_bytes > (slots - 1) * row_bytes


def test_the_compiled_kernel_refuses_latent_widths_triton_cannot_tile():
  assert kernel_lib.fits_kernel(512, 64) and not kernel_lib.fits_kernel(32, 8)
  q = jnp.zeros((1, 1, 2, 40))
  with pytest.raises(ValueError, match="C and R powers of two >= 16, got C=32, R=8"):
    mla_decode(q, jnp.zeros((1, 16, 40)), jnp.zeros((1, 1), jnp.int32), latent_dim=32,
               scale=1.0, interpret=False)


# ---- the wgmma form (jspec.pallas_kernels.mla_decode_wgmma), interpreted -----------------------

# (batch, T, heads, slots, splits): 64-row tiles (16 rows padded to one; 80 rows: two tiles),
# T = 1..5, one chunk and several, more chunks than a short sequence has blocks.
WGMMA_CASES = [
    (2, 1, 16, 192, 1),
    (3, 4, 16, 256, 2),
    (2, 5, 16, 320, 3),
    (1, 2, 64, 128, None),
    (3, 3, 8, 192, 4),
]


def _wgmma_inputs(b, t, n, c, r, s, seed, last_first):
  rng = np.random.default_rng(seed)
  q = (rng.standard_normal((b, t, n, c + r)) * (c + r) ** -0.25).astype(np.float32)
  cache = rng.standard_normal((b, s, c + r)).astype(np.float32)
  last = rng.integers(t - 1, s, b)
  last[0] = last_first
  if b > 2:
    last[-1] = -1
  positions = np.where(last[:, None] < 0, -1, last[:, None] - t + 1 + np.arange(t))
  return q, cache, positions, last


@pytest.mark.parametrize("seed", range(len(WGMMA_CASES)))
def test_wgmma_form_matches_the_float32_reference(seed):
  """C = 128, R = 64 (each half and the rope key one 64-column swizzle tile), float32 in the
  interpreter: the reference within float32 sums; lengths ending mid-block, at the cache's
  end and at one slot; an idle sequence gives zeros; slots past the window are never read."""
  b, t, n, s, splits = WGMMA_CASES[seed]
  c, r = 128, 64
  last_first = (s - 1, t - 1 + 64 + 7, t - 1)[seed % 3]
  q, cache, positions, last = _wgmma_inputs(b, t, n, c, r, s, seed, last_first)
  want = _reference(q, cache, positions, c, 0.11)
  past = np.arange(s)[None, :, None] > np.maximum(last, 0)[:, None, None]
  cache = np.where(past, 1e4, cache).astype(np.float32)
  got = mla_decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(positions, jnp.int32),
                   latent_dim=c, scale=0.11, splits=splits, form="wgmma")
  assert got.shape == (b, t, n, c) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  if b > 2:
    assert np.all(np.asarray(got)[-1] == 0)


def test_wgmma_form_in_bfloat16():
  """bfloat16 operands as on the GPU (P rounded to bfloat16 before its product, as FlashMLA
  does): the float32 reference of the rounded inputs within bfloat16's rounding."""
  q, cache, positions, _ = _wgmma_inputs(2, 4, 16, 128, 64, 256, 9, 200)
  q16, cache16 = jnp.asarray(q, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16)
  want = _reference(np.asarray(q16, np.float32), np.asarray(cache16, np.float32), positions,
                    128, 0.11)
  for splits in (1, 2):
    got = mla_decode(q16, cache16, jnp.asarray(positions, jnp.int32), latent_dim=128,
                     scale=0.11, splits=splits, form="wgmma")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype_parts", [True, False])
def test_wgmma_chunks_are_written_in_the_cache_dtype_or_float32(monkeypatch, cache_dtype_parts):
  """With several chunks the wgmma form writes their partial outputs in the cache's dtype
  (WGMMA_CACHE_DTYPE_PARTS, the default) or float32: either way the merged context is the
  float32 reference within bfloat16's rounding; a float32 cache keeps float32 chunks."""
  monkeypatch.setattr(kernel_lib, "WGMMA_CACHE_DTYPE_PARTS", cache_dtype_parts)
  # mla_decode is jitted and the setting is read when it traces: a scale of each setting's
  # own (a static argument) gives each its own trace.
  scale = 0.11 if cache_dtype_parts else 0.13
  written = []
  parts = kernel_lib.wgmma.latent_attention_parts
  monkeypatch.setattr(kernel_lib.wgmma, "latent_attention_parts",
                      lambda *a, **kw: written.append(kw["out_dtype"]) or parts(*a, **kw))
  q, cache, positions, _ = _wgmma_inputs(2, 2, 16, 128, 64, 256, 17, 230)
  q16, cache16 = jnp.asarray(q, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16)
  want = _reference(np.asarray(q16, np.float32), np.asarray(cache16, np.float32), positions,
                    128, scale)
  got = mla_decode(q16, cache16, jnp.asarray(positions, jnp.int32), latent_dim=128,
                   scale=scale, splits=3, form="wgmma")
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)
  mla_decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(positions, jnp.int32),
             latent_dim=128, scale=scale, splits=3, form="wgmma")
  assert written == [jnp.bfloat16 if cache_dtype_parts else jnp.float32, jnp.float32]


@pytest.mark.parametrize("heads, t, rows", [
    (128, 1, 128),   # a decode step at 128 heads: whole tiles
    (16, 1, 64),     # at 16 heads: the tile's 16 live rows written, the rest not
    (16, 5, 128),    # verify(5) at 16 heads: the second tile's 16 live rows
])
def test_wgmma_form_lowers_for_hopper(monkeypatch, heads, t, rows):
  """The kernel as the GPU compiles it (Mosaic GPU, sm_90a, DeepSeek-V3's C = 512, R = 64,
  its SMEM at Hopper's limit) lowers on a machine without one: no interpreter."""
  from jspec.pallas_kernels import mla_decode_wgmma as wgmma
  monkeypatch.setattr(wgmma.platform, "on_gpu", lambda: True)
  monkeypatch.setattr(wgmma.platform, "interpret_params", lambda: None)
  c, b, slots = 512, 2, 1024
  args = (jax.ShapeDtypeStruct((b, rows, c + 64), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, slots, c + 64), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, rows), jnp.int32),
          jax.ShapeDtypeStruct((b, t), jnp.int32))
  parts = jax.jit(functools.partial(wgmma.latent_attention_parts, latent_dim=c, scale=0.04,
                                    splits=2, out_dtype=jnp.float32, heads=heads,
                                    live_rows=t * heads))
  text = parts.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mla_flash_decode_wgmma" in text


def test_wgmma_parts_refuse_live_rows_outside_the_last_tile():
  from jspec.pallas_kernels import mla_decode_wgmma as wgmma
  q, cache = jnp.zeros((1, 128, 192)), jnp.zeros((1, 64, 192))
  with pytest.raises(ValueError, match="live_rows=40 must fall in the last of the 2 row"):
    wgmma.latent_attention_parts(q, cache, jnp.zeros((1, 128), jnp.int32),
                                 jnp.zeros((1, 1), jnp.int32), latent_dim=128, scale=0.1,
                                 splits=1, out_dtype=jnp.float32, heads=40, live_rows=40)


@pytest.mark.parametrize("rows, c, r, slots, dtype, batch, form", [
    (128, 512, 64, 8320, jnp.bfloat16, 1, "wgmma"),    # a decode step at 128 heads
    (64, 512, 64, 8320, jnp.bfloat16, 1, "triton"),    # verify(4) at 16 heads: 8k slots
    (64, 512, 64, 32896, jnp.bfloat16, 1, "wgmma"),    # ... 32k slots
    (64, 512, 64, 8320, jnp.bfloat16, 4, "wgmma"),     # ... batch 4 at 8k: 33k slots
    (80, 512, 64, 1024, jnp.bfloat16, 1, "wgmma"),     # verify(5) at 16 heads: two tiles
    (16, 512, 64, 8320, jnp.bfloat16, 32, "triton"),   # a decode step at 16 heads
    (32, 512, 64, 8320, jnp.bfloat16, 1, "triton"),    # verify(2) at 16 heads, batch 1
    (32, 512, 64, 8320, jnp.bfloat16, 4, "triton"),    # ... batch 4 at 8k: 33k slots
    (32, 512, 64, 8320, jnp.bfloat16, 8, "wgmma"),     # ... batch 8 at 8k: 66k slots
    (32, 512, 64, 32896, jnp.bfloat16, 8, "wgmma"),    # ... batch 8 at 32k: 263k slots
    (48, 512, 64, 8320, jnp.bfloat16, 16, "wgmma"),    # verify(3), 133k slots
    (128, 512, 64, 8320, jnp.float32, 1, "triton"),    # wgmma takes 16-bit operands
    (128, 32, 8, 8320, jnp.bfloat16, 1, "triton"),     # halves narrower than a swizzle tile
    (128, 512, 64, 8300, jnp.bfloat16, 1, "triton"),   # a partial last block
])
def test_forms_chosen_by_rows_shape_dtype_and_batch(rows, c, r, slots, dtype, batch, form):
  assert kernel_lib.choose_form(rows, c, r, slots, dtype, batch=batch) == form


@pytest.mark.parametrize("device, batch, slots, dtype, form", [
    ("NVIDIA H200", 32, 8320, jnp.bfloat16, "wgmma"),     # batch 32 at 8k: 266k slots
    ("NVIDIA H200", 8, 32896, jnp.bfloat16, "wgmma"),     # batch 8 at 32k: 263k slots
    ("NVIDIA H200", 8, 8320, jnp.bfloat16, "triton"),     # batch 8 at 8k: 67k slots
    ("NVIDIA H200", 32, 8320, jnp.float32, "triton"),     # wgmma takes 16-bit operands
    ("NVIDIA H100 80GB HBM3", 32, 8320, jnp.bfloat16, "triton"),
    ("NVIDIA H100 80GB HBM3", 32, 32896, jnp.bfloat16, "triton"),
])
def test_a_16_head_decode_step_takes_the_wgmma_form_on_an_h200_from_256k_slots(
    monkeypatch, device, batch, slots, dtype, form):
  monkeypatch.setattr(kernel_lib.platform, "device_kind", lambda: device)
  assert kernel_lib.choose_form(16, 512, 64, slots, dtype, batch=batch) == form


def test_wgmma_form_refuses_shapes_it_cannot_tile():
  q = jnp.zeros((1, 1, 64, 40))
  with pytest.raises(ValueError, match="C a multiple of 128.*got C=32, R=8, S=64"):
    mla_decode(q, jnp.zeros((1, 64, 40)), jnp.zeros((1, 1), jnp.int32), latent_dim=32,
               scale=1.0, form="wgmma")
  with pytest.raises(ValueError, match="form is 'triton', 'wgmma' or None, got 'flash'"):
    mla_decode(q, jnp.zeros((1, 64, 40)), jnp.zeros((1, 1), jnp.int32), latent_dim=32,
               scale=1.0, form="flash")


# ---- the MLA layer -----------------------------------------------------------------------------

def _config(heads=4):
  return ModelConfig(
      architecture="DeepseekV3ForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=64,
      num_layers=1, num_heads=heads, num_kv_heads=heads, head_dim=8, rms_norm_eps=1e-6,
      rope_theta=1000.0, tie_word_embeddings=False, max_position_embeddings=256,
      rope_interleave=True,
      mla=MLAConfig(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=16,
                    v_head_dim=10))


@nnx.jit(static_argnames=("kv_window",))
def _run(attn, x, positions, cache, kv_window):
  return attn(x, positions, cache, kv_window)


def _layer_inputs(cfg, batch, t, slots, seed):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(batch, t, cfg.hidden_size)), jnp.float32)
  starts = rng.integers(0, slots - t, batch)
  positions = jnp.asarray(starts[:, None] + np.arange(t), jnp.int32)
  width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
  cache = MLACache(jnp.asarray(rng.normal(size=(batch, slots, width)), jnp.float32))
  return x, positions, cache


@pytest.mark.parametrize("t", [1, 4])
def test_layer_through_the_kernel_equals_the_xla_path(t):
  """The absorbed form's output and the written cache, decode and a verify window."""
  cfg = _config()
  attn = MLAttention(cfg, jnp.float32, nnx.Rngs(3))
  x, positions, cache = _layer_inputs(cfg, 3, t, 64, t)
  want, want_cache = _run(attn, x, positions, cache, 64)
  attn.latent_kernel = functools.partial(mla_decode, latent_dim=cfg.mla.kv_lora_rank,
                                         scale=attn.scale, splits=2, interpret=True)
  got, got_cache = _run(attn, x, positions, cache, 64)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(np.asarray(got_cache.latent), np.asarray(want_cache.latent))
  assert float(jnp.max(jnp.abs(want))) > 0.1


def test_windows_past_the_row_limit_keep_the_xla_path():
  """`latent_kernel_max_rows` ("auto"'s limit): a decode step of 4 heads goes to the kernel, a
  verify window of 4 heads x 4 positions (16 rows, over a limit of 8) does not."""
  cfg = _config()
  attn = MLAttention(cfg, jnp.float32, nnx.Rngs(3))
  calls = []

  def kernel(q, cache, positions):
    calls.append(q.shape)
    return mla_decode(q, cache, positions, latent_dim=cfg.mla.kv_lora_rank, scale=attn.scale,
                      interpret=True)

  attn.latent_kernel, attn.latent_kernel_max_rows = kernel, 8
  for t in (1, 4):
    x, positions, cache = _layer_inputs(cfg, 2, t, 32, t)
    attn(x, positions, cache, 32)
  assert calls == [(2, 1, 4, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)]


def test_sharded_kernel_splits_sequences_over_dp_and_heads_over_tp():
  """Under shard_map on a dp=2 x tp=2 mesh (2 of 4 heads and 1 of 2 sequences per shard, the
  latent whole on each): the unsharded kernel's context."""
  cfg = _config()
  mesh = MeshConfig(dp=2, tp=2, num_devices=4).make_mesh()
  rules = ShardingRules()
  rng = np.random.default_rng(11)
  width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
  q = jnp.asarray(rng.normal(size=(2, 3, 4, width)) * width ** -0.25, jnp.float32)
  cache = jnp.asarray(rng.normal(size=(2, 40, width)), jnp.float32)
  positions = jnp.asarray([[20, 21, 22], [5, 6, 7]], jnp.int32)
  want = mla_decode(q, cache, positions, latent_dim=32, scale=0.3, interpret=True)
  kernel = decode_attention.sharded_mla_decode(mesh, rules, 32, 0.3, interpret=True)
  put = lambda a, axes: jax.device_put(a, rules.sharding(mesh, axes))
  got = jax.jit(kernel)(put(q, ("batch", "seq", "q_heads", "latent")),
                        put(cache, MLACache.AXES), put(positions, ("batch", "seq")))
  assert "tp" in str(got.sharding.spec)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


# ---- the model ---------------------------------------------------------------------------------

def test_greedy_mtp_tokens_through_the_kernel_equal_vanilla():
  """DeepSeek-V3 (two NextN layers, latent caches in the target and the head): decode, the
  k+1 verify windows, draft steps and extends all attend through the kernel; the tokens are
  transformers' greedy ones. The fixture's random head rarely drafts right, so the draft
  path is checked directly: each NextN layer's logits through the kernel are transformers'."""
  ref = reference("deepseek_v3")
  prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
  llm = jspec.LLM(model=fixture_dir("deepseek_v3"), dtype="float32", max_model_len=128,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                  attention_backend="pallas")
  assert llm.target.layers[0].attn.latent_kernel is not None
  outs = llm.generate(prompts, greedy(24, ignore_eos=True))
  assert [o.token_ids for o in outs] == [ref[f"gen_noeos_{i}"].tolist() for i in range(3)]
  seq = ref["seq_1"]
  hidden = jnp.asarray(ref["hidden_1"][:-1])[None]
  next_tokens = jnp.asarray(seq[1:], jnp.int32)[None]
  for index, key in ((0, "mtp"), (1, "mtp1")):
    layer = llm.mtp.layers[index]
    assert layer.decoder.attn.latent_kernel is not None
    cache = llm.mtp.init_caches(1, next_tokens.shape[1], jnp.float32)[index]
    logits = _mtp_logits(layer, llm.target, next_tokens, hidden, cache)
    np.testing.assert_allclose(np.asarray(logits)[0], ref[f"{key}_logits_1"], atol=1e-4, rtol=0)


def test_greedy_mtp_tokens_through_the_wgmma_form_equal_the_xla_paths(monkeypatch):
  """A DeepSeek-V3-style model of the wgmma form's latent width (C = 128, R = 64, 16 heads,
  random weights, float32), MTP k = 3: with attention_backend "auto" as on a Hopper GPU and
  every decode, verify and draft window through the wgmma form (interpreted), the logits and
  greedy tokens of XLA's path."""
  cfg = PRESETS["tiny-mla"].replace(num_heads=16, num_kv_heads=16,
            mla=dict(kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=16))

  def llm():
    return jspec.LLM.from_random(cfg, jspec.MTPSpec("deepseek_v3", 1, is_moe=True),
                                 dtype="float32", seed=4, max_model_len=64, max_num_seqs=2,
                                 moe_backend="reference", projection_backend="xla",
                                 speculative_config={"method": "mtp",
                                                     "num_speculative_tokens": 3})

  xla = llm()
  forms = []
  with monkeypatch.context() as patch:
    patch.setattr(kernel_lib.platform, "on_hopper", lambda: True)
    choose = kernel_lib.choose_form

    def wgmma_where_it_fits(rows, c, r, slots, dtype, *, batch):  # float32, every width
      form = choose(max(rows, 128), c, r, slots, jnp.bfloat16, batch=batch)
      forms.append((rows, form))
      return form

    patch.setattr(kernel_lib, "choose_form", wgmma_where_it_fits)
    kernels = llm()
    assert kernels.attention_backend == "pallas"
    assert kernels.target.layers[0].attn.latent_kernel_max_rows is None  # no row limit
    prompts = [[5, 17, 42, 8, 99, 3, 7, 21], [7, 7, 300, 12]]
    want, got = (m.compute_logits(prompts[:1])[0] for m in (xla, kernels))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    params = greedy(6, ignore_eos=True)
    tokens = [[o.token_ids for o in m.generate(prompts, params)] for m in (xla, kernels)]
  assert tokens[0] == tokens[1]
  # Decode steps (16 rows) and verify windows (4 x 16 rows) through the wgmma form.
  assert {(16, "wgmma"), (64, "wgmma")} <= set(forms)


@nnx.jit
def _mtp_logits(layer, target, next_tokens, hidden, cache):
  """The NextN layer over the window (12 tokens: the absorbed form, so the kernel)."""
  n = next_tokens.shape[1]
  normed, _, _ = layer(target, next_tokens, hidden, jnp.arange(n, dtype=jnp.int32)[None], cache,
                       n, experts_reference)
  return layer.logits(target, normed)


def test_auto_backend_is_xla_off_hopper_and_pallas_on_it(monkeypatch):
  assert decode_attention.resolve_attention_backend("auto") == "xla"  # the CPU here
  assert cached_llm("deepseek_v3").attention_backend == "xla"
  assert cached_llm("deepseek_v3").target.layers[0].attn.latent_kernel is None
  monkeypatch.setattr(kernel_lib.platform, "on_hopper", lambda: True)
  assert decode_attention.resolve_attention_backend("auto") == "pallas"
  assert decode_attention.resolve_attention_backend("xla") == "xla"


def test_unknown_attention_backend_is_refused_naming_the_choices():
  with pytest.raises(ValueError, match=r"attention_backend='flashmla' is not supported; "
                                       r"choose one of \('auto', 'xla', 'pallas'\)"):
    jspec.LLM(model=fixture_dir("deepseek_v3"), dtype="float32", attention_backend="flashmla")


# ---- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n", [128, 16])
@pytest.mark.parametrize("batch, t, context", [(1, 1, 8192), (1, 4, 8192), (4, 4, 8192),
                                               (2, 5, 32768), (3, 3, 8192)])
def test_compiled_kernel_on_gpu_matches_the_reference(batch, t, context, n):
  """Each form compiled at DeepSeek-V3's shapes (C = 512, R = 64, bf16; 128 heads, and the
  16 of a tp = 8 shard, whose windows leave a tile's rows partly padding): Triton, the default,
  and on Hopper wgmma (it compiles for Hopper only): the float32 reference within bfloat16's
  rounding, ragged positions, one idle sequence."""
  c, r = 512, 64
  rng = np.random.default_rng(context + t)
  slots = context + 128
  hopper = kernel_lib.platform.on_hopper()
  if n == 128 and hopper:
    assert kernel_lib.choose_form(t * n, c, r, slots, jnp.bfloat16, batch=batch) == "wgmma"
  q = jnp.asarray(rng.standard_normal((batch, t, n, c + r)) * (c + r) ** -0.25, jnp.bfloat16)
  cache = jnp.asarray(rng.standard_normal((batch, slots, c + r)), jnp.bfloat16)
  last = np.array([context - 1, 37, context // 2 + 5, -1])[:batch]
  positions = np.where(last[:, None] < 0, -1, last[:, None] - t + 1 + np.arange(t))
  scale = (192 ** -0.5)
  want = _reference(np.asarray(q, np.float32), np.asarray(cache, np.float32), positions, c,
                    scale)
  for form in ("triton", None) + (("wgmma",) if hopper else ()):
    for splits in (None, 1, 7):
      got = mla_decode(q, cache, jnp.asarray(positions, jnp.int32), latent_dim=c, scale=scale,
                       splits=splits, form=form)
      np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2,
                                 err_msg=f"form={form} splits={splits}")


@pytest.mark.gpu
def test_layer_on_gpu_through_the_kernel_matches_the_xla_path():
  """An MLA layer of DeepSeek-V3's latent width (C = 512, R = 64) and 16 heads in bfloat16,
  a verify window of 4 over 2000 slots: the kernel (compiled) and XLA's path agree within
  bfloat16's rounding; layers narrower than Triton's tiles keep XLA's path on a GPU."""
  cfg = _config(heads=16).replace(hidden_size=256,
                            mla=dict(kv_lora_rank=512, qk_rope_head_dim=64))
  attn = MLAttention(cfg, jnp.bfloat16, nnx.Rngs(5))
  x, positions, cache = _layer_inputs(cfg, 2, 4, 2000, 5)
  x, cache = x.astype(jnp.bfloat16), MLACache(cache.latent.astype(jnp.bfloat16))
  want, _ = _run(attn, x, positions, cache, 2000)
  attn.latent_kernel = functools.partial(mla_decode, latent_dim=512, scale=attn.scale)
  got, _ = _run(attn, x, positions, cache, 2000)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=3e-2, rtol=3e-2)
  llm = jspec.LLM(model=fixture_dir("deepseek_v3"), dtype="float32", max_model_len=128,
                  attention_backend="pallas")
  assert llm.target.layers[0].attn.latent_kernel is None  # C = 32, R = 8: XLA's path


def test_benchmark_smoke_run_checks_and_times_every_path(tmp_path):
  """benchmarks/mla_decode.py --smoke: both kernel forms checked against float32 and XLA's
  path, all three timed, the JSON written (the GPU run is the same script at DeepSeek-V3's
  shapes)."""
  import importlib.util
  import json
  import os
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "mla_decode.py")
  spec = importlib.util.spec_from_file_location("mla_decode_benchmark", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = tmp_path / "mla.json"
  assert bench.main(["--smoke", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["check"]["ok"]
  assert set(result["check"]["wgmma_max_error_by_splits"]) == {"None", "1", "3"}
  assert [(r["batch"], r["width"]) for r in result["rows"]] == [(2, 1), (2, 4)]
  for row in result["rows"]:
    assert row["xla"]["us"] > 0 and row["kernel"]["us"] > 0 and row["wgmma"]["us"] > 0
