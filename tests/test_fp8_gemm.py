"""A few rows against a block-scaled FP8 weight (jspec.pallas_kernels.fp8_gemm): the kernel, in
interpret mode here, against float32 NumPy on the dequantized weight (e4m3 value x its block's
scale, the published checkpoints' meaning of `weight_scale_inv`), the weight [out, in] as
checkpoints store it."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jspec.pallas_kernels import fp8_gemm, fp8_layout, platform
from jspec.pallas_kernels.balanced_runs import BalancedRuns
from jspec.pallas_kernels.fp8_gemm import (BLOCK, Fp8Tiling, fits_kernel, fp8_matmul,
                                           quantize_activations)
from jspec.pallas_kernels.fp8_layout import choose_layout, choose_splits

RUN_SEED = 20261124

# (rows, K, N, K slices): one row, rows off the 16-row tile, several blocks per slice.
CASES = [(1, 256, 128, 2), (3, 384, 256, 3), (16, 256, 384, 1), (17, 512, 128, 4),
         (64, 256, 256, 2)]


def _dequantized(w8_NK, scale_NbKb):
  return (np.asarray(w8_NK).astype(np.float32)
          * np.repeat(np.repeat(scale_NbKb, BLOCK, axis=0), BLOCK, axis=1))


def _fp8_weight(rng, n, k):
  w8 = np.clip(rng.standard_normal((n, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  scale = rng.uniform(1e-4, 1e-2, (n // BLOCK, k // BLOCK)).astype(np.float32)
  return w8, scale


def _assert_within_output_rounding(y, want, x32, w32, roundings: int = 1):
  """|y - want| within `roundings` roundings of the bf16 output (2^-8 of |want| each: two where
  want is itself a rounded output, which may round the other way) plus float32 sums' error
  (1e-5 of sum |x| |w|), where a sum cancels. Also: every output written (interpret mode fills
  unwritten ones with NaN)."""
  bound = roundings * 2.0 ** -8 * np.abs(want) + 1e-5 * (np.abs(x32) @ np.abs(w32).T)
  assert y.shape == want.shape and np.isfinite(y).all() and (np.abs(y - want) <= bound).all()


@pytest.mark.parametrize("activations", ["bfloat16", "float16"])
@pytest.mark.parametrize("rows, k, n, splits", CASES)
def test_fp8_matmul_equals_the_dequantized_product(rows, k, n, splits, activations):
  rng = np.random.default_rng([RUN_SEED, rows, k, n])
  # Rows of very different magnitudes (float16's route scales each into its range on its own).
  magnitude = 10.0 ** rng.uniform(-3, 4, (rows, 1))
  x = jnp.asarray(rng.standard_normal((rows, k)) * magnitude, jnp.bfloat16)
  w8, scale = _fp8_weight(rng, n, k)
  y = np.asarray(fp8_matmul(x, jnp.asarray(w8), jnp.asarray(scale), splits=splits,
                            activations=activations), np.float32)
  x32, w32 = np.asarray(x, np.float32), _dequantized(w8, scale)
  # Both routes multiply exactly what x and w hold: e4m3 -> float16 (and on to bfloat16) is
  # exact, and bf16 x scaled by a power of two is exact in float16 (its 11 significant bits
  # hold bf16's 8). Products are summed in float32. The one rounding that matters is the bf16
  # output's (2^-9 relative), plus float32 sums' error.
  _assert_within_output_rounding(y, x32 @ w32.T, x32, w32)


def test_activation_routes_by_dtype_and_refusal():
  """bfloat16 x takes the bfloat16 route (nothing done to x before the kernel), float32 x the
  float16 route (its 11 bits, rows scaled to float16's range)."""
  rng = np.random.default_rng([RUN_SEED, 13])
  w8, scale = (jnp.asarray(a) for a in _fp8_weight(rng, 128, 256))
  x32 = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
  x16 = x32.astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(fp8_matmul(x16, w8, scale)),
                                np.asarray(fp8_matmul(x16, w8, scale, activations="bfloat16")))
  np.testing.assert_array_equal(np.asarray(fp8_matmul(x32, w8, scale)),
                                np.asarray(fp8_matmul(x32, w8, scale, activations="float16")))
  with pytest.raises(ValueError, match="activations must be one of"):
    fp8_matmul(x16, w8, scale, activations="int8")


