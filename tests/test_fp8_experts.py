"""FP8 experts (jspec.pallas_kernels.fp8_experts at decode sizes, fp8_experts_grouped at
prefill sizes): the Pallas expert backend, handed e4m3 expert weights [E, out, in] with their
128 x 128 block scales as checkpoints store them, against float64 NumPy on the dequantized
weights (e4m3 value x its block's scale; at prefill sizes with x and act rounded to e4m3 as
the kernels' activation quantization does). The decode path's act goes to the down kernel in
bfloat16 here (fp8_experts.DOWN_E4M3 off): its e4m3 form, and the decode path with it, are
tests/test_expert_down_e4m3.py's. In interpret mode here; the GPU runs are marked `gpu`."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jspec.models.moe_backends import experts_reference
from jspec.pallas_kernels import fp8_experts, platform
from jspec.pallas_kernels.experts import experts_pallas
from jspec.pallas_kernels.fp8_experts import (BLOCK, CHUNK_TOKENS, DECODE_PATH_MAX_TOKENS,
                                              Fp8Experts, Fp8ExpertsTiling, experts_fp8,
                                              experts_fp8_decode, fits_kernel, slot_products)
from jspec.pallas_kernels.fp8_experts_grouped import (MAX_TILE_ROWS, MIN_TILE_ROWS,
                                                      experts_fp8_grouped, tile_rows)
from jspec.pallas_kernels.fp8_gemm import quantize_activations, scale_lanes
from jspec.pallas_kernels.fp8_layout import choose_splits

RUN_SEED = 20261125


@pytest.fixture(autouse=True)
def bf16_act_for_the_down_kernel(monkeypatch):
  monkeypatch.setattr(fp8_experts, "DOWN_E4M3", False)


def _fp8(rng, num_experts, out, inner):
  w8 = np.clip(rng.standard_normal((num_experts, out, inner)) * 60, -448, 448)
  scale = rng.uniform(1e-4, 3e-3, (num_experts, out // BLOCK, inner // BLOCK))
  return Fp8Experts(jnp.asarray(w8.astype(ml_dtypes.float8_e4m3fn)),
                    jnp.asarray(scale, jnp.float32))


def _dequantized64(w: Fp8Experts):
  """[E, in, out] float64."""
  scale = np.repeat(np.repeat(np.asarray(w.scale, np.float64), BLOCK, 1), BLOCK, 2)
  return np.swapaxes(np.asarray(w.w8).astype(np.float64) * scale, 1, 2)


def _reference64(x, ids, weights, w_gate, w_up, w_down):
  """y[t] = sum_k w[t,k] * down_e(silu(x[t] @ gate_e) * (x[t] @ up_e)) in float64, ids outside
  [0, E) adding nothing; each expert's tokens as one product (a product per token and pick
  reads every expert's float64 weights once per pick: minutes at DeepSeek-V3's shapes)."""
  x, weights, ids = np.asarray(x, np.float64), np.asarray(weights, np.float64), np.asarray(ids)
  gate, up, down = (_dequantized64(w) for w in (w_gate, w_up, w_down))
  y = np.zeros_like(x)
  for e in range(gate.shape[0]):
    t, k = np.nonzero(ids == e)
    if len(t):
      g, u = x[t] @ gate[e], x[t] @ up[e]
      np.add.at(y, t, weights[t, k][:, None] * ((g / (1 + np.exp(-g)) * u) @ down[e]))
  return y


def _problem(seed, num_tokens, num_experts=6, top_k=2, dim=256, ffn=128, dtype=jnp.bfloat16):
  rng = np.random.default_rng([RUN_SEED, seed, num_tokens])
  w_gate, w_up = _fp8(rng, num_experts, ffn, dim), _fp8(rng, num_experts, ffn, dim)
  w_down = _fp8(rng, num_experts, dim, ffn)
  x = jnp.asarray(rng.standard_normal((num_tokens, dim)), dtype)
  ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)])
  if num_tokens > 1:
    ids[1, 0] = -1            # another shard's expert (expert parallelism passes -1)
    ids[-1] = ids[0]          # two tokens with the same experts: one slot each, read once
  weights = rng.uniform(0.1, 1.0, (num_tokens, top_k))
  return x, jnp.asarray(ids, jnp.int32), jnp.asarray(weights, jnp.float32), w_gate, w_up, w_down


def _assert_close(y, exact):
  y = np.asarray(y, np.float64)
  # The widened e4m3 tile and x are exact (bfloat16 x as it is; float32 x in float16 after a
  # power-of-two row scale, rounded to 2^-11), products sum in float32; act is rounded to x's
  # 16-bit type (bfloat16 2^-9, float16 2^-11) and the output to x's dtype (bf16 2^-9): 2^-7
  # of the output's magnitude bounds these with room.
  scale = np.maximum(np.abs(exact).max(axis=1, keepdims=True), 1e-6)
  assert np.isfinite(y).all()
  assert (np.abs(y - exact) <= 2.0 ** -7 * scale).all(), np.abs(y - exact).max()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 12, 16])
def test_fp8_experts_equal_the_dequantized_layer(num_tokens, dtype):
  """Both activation routes: bfloat16 x as it is (12 tokens: a partial last 8-row tile, padded),
  float32 x through float16 row scales."""
  problem = _problem(0, num_tokens, dtype=dtype)
  y = experts_pallas(*problem)
  assert y.shape == problem[0].shape and y.dtype == dtype
  _assert_close(y, _reference64(*problem))


def test_an_odd_number_of_k_blocks_and_several_column_blocks():
  problem = _problem(1, 4, num_experts=4, top_k=3, dim=384, ffn=256)
  _assert_close(experts_pallas(*problem), _reference64(*problem))


def test_a_single_token_with_an_invalid_pick_adds_nothing_for_it():
  x, ids, weights, *fp8 = _problem(2, 1)
  only_first = ids.at[0, 1].set(-1)
  expected = _reference64(x, only_first, weights, *fp8)
  _assert_close(experts_pallas(x, only_first, weights, *fp8), expected)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("gate_up_splits,down_splits", [(2, 1), (4, 3), (2, 3)])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_k_slices_of_each_slot_sum_to_the_whole_product(num_tokens, gate_up_splits,
                                                        down_splits, dtype):
  """K cut into slices, each (slot, slice, column block) its own item, the partials summed
  after the kernel: gate / up over D = 512 (4 blocks) in 2 or 4 slices, down over F = 384
  (3 blocks) in 1 or 3 slices."""
  problem = _problem(9, num_tokens, dim=512, ffn=384, dtype=dtype)
  tiling = Fp8ExpertsTiling(gate_up_splits=gate_up_splits, down_splits=down_splits)
  _assert_close(experts_fp8_decode(*problem, tiling=tiling), _reference64(*problem))


def _with_lanes(problem):
  """The problem with each expert weight's block scales repeated over the kernel's lanes
  beforehand (Fp8Experts.lanes, as the models make them before a loop of steps)."""
  *rest, w_gate, w_up, w_down = problem
  return (*rest, *(Fp8Experts(w.w8, w.scale, scale_lanes(w.scale)) for w in (w_gate, w_up,
                                                                              w_down)))


@pytest.mark.parametrize("seed", range(4))
def test_scale_lanes_made_beforehand_give_the_same_layer(seed):
  """Block scales repeated over the lanes before the call (read by expert in the kernel)
  give, bit for bit, what the per-call gather and repeat of the slots' scales gives: one to
  9 tokens, K whole or in slices; past the lanes' rows (40 tokens) the call repeats them
  itself, as without."""
  rng = np.random.default_rng([RUN_SEED, 30, seed])
  num_tokens = [1, 3, 9, 40][seed]
  problem = _problem(30 + seed, num_tokens, top_k=int(rng.integers(1, 4)), dim=512,
                     ffn=256, dtype=[jnp.bfloat16, jnp.float32][seed % 2])
  tiling = Fp8ExpertsTiling(gate_up_splits=int(rng.choice([1, 2, 4])), down_splits=1)
  want = experts_fp8_decode(*problem, tiling=tiling)
  got = experts_fp8_decode(*_with_lanes(problem), tiling=tiling)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  _assert_close(got, _reference64(*problem))


def test_scale_lanes_of_another_shape_are_refused():
  *rest, w_gate, w_up, w_down = _problem(31, 1)
  wrong = [Fp8Experts(w.w8, w.scale, scale_lanes(w.scale, 16)) for w in (w_gate, w_up, w_down)]
  with pytest.raises(ValueError, match="Fp8Experts.lanes has shape"):
    experts_fp8_decode(*rest, *wrong)


def test_k_slices_that_would_split_a_block_are_refused():
  """Down over F = 384 (3 blocks) does not halve into whole blocks."""
  problem = _problem(9, 1, dim=512, ffn=384)
  with pytest.raises(ValueError, match="does not split into 2 slices"):
    experts_fp8_decode(*problem, tiling=Fp8ExpertsTiling(gate_up_splits=4, down_splits=2))


def test_one_token_of_narrow_experts_is_cut_into_k_slices_that_fill_the_sms():
  """Qwen3-30B-A3B at one token: 8 slots x 6 column blocks of F = 768 are 48 items for 132
  SMs; slices of D = 2048 (16 blocks) bring them to 384, 97% of three rounds. Its down
  product (8 x 16 column blocks, 97% of one round) keeps whole K."""
  assert choose_splits(2048, 8 * 768, 132) == 8
  assert choose_splits(768, 8 * 2048, 132) == 1


@pytest.mark.parametrize("num_tokens", [40, 2 * CHUNK_TOKENS + 5])
def test_the_decode_path_runs_in_chunks_of_the_kernel(num_tokens):
  """40 tokens x 3 picks: more copies than the bf16 decode path takes, one sum per kernel
  (N = 64); 133 tokens: three chunks, the last of 5 (experts_fp8 itself: the backend takes
  the grouped path past DECODE_PATH_MAX_TOKENS)."""
  problem = _problem(7, num_tokens, top_k=3)
  _assert_close(experts_fp8(*problem), _reference64(*problem))


def _act_quant(x32):
  """quantize_activations in NumPy float32, returned dequantized in float64: each row's
  128-wide groups scaled so that their largest |x| maps to 448, then rounded to e4m3."""
  m, k = x32.shape
  groups = x32.reshape(m, k // BLOCK, BLOCK)
  scale = np.maximum(np.abs(groups).max(axis=-1), np.float32(1e-12)) / np.float32(448.0)
  x8 = (groups / scale[..., None]).astype(ml_dtypes.float8_e4m3fn)
  return (x8.astype(np.float64) * scale[..., None].astype(np.float64)).reshape(m, k)


def _w8a8_reference64(x, ids, weights, w_gate, w_up, w_down, x_rounded_by_jspec=False):
  """The layer as the grouped path computes it, in float64 but for its two quantizations: x
  and act rounded to e4m3 per row and 128 channels (DeepSeek's act_quant), then exact sums.
  x_rounded_by_jspec: x's e4m3 values and scales from jspec's own quantize_activations (tested
  against act_quant in test_fp8_gemm.py) rather than NumPy's rounding."""
  ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
  if x_rounded_by_jspec:
    x8, scale = quantize_activations(jnp.asarray(x))
    xq = (np.asarray(x8).astype(np.float64)
          * np.repeat(np.asarray(scale, np.float64), BLOCK, axis=1))
  else:
    xq = _act_quant(np.asarray(x, np.float32))
  gate, up, down = (_dequantized64(w) for w in (w_gate, w_up, w_down))
  y = np.zeros(xq.shape)
  for e in range(gate.shape[0]):
    t, k = np.nonzero(ids == e)
    if len(t):
      g, u = xq[t] @ gate[e], xq[t] @ up[e]
      act = _act_quant((g / (1 + np.exp(-g)) * u).astype(np.float32))
      np.add.at(y, t, weights[t, k][:, None] * (act @ down[e]))
  return y


def _assert_w8a8_close(y, problem, on_gpu: bool = False):
  """Close to the W8A8 reference; and within 2^-2 of each row's largest output of the
  unquantized layer, the cost of rounding x and act to 4 significant bits: each rounding error
  is at most 2^-4 of its value, so a product's relative error is about their rms, 2^-4 /
  sqrt(3) (4-5% of a row's largest output in these problems, up to 11% in the tails).

  In interpret mode (float32 sums): every output within 2^-7 of its row's largest. x is
  float32 in these problems: bf16 values divided by a group's scale often land exactly
  between two e4m3 values, where the last bit of the scale (XLA may divide by 448 as a product
  with its reciprocal) decides the rounding; float32 values practically never do. The float32
  sums can still move an act value across a rounding boundary where the float64 sum sits
  within about 2^-20 of it: one e4m3 step on one of F terms, far under the bound.

  On the GPU the FP8 tensor cores keep about 14 bits of their sums (DeepSeek-V3's report;
  measured 2^-12 of a tile's largest product here), which moves an act value across an e4m3
  rounding boundary about once in a thousand: that value changes by one e4m3 step (up to 2^-3
  of itself), and a row with a large such term moves by up to a few percent of its largest
  output (1.8% measured at 300 tokens of DeepSeek-V3 shard shapes). So: every output within
  2^-4, at most 2^-7 of them beyond 2^-7, and the median within 2^-10."""
  exact_w8a8 = _w8a8_reference64(*problem)
  if on_gpu:
    y64 = np.asarray(y, np.float64)
    assert np.isfinite(y64).all()
    rel = np.abs(y64 - exact_w8a8) / np.abs(exact_w8a8).max(axis=1, keepdims=True)
    assert rel.max() <= 2.0 ** -4, rel.max()
    assert np.mean(rel > 2.0 ** -7) <= 2.0 ** -7, np.mean(rel > 2.0 ** -7)
    assert np.median(rel) <= 2.0 ** -10, np.median(rel)
  else:
    _assert_close(y, exact_w8a8)
  y, exact = np.asarray(y, np.float64), _reference64(*problem)
  scale = np.abs(exact).max(axis=1, keepdims=True)
  assert (np.abs(y - exact) <= 2.0 ** -2 * scale).all(), np.abs(y - exact).max()


def test_prefill_sized_steps_group_token_copies_by_expert():
  """Above DECODE_PATH_MAX_TOKENS the copies are sorted by expert and every tile of rows reads
  its expert's e4m3 weights, with x and act quantized to e4m3 for the FP8 tensor cores."""
  problem = _problem(3, DECODE_PATH_MAX_TOKENS + 8, dtype=jnp.float32)
  y = experts_pallas(*problem)
  assert y.shape == problem[0].shape and y.dtype == jnp.float32
  _assert_w8a8_close(y, problem)


@pytest.mark.parametrize("seed,rows", [(0, 16), (1, 32), (2, 64), (3, 24)])
def test_grouped_fp8_experts_at_every_tile_size(seed, rows):
  """16 / 24 / 32 rows: gate and up share a kernel (24: a tile that is no power of two); 64: one
  kernel each. Skewed routing, so that an expert fills several tiles and others none; three K
  blocks and two column blocks; another shard's expert (-1) on some picks."""
  rng = np.random.default_rng([RUN_SEED, 10, seed])
  num_tokens, num_experts, top_k = 90, 5, 2
  x, _, weights, *fp8 = _problem(10 + seed, num_tokens, num_experts=num_experts, top_k=top_k,
                                 dim=384, ffn=256, dtype=jnp.float32)
  popularity = np.array([0.6, 0.25, 0.1, 0.05, 0.0])
  ids = np.stack([rng.choice(num_experts, top_k, replace=False, p=popularity)
                  for _ in range(num_tokens)])
  ids[rng.random((num_tokens, top_k)) < 0.1] = -1
  problem = (x, jnp.asarray(ids, jnp.int32), weights, *fp8)
  _assert_w8a8_close(experts_fp8_grouped(*problem, rows=rows), problem)


def test_grouped_fp8_experts_on_bf16_activations():
  """A model's bf16 x and bf16 result. bf16 values divided by a group's scale often land on a
  tie between two e4m3 values, where the scale's last bit decides the rounding
  (_assert_w8a8_close), so the reference takes x's e4m3 values from jspec's own
  quantize_activations; the output's bf16 rounding (2^-9) is inside the 2^-7 bound."""
  problem = _problem(4, DECODE_PATH_MAX_TOKENS + 30, top_k=3)
  y = experts_pallas(*problem)
  assert y.dtype == jnp.bfloat16
  _assert_close(y, _w8a8_reference64(*problem, x_rounded_by_jspec=True))


def test_tile_rows_follow_the_copies_per_expert():
  assert tile_rows(4096, 256) == 16          # DeepSeek-V3, 512 tokens x top-8
  assert tile_rows(4096, 128) == 32          # Qwen3-30B-A3B, 512 tokens x top-8
  assert tile_rows(4097, 128) == 64
  assert tile_rows(16384, 128) == MAX_TILE_ROWS
  assert tile_rows(8, 256) == MIN_TILE_ROWS


def test_grouped_fp8_experts_refuse_rows_off_the_tile():
  with pytest.raises(ValueError, match="rows=12"):
    experts_fp8_grouped(*_problem(0, 8), rows=12)


def test_fits_kernel_needs_whole_blocks():
  rng = np.random.default_rng(RUN_SEED)
  assert fits_kernel(_fp8(rng, 2, 128, 256))
  partial = Fp8Experts(jnp.zeros((2, 192, 256), jnp.float8_e4m3fn), jnp.ones((2, 2, 2)))
  assert not fits_kernel(partial)


def test_dequantized_is_the_stored_weight_times_its_block_scale():
  w = _fp8(np.random.default_rng([RUN_SEED, 4]), 3, 256, 128)
  assert w.shape == (3, 128, 256)
  np.testing.assert_allclose(np.asarray(w.dequantized(jnp.float32)), _dequantized64(w),
                             rtol=1e-6)


@pytest.mark.parametrize("num_tokens", [4, DECODE_PATH_MAX_TOKENS + 40])
def test_expert_parallel_shards_give_the_one_device_layer(interpreted_on_every_device,
                                                          num_tokens):
  """ep = 2 x tp = 2 on the CPU devices: each shard's experts and intermediate blocks in FP8,
  the sums reduced over the mesh, as the model's sharded expert backend runs them; at a decode
  size and at a prefill size (the grouped path, each shard sorting its own copies)."""
  from jspec.sharding.moe import sharded_experts
  from jspec.sharding.rules import MeshConfig, ShardingRules

  grouped = num_tokens > DECODE_PATH_MAX_TOKENS
  problem = _problem(5, num_tokens, num_experts=4, top_k=2, dim=256, ffn=256,
                     dtype=jnp.float32 if grouped else jnp.bfloat16)
  mesh = MeshConfig(dp=1, tp=2, ep=2).make_mesh()
  fn = sharded_experts(experts_pallas, mesh, ShardingRules())
  y = fn(*problem)
  if grouped:
    _assert_w8a8_close(y, problem)
  else:
    _assert_close(y, _reference64(*problem))
    # The scales' lanes made beforehand are split over the mesh as the scales are.
    np.testing.assert_array_equal(np.asarray(fn(*_with_lanes(problem)), np.float32),
                                  np.asarray(y, np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("num_tokens", [1, 8, 32, 64, 128])
def test_fp8_experts_on_the_gpu_at_deepseek_shard_shapes(num_tokens):
  """The decode path at DeepSeek-V3's expert shapes with F split over tp = 8 (256 per shard),
  32 experts; 128 tokens in two chunks."""
  problem = _problem(6, num_tokens, num_experts=32, top_k=8, dim=7168, ffn=256)
  _assert_close(experts_fp8(*problem), _reference64(*problem))


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("num_tokens", [1, 3, 12])
def test_fp8_experts_on_the_gpu_at_qwen3_30b_a3b_shapes(num_tokens, dtype):
  """Qwen3-30B-A3B's expert shapes (D = 2048, F = 768, top-8; 16 of its 128 experts): at one
  token gate / up run in K slices (the SMs' count decides how many), both activation
  routes."""
  problem = _problem(10, num_tokens, num_experts=16, top_k=8, dim=2048, ffn=768, dtype=dtype)
  _assert_close(experts_fp8(*problem), _reference64(*problem))


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("num_tokens,rows", [(300, None), (2048, None), (512, 16), (512, 32),
                                             (512, 64)])
def test_grouped_fp8_experts_on_the_gpu_at_deepseek_shard_shapes(num_tokens, rows):
  """The prefill-size path compiled for Hopper (e4m3 x e4m3 wgmma), DeepSeek-V3's shard
  shapes, 32 experts, top-8."""
  problem = _problem(8, num_tokens, num_experts=32, top_k=8, dim=7168, ffn=256,
                     dtype=jnp.float32)
  y = (experts_pallas(*problem) if rows is None
       else experts_fp8_grouped(*problem, rows=rows))
  _assert_w8a8_close(y, problem, on_gpu=True)


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("rows", [16, 64])
def test_grouped_tile_products_on_the_gpu(rows):
  _check_tile_products(rows)


@pytest.mark.parametrize("rows", [16, 64])
def test_grouped_tile_products_within_the_fp8_accumulation_bound(rows):
  _check_tile_products(rows)


def _check_tile_products(rows):
  """One product of the grouped path (tiles of e4m3 rows against their experts' e4m3 blocks)
  against float64 NumPy on the same e4m3 operands: within 2^-12 of the sum of |x| |w| over
  each output's terms (Hopper's FP8 accumulation keeps about 14 bits per instruction)."""
  rng = np.random.default_rng([RUN_SEED, 20, rows])
  num_tiles, num_experts, dim, out = 12, 5, 1024, 256
  w = _fp8(rng, num_experts, out, dim)
  x = rng.standard_normal((num_tiles * rows, dim)).astype(np.float32)
  x8, scale = quantize_activations(jnp.asarray(x))
  tile_expert = rng.integers(0, num_experts, num_tiles).astype(np.int32)
  used = num_tiles - 2  # the last two tiles are past the used ones: not written
  (got,) = slot_products(x8.reshape(num_tiles, rows, dim), (w,), jnp.asarray(tile_expert),
                         jnp.asarray([used], jnp.int32), 1, 4,
                         jnp.swapaxes(scale.reshape(num_tiles, rows, dim // BLOCK), 1, 2))
  x_exact = (np.asarray(x8).astype(np.float64)
             * np.repeat(np.asarray(scale, np.float64), BLOCK, axis=1)).reshape(num_tiles, rows,
                                                                               dim)
  weights = np.swapaxes(_dequantized64(w), 1, 2)  # [E, out, in]
  for s in range(used):
    want = weights[tile_expert[s]] @ x_exact[s].T
    bound = 2.0 ** -12 * (np.abs(weights[tile_expert[s]]) @ np.abs(x_exact[s]).T)
    assert (np.abs(np.asarray(got[s], np.float64) - want) <= bound + 1e-30).all(), s