def test_rows_past_float16_range_and_zero_rows():
  rng = np.random.default_rng([RUN_SEED, 1])
  x = np.zeros((3, 256), np.float32)
  x[0] = rng.standard_normal(256) * 1e6      # far past float16's 65504
  x[2] = rng.standard_normal(256) * 1e-6     # far under its normal range
  x = jnp.asarray(x, jnp.bfloat16)
  w8, scale = _fp8_weight(rng, 128, 256)
  y = np.asarray(fp8_matmul(x, jnp.asarray(w8), jnp.asarray(scale)), np.float32)
  exact = np.asarray(x, np.float32) @ _dequantized(w8, scale).T
  assert np.isfinite(y).all() and (y[1] == 0).all()
  np.testing.assert_allclose(y, exact, rtol=2.0 ** -7, atol=0)


def test_fp8_matmul_refuses_what_it_cannot_take():
  x = jnp.ones((2, 256), jnp.bfloat16)
  w8 = jnp.ones((128, 256), jnp.float8_e4m3fn)
  scale = jnp.ones((1, 2), jnp.float32)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    fp8_matmul(x, w8.astype(jnp.bfloat16), scale)
  with pytest.raises(ValueError, match="scales"):
    fp8_matmul(x, w8, jnp.ones((1, 1), jnp.float32))
  with pytest.raises(ValueError, match="M <= 64"):
    fp8_matmul(jnp.ones((65, 256), jnp.bfloat16), w8, scale)
  with pytest.raises(ValueError, match="slices"):
    fp8_matmul(x, w8, scale, splits=4)


def test_shapes_and_splits():
  assert fits_kernel(1, 4096, 12288, (128, 128))
  assert not fits_kernel(65, 4096, 12288, (128, 128))
  assert not fits_kernel(1, 4096, 12288, (64, 64))     # another block size: XLA's path
  assert not fits_kernel(1, 4000, 12288, (128, 128))
  # Qwen3-8B's down projection on an H200 (132 SMs): 32 column blocks, K = 96 blocks.
  splits = choose_splits(12288, 4096, 132)
  assert splits == 4 and splits * 32 <= 132 and 12288 % (splits * BLOCK) == 0
  # 192 column blocks: one round full, one 45% full; two slices give three rounds 97% full.
  assert choose_splits(4096, 24576, 132) == 2
  assert choose_splits(256, 128, 132) == 2      # no slice shorter than one block
  # 56 column blocks: 2 slices fill one round to 85%, as 4 and 8 do two and four rounds; 16
  # would take seven rounds.
  assert choose_splits(16384, 7168, 132) == 2


@pytest.mark.parametrize("tiling", [Fp8Tiling(num_stages=2), Fp8Tiling(blocks_per_step=1),
                                    Fp8Tiling(blocks_per_step=4)])
def test_fp8_matmul_tilings_agree(tiling):
  """The same block products and float32 sums in the same order, however they are staged."""
  rng = np.random.default_rng([RUN_SEED, 2])
  x = jnp.asarray(rng.standard_normal((5, 1024)), jnp.bfloat16)
  w8, scale = (jnp.asarray(a) for a in _fp8_weight(rng, 256, 1024))
  default = np.asarray(fp8_matmul(x, w8, scale, splits=2), np.float32)
  tiled = np.asarray(fp8_matmul(x, w8, scale, splits=2, tiling=tiling), np.float32)
  # Equal in interpret mode; on a GPU the compiler may contract another multiply-add into an
  # FMA: within one rounding of the bf16 output.
  np.testing.assert_allclose(tiled, default, rtol=2.0 ** -7, atol=0)


# (rows, K, the weights' N, K slices or None, programs of the persistent grid): q, k, v of a
# GQA layer (the first weight the widest), and weights whose items end mid-round, so that
# the next weight's pipeline starts on another program.
MANY_CASES = [(1, 256, (256, 128, 128), None, 3), (5, 384, (128, 384), 3, 4),
              (17, 256, (384, 128, 128), 2, 5), (40, 512, (128, 128, 128), 4, 3)]


@pytest.mark.parametrize("rows, k, ns, splits, programs", MANY_CASES)
def test_products_of_one_x_in_one_call(monkeypatch, rows, k, ns, splits, programs):
  """fp8_matmul_many: each weight's product in one kernel call, equal to the dequantized
  products and, at the same K slices, bit for bit to the separate calls (each item sums the
  same blocks in the same order, on whichever program)."""
  monkeypatch.setattr(platform, "num_sms", lambda: programs)  # the interpreter runs them all
  rng = np.random.default_rng([RUN_SEED, 11, rows, k, *ns])
  magnitude = 10.0 ** rng.uniform(-2, 3, (rows, 1))
  x = jnp.asarray(rng.standard_normal((rows, k)) * magnitude, jnp.bfloat16)
  weights = [_fp8_weight(rng, n, k) for n in ns]
  w8s = tuple(jnp.asarray(w) for w, _ in weights)
  scales = tuple(jnp.asarray(s) for _, s in weights)
  many = fp8_gemm.fp8_matmul_many.__wrapped__(x, w8s, scales, splits=splits)
  used_splits, balanced = (splits, False) if splits else choose_layout(k, sum(ns), programs, rows)
  x32 = np.asarray(x, np.float32)
  assert len(many) == len(ns)
  for y, (w8, scale), w8_j, scale_j in zip(many, weights, w8s, scales):
    y = np.asarray(y, np.float32)
    w32 = _dequantized(w8, scale)
    _assert_within_output_rounding(y, x32 @ w32.T, x32, w32)
    alone = np.asarray(fp8_matmul.__wrapped__(x, w8_j, scale_j, splits=used_splits), np.float32)
    if balanced:  # the joined call's runs cut the items elsewhere: other float32 sums
      _assert_within_output_rounding(y, alone, x32, w32, roundings=2)
    else:
      np.testing.assert_array_equal(y, alone)


@pytest.mark.parametrize("case", range(40))
def test_balanced_runs_take_every_step_once_and_number_each_items_partials(case):
  """BalancedRuns over random item counts, item lengths and programs (more programs than steps
  too: the last ones idle): the runs tile the steps in order, lengths within one of each
  other; the programs an
  item's steps fall in number its partials 0, 1, ... in program order, below `segments`, the
  least power of two that holds the longest such list."""
  rng = np.random.default_rng([RUN_SEED, 30, case])
  items, k_steps = int(rng.integers(1, 300)), int(rng.integers(1, 40))
  programs = int(rng.integers(1, 2 * items * k_steps + 2)) if case % 4 == 0 else int(
      rng.integers(1, 140))
  runs = BalancedRuns(items, k_steps, programs)
  total = items * k_steps
  lengths = np.asarray(runs.run_length(jnp.arange(programs, dtype=jnp.int32)))
  busy = min(programs, total)
  assert lengths.sum() == total and (lengths[busy:] == 0).all()
  assert lengths[:busy].min() >= 1 and lengths[:busy].max() - lengths[:busy].min() <= 1
  program_P, step_P = np.repeat(np.arange(programs), lengths), np.concatenate(
      [np.arange(n) for n in lengths])
  item, k_step = (np.asarray(a) for a in runs.item_and_step(jnp.asarray(program_P, jnp.int32),
                                                            jnp.asarray(step_P, jnp.int32)))
  np.testing.assert_array_equal(item * k_steps + k_step, np.arange(total))  # each once, in order
  segment = np.asarray(runs.segment(jnp.asarray(program_P, jnp.int32),
                                    jnp.asarray(step_P, jnp.int32)))
  longest = 0
  for i in range(items):
    holders = np.unique(program_P[item == i])  # in program order
    np.testing.assert_array_equal(np.unique(segment[item == i]), np.arange(len(holders)))
    for slot, holder in enumerate(holders):
      assert (segment[(item == i) & (program_P == holder)] == slot).all()
    longest = max(longest, len(holders))
  assert runs.segments >= longest and runs.segments < 2 * longest
  assert runs.segments & (runs.segments - 1) == 0


def test_balanced_runs_where_slices_leave_rounds_idle():
  """choose_layout: K slices where they keep 90% of their rounds busy, else balanced runs."""
  # DeepSeek-V3's dense gate / up on 132 SMs: 288 column blocks, no slice count fills 90%.
  assert choose_layout(7168, 36864, 132) == (1, True)
  assert choose_layout(2048, 5120, 132)[1]  # Qwen3-30B-A3B's q / k / v: 81% at 8 slices
  assert choose_layout(4096, 24576, 132) == (2, False)  # Qwen3-8B's gate / up: 97%
  assert choose_layout(12288, 4096, 132) == (4, False)


def test_partials_share_caps_the_k_slices_as_the_rows_grow(monkeypatch):
  """PARTIALS_SHARE: slice counts whose float32 partials (the kernel's padded rows, written and
  read once) pass that share of the weight's e4m3 bytes are not tried; unset, the rows change
  nothing."""
  monkeypatch.setattr(fp8_layout, "PARTIALS_SHARE", None)
  qkv = (4096, 6144, 132)  # Qwen3-8B's q / k / v on an H200: 8 slices fill 97% of 3 rounds
  # up to 8 rows the kernel writes 8 (wgmma's least N): one row's partials are 8 rows'
  assert fp8_layout.partials_share(4096, 8, 1) == fp8_layout.partials_share(4096, 8, 8) == 0.125
  assert fp8_layout.partials_share(4096, 8, 32) == 0.5
  for rows in (1, 8, 32, 64):
    assert fp8_layout.most_splits(4096, rows) is None
    assert choose_layout(*qkv, rows=rows) == (8, False)
  monkeypatch.setattr(fp8_layout, "PARTIALS_SHARE", 0.25)
  # decode's 8 padded rows uncapped: Qwen3-8B's q / k / v at tp = 4 keeps its 32 slices there
  assert [fp8_layout.most_splits(4096, r) for r in (1, 8, 9, 16, 32, 64)] == [None, None, 8, 8,
                                                                             4, 2]
  assert choose_layout(4096, 1536, 132, rows=8) == (32, False)
  assert choose_layout(4096, 1536, 132, rows=16)[1]
  assert choose_layout(*qkv, rows=16) == (8, False)
  assert choose_layout(*qkv, rows=32)[1]  # 4 slices fill 73%: balanced runs
  # gate / up (2 slices) and down (4 slices, K = 12288) stay within the share at 64 rows
  assert choose_layout(4096, 24576, 132, rows=64) == (2, False)
  assert choose_layout(12288, 4096, 132, rows=64) == (4, False)
  monkeypatch.setattr(fp8_layout, "PARTIALS_SHARE", 0.0)  # no slices at all: one, or balanced
  assert fp8_layout.most_splits(4096, 9) == 1
  assert choose_layout(12288, 4096, 132, rows=9) == (1, True)


def test_a_products_rows_reach_its_layout_and_the_capped_product_is_the_same(monkeypatch):
  """The call passes its rows to choose_layout: 17 rows (32 padded) of K = 1024 on 4 programs
  take 2 slices unset and balanced runs under a share of 0.3 (2 slices would write 0.5), and
  both products are the dequantized one within the bf16 output's rounding."""
  monkeypatch.setattr(platform, "num_sms", lambda: 4)
  layouts = []
  real_partials = fp8_gemm.partials

  def spy(x_RK, w8s_NK, scale_rows, act_scale_X, splits, tiling, balanced, rows_first):
    layouts.append((splits, balanced))
    return real_partials(x_RK, w8s_NK, scale_rows, act_scale_X, splits, tiling, balanced,
                         rows_first)

  monkeypatch.setattr(fp8_gemm, "partials", spy)
  rng = np.random.default_rng([RUN_SEED, 41])
  x = jnp.asarray(rng.standard_normal((17, 1024)), jnp.bfloat16)
  w8, scale = _fp8_weight(rng, 256, 1024)
  x32, w32 = np.asarray(x, np.float32), _dequantized(w8, scale)
  for share in (None, 0.3):
    monkeypatch.setattr(fp8_layout, "PARTIALS_SHARE", share)
    y = np.asarray(fp8_matmul.__wrapped__(x, jnp.asarray(w8), jnp.asarray(scale)), np.float32)
    _assert_within_output_rounding(y, x32 @ w32.T, x32, w32)
  assert layouts == [(2, False), (1, True)]


# (rows, K, the weights' N, programs): items within one program's run, cut in two, and cut
# over many programs (more programs than items); one weight and several.
BALANCED_CASES = [(1, 768, (640,), 3), (3, 1024, (256,), 7), (8, 512, (128, 256, 128), 5),
                  (1, 2048, (128,), 16), (17, 384, (384,), 2), (2, 1536, (256, 128), 11)]


@pytest.mark.parametrize("rows, k, ns, programs", BALANCED_CASES)
def test_balanced_products_equal_the_dequantized_product(monkeypatch, rows, k, ns, programs):
  """Balanced runs (fp8_block_kernel.partials(balanced=True)) over `programs` programs: every
  partial slot written (interpret mode fills unwritten ones with NaN), unused slots zero, and
  their sum the dequantized product within the bf16 output's rounding."""
  monkeypatch.setattr(platform, "num_sms", lambda: programs)  # the interpreter runs them all
  monkeypatch.setattr(fp8_layout, "choose_layout", lambda k, n, num_sms, rows=1: (1, True))
  rng = np.random.default_rng([RUN_SEED, 31, rows, k, *ns])
  x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
  weights = [_fp8_weight(rng, n, k) for n in ns]
  w8s = tuple(jnp.asarray(w) for w, _ in weights)
  scales = tuple(jnp.asarray(s) for _, s in weights)
  parts_SNR, _ = fp8_gemm.fp8_partials_many.__wrapped__(x, w8s, scales)
  parts = np.asarray(parts_SNR)
  per_step = fp8_gemm.default_tiling(rows).blocks_per_step
  runs = BalancedRuns(sum(ns) // BLOCK, k // BLOCK // per_step, programs)
  assert parts.shape[0] == runs.segments and np.isfinite(parts).all()
  x32 = np.asarray(x, np.float32)
  w32 = np.concatenate([_dequantized(w8, scale) for w8, scale in weights])
  y = parts.sum(axis=0)[:, :rows].T.astype(ml_dtypes.bfloat16).astype(np.float32)
  _assert_within_output_rounding(y, x32 @ w32.T, x32, w32)
  many = fp8_gemm.fp8_matmul_many.__wrapped__(x, w8s, scales)
  np.testing.assert_array_equal(np.concatenate([np.asarray(m, np.float32) for m in many], 1), y)


@pytest.mark.parametrize("activations", ["float16", "e4m3"])
def test_balanced_runs_on_the_other_activation_routes(monkeypatch, activations):
  """float16 x (row scales applied after the sum) and e4m3 x (the rows' scales in the kernel's
  lanes) through balanced runs over 5 programs: the K-sliced call's result, within two
  roundings of the bf16 output (the partials are summed in another grouping)."""
  monkeypatch.setattr(platform, "num_sms", lambda: 5)
  rng = np.random.default_rng([RUN_SEED, 32, len(activations)])
  x = jnp.asarray(rng.standard_normal((3, 768)) * 10.0 ** rng.uniform(-2, 2, (3, 1)),
                  jnp.bfloat16)
  w8, scale = _fp8_weight(rng, 640, 768)
  sliced = np.asarray(fp8_matmul.__wrapped__(x, jnp.asarray(w8), jnp.asarray(scale), splits=1,
                                             activations=activations), np.float32)
  monkeypatch.setattr(fp8_layout, "choose_layout", lambda k, n, num_sms, rows=1: (1, True))
  balanced = np.asarray(fp8_matmul.__wrapped__(x, jnp.asarray(w8), jnp.asarray(scale),
                                               activations=activations), np.float32)
  x32, w32 = np.asarray(x, np.float32), _dequantized(w8, scale)
  _assert_within_output_rounding(balanced, sliced, x32, w32, roundings=2)


def test_products_of_one_x_refuse_mismatched_weights():
  x = jnp.ones((2, 256), jnp.bfloat16)
  w8 = jnp.ones((128, 256), jnp.float8_e4m3fn)
  scale = jnp.ones((1, 2), jnp.float32)
  with pytest.raises(ValueError, match="as many scales as weights"):
    fp8_gemm.fp8_matmul_many(x, (w8, w8), (scale,))
  with pytest.raises(ValueError, match="scales"):  # another K
    fp8_gemm.fp8_matmul_many(x, (w8, jnp.ones((128, 384), jnp.float8_e4m3fn)),
                             (scale, jnp.ones((1, 3), jnp.float32)))
  with pytest.raises(ValueError, match="2 entries for 1 weights"):
    fp8_gemm.fp8_matmul_many(x, (w8,), (scale,), lanes_NbX=(None, None))


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["bfloat16", "float16"])
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("k, n", [(4096, 4096), (12288, 4096), (4096, 1024), (7168, 2176),
                                  (2048, 5120)])
def test_gpu_fp8_matmul_at_model_shapes(rows, k, n, activations):
  """The register form of the kernel (the GPU's), at Qwen3-8B's q/o, down and k/v shapes, and
  DeepSeek-V3's q_a + kv_a and Qwen3-30B-A3B's q / k / v (balanced runs on 132 SMs: 17 and 40
  column blocks)."""
  rng = np.random.default_rng([RUN_SEED, rows, k, n])
  x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
  w8, scale = _fp8_weight(rng, n, k)
  y = np.asarray(fp8_matmul(x, jnp.asarray(w8), jnp.asarray(scale), activations=activations),
                 np.float32)
  x32, w32 = np.asarray(x, np.float32), _dequantized(w8, scale)
  _assert_within_output_rounding(y, x32 @ w32.T, x32, w32)


@pytest.mark.parametrize("sum_apart", [True, False])
def test_k_slice_sum_held_apart_or_left_to_the_reader(sum_apart):
  """sum_apart: the K slices' sum behind an optimization barrier (a kernel of its own) or left
  to XLA to fuse into the reader; the same value either way."""
  rng = np.random.default_rng([RUN_SEED, 15])
  x = jnp.asarray(rng.standard_normal((2, 512)), jnp.bfloat16)
  w8, scale = (jnp.asarray(a) for a in _fp8_weight(rng, 256, 512))

  def swiglu(x):  # an elementwise reader, as the MLP's
    y = fp8_matmul(x, w8, scale, splits=2, sum_apart=sum_apart)
    return jax.nn.silu(y[:, :128]) * y[:, 128:]

  assert ("optimization_barrier" in str(jax.make_jaxpr(swiglu)(x))) == sum_apart
  y = fp8_matmul(x, w8, scale, splits=2)
  want = jax.nn.silu(y[:, :128]) * y[:, 128:]
  np.testing.assert_array_equal(np.asarray(jax.jit(swiglu)(x), np.float32),
                                np.asarray(want, np.float32))


@pytest.mark.gpu
def test_gpu_k_slice_sum_fused_into_an_elementwise_reader():
  """Compiled, the sum fused into its reader (sum_apart=False; here the cast and the two halves
  SwiGLU reads) gives what the sum apart gives, but for the order of the float32 sums: within
  one rounding of the bf16 output."""
  rng = np.random.default_rng([RUN_SEED, 16])
  x = jnp.asarray(rng.standard_normal((1, 4096)), jnp.bfloat16)
  w8, scale = (jnp.asarray(a) for a in _fp8_weight(rng, 2 * 12288, 4096))

  @functools.partial(jax.jit, static_argnames="apart")
  def gate_and_up(x, apart):
    y = fp8_matmul(x, w8, scale, sum_apart=apart).astype(jnp.float32)
    return y[:, :12288], y[:, 12288:]

  (gate, up), (gate_fused, up_fused) = gate_and_up(x, True), gate_and_up(x, False)
  for fused, apart in ((gate_fused, gate), (up_fused, up)):
    fused, apart = np.asarray(fused), np.asarray(apart)
    assert np.isfinite(fused).all()
    assert (np.abs(fused - apart) <= 2.0 ** -8 * np.abs(apart) + 1e-6 * np.abs(apart).max()).all()


@pytest.mark.gpu
def test_gpu_subnormal_weights_and_small_rows_on_the_bfloat16_route():
  """e4m3 subnormals (|w| < 2^-6, normal numbers once widened) and a row of x near 1e-6 on the
  bfloat16 route: products far under 1, kept by the conversions and the tensor cores."""
  rng = np.random.default_rng([RUN_SEED, 14])
  codes = rng.integers(1, 8, (256, 512)) | (rng.integers(0, 2, (256, 512)) << 7)
  w8 = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn)  # every entry subnormal
  scale = rng.uniform(1e-2, 1.0, (2, 4)).astype(np.float32)
  x = np.stack([rng.standard_normal(512), rng.standard_normal(512) * 1e-6])
  x = jnp.asarray(x, jnp.bfloat16)
  y = np.asarray(fp8_matmul(x, jnp.asarray(w8), jnp.asarray(scale), activations="bfloat16"),
                 np.float32)
  x32, w32 = np.asarray(x, np.float32), _dequantized(w8, scale)
  _assert_within_output_rounding(y, x32 @ w32.T, x32, w32)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_gpu_products_of_one_x_at_model_shapes(rows):
  """q, k and v of Qwen3-8B (4096 -> 4096, 1024, 1024) in one call on the GPU: each within the
  bound of the single products, and equal to them at the same K slices."""
  rng = np.random.default_rng([RUN_SEED, 12, rows])
  x = jnp.asarray(rng.standard_normal((rows, 4096)), jnp.bfloat16)
  weights = [_fp8_weight(rng, n, 4096) for n in (4096, 1024, 1024)]
  w8s = tuple(jnp.asarray(w) for w, _ in weights)
  scales = tuple(jnp.asarray(s) for _, s in weights)
  many = fp8_gemm.fp8_matmul_many(x, w8s, scales)
  splits = choose_splits(4096, 6144, platform.num_sms())
  x32 = np.asarray(x, np.float32)
  for y, (w8, scale), w8_j, scale_j in zip(many, weights, w8s, scales):
    y = np.asarray(y, np.float32)
    w32 = _dequantized(w8, scale)
    _assert_within_output_rounding(y, x32 @ w32.T, x32, w32)
    alone = np.asarray(fp8_matmul(x, w8_j, scale_j, splits=splits), np.float32)
    # Equal but for the compiler's FMA contractions, which differ between the two kernels: a
    # float32 sum a few ulps apart may round to the neighbouring bf16 value (on an H100 at 64
    # rows, both within the bound above).
    _assert_within_output_rounding(y, alone, x32, w32, roundings=2)


def _act_quant(x32):
  """DeepSeek-V3's act_quant in NumPy: per row and 128 columns, amax -> 448, rounded to e4m3;
  returns the e4m3 values (as float32) and the scales."""
  m, k = x32.shape
  groups = x32.reshape(m, k // BLOCK, BLOCK)
  scale = np.maximum(np.abs(groups).max(-1), 1e-12) / 448.0
  x8 = (groups / scale[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  return x8.reshape(m, k), scale


def test_activation_quantization_is_deepseeks_act_quant():
  rng = np.random.default_rng([RUN_SEED, 4])
  x32 = rng.standard_normal((7, 512)).astype(np.float32) * 10.0 ** rng.uniform(-3, 3, (7, 1))
  x8, scale = quantize_activations(jnp.asarray(x32))
  want_x8, want_scale = _act_quant(x32)
  np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=1e-6)
  got = np.asarray(x8).astype(np.float32)
  # XLA may divide as a multiply by the reciprocal: a value on a rounding boundary can land
  # one e4m3 step (2^-3 relative, at most) from NumPy's; nearly all are equal.
  assert (np.abs(got - want_x8) <= 2.0 ** -3 * np.abs(want_x8) + 2.0 ** -9).all()
  assert (got == want_x8).mean() > 0.99
  assert np.abs(got).max() <= 448


@pytest.mark.parametrize("rows, k, n, splits", CASES[:3])
def test_fp8_matmul_with_e4m3_activations_equals_the_quantized_product(rows, k, n, splits):
  """x made of e4m3 values times a power of two per 128 columns, each group's largest |x| at
  448 times it: quantizing x is then exact however the division is compiled, and the kernel
  must give the product of the dequantized weight with x itself."""
  rng = np.random.default_rng([RUN_SEED, 3, rows, k, n])
  x8 = np.clip(rng.standard_normal((rows, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  x8 = x8.astype(np.float32).reshape(rows, k // BLOCK, BLOCK)
  x8[:, :, 0] = 448.0
  x32 = (x8 * 2.0 ** rng.integers(-12, 4, (rows, k // BLOCK, 1))).reshape(rows, k)
  x = jnp.asarray(x32, jnp.bfloat16)
  assert (np.asarray(x, np.float32) == x32).all()
  w8, scale = _fp8_weight(rng, n, k)
  y = np.asarray(fp8_matmul(x, jnp.asarray(w8), jnp.asarray(scale), splits=splits,
                            activations="e4m3"), np.float32)
  w32 = _dequantized(w8, scale)
  _assert_within_output_rounding(y, x32 @ w32.T, x32, w32)


@pytest.mark.parametrize("rows", [1, 30, 40])
def test_scales_repeated_beforehand_give_the_same_product(rows):
  # Up to 32 padded rows the kernel reads the lanes made before a loop of steps; from 33 on it
  # needs more lanes and repeats the scales itself: the same product either way.
  rng = np.random.default_rng([RUN_SEED, 7, rows])
  x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
  w8, scale = (jnp.asarray(a) for a in _fp8_weight(rng, 256, 256))
  lanes = fp8_gemm.scale_lanes(scale)
  assert lanes.shape == (2, 2 * fp8_gemm.SCALE_LANES)
  np.testing.assert_array_equal(np.asarray(fp8_matmul(x, w8, scale, lanes_NbX=lanes)),
                                np.asarray(fp8_matmul(x, w8, scale)))
  with pytest.raises(ValueError, match="not scale_lanes"):
    fp8_matmul(x[:1], w8, scale, lanes_NbX=lanes[:, :8])
