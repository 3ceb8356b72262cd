"""A decode or verify step's attention output quantized to e4m3 by the attention's own kernels
for the FP8 o_proj after it (backends.FP8_E4M3_ROWS), written token by token:
short_attention's and the merge's `quantize` forms against fp8_gemm.quantize_activations of
the output they also write, and models whose o_proj reads those rows against the same models
with that product's activations quantized by XLA."""

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import backends
from jspec.pallas_kernels import fp8_experts, fp8_gemm, mla_merge, platform
from jspec.pallas_kernels import short_attention as short_lib
from jspec.pallas_kernels.short_attention import short_attention
from tests.test_e4m3_rows import _f32, check_quantized

RUN_SEED = 20261204


def _case(rng, b, kv_heads, group, slots, dtype, tokens=1):
  q = jnp.asarray(rng.standard_normal((b, kv_heads * tokens * group, 128)), dtype)
  # Heads of very different sizes: each head's scale must be its own.
  values = rng.standard_normal((b, kv_heads, slots, 128)) * 2.0 ** rng.integers(
      -6, 6, (1, kv_heads, 1, 1))
  keys = jnp.asarray(rng.standard_normal((b, kv_heads, slots, 128)), dtype)
  # A verify window's tokens see slots up to start + t: all within the cache.
  start = jnp.asarray(rng.integers(0, slots - tokens + 1, b), jnp.int32)
  return q, keys, jnp.asarray(values, dtype), start


def token_major(out_BRH, kv_heads, tokens, group):
  """The kernel's rows [B, K x T x G, H] (row k x T x G + t x G + g) token by token:
  [B, T x K x G, H], as o_proj reads them."""
  b, _, h = out_BRH.shape
  return out_BRH.reshape(b, kv_heads, tokens, group, h).transpose(0, 2, 1, 3, 4).reshape(
      b, tokens * kv_heads * group, h)


@pytest.mark.parametrize("seed", range(10))
def test_short_attention_quantizes_its_output_as_quantize_activations(seed):
  """quantize=True for a decode step (one token) or a verify window of 2 to 5 tokens, one
  program per (sequence, KV head) or its slots split 2 to 8 ways and merged (the merge
  quantizes then): the same output as without, bit for bit, but token by token ([B, T x N,
  H]), and that output as B x T rows of N heads in e4m3 with each head's scale in the FP8
  kernel's lanes, exactly as quantize_activations and act_lanes give them (zeros in the lanes
  past the tokens)."""
  rng = np.random.default_rng(RUN_SEED + seed)
  b, kv_heads, group = int(rng.choice([1, 2, 3, 8])), int(rng.choice([1, 2, 4])), int(
      rng.choice([1, 2, 8]))
  tokens = 1 if seed < 4 else int(rng.integers(2, 6))
  slots = 16 * int(rng.integers(2, 9))
  splits = [1, None][seed % 2] or int(rng.integers(2, min(8, slots // 16) + 1))
  dtype = [jnp.float32, jnp.bfloat16][seed // 2 % 2]
  q, keys, values, start = _case(rng, b, kv_heads, group, slots, dtype, tokens)
  call = lambda quantize: short_attention(q, keys, values, start, group=group, scale=0.1,
                                          splits=splits, block_slots=16, quantize=quantize)
  want = token_major(call(False), kv_heads, tokens, group)
  out, x8, lanes = call(True)
  np.testing.assert_array_equal(_f32(out), _f32(want))
  check_quantized(want.reshape(b * tokens, -1), x8, lanes, b * tokens,
                  kv_heads * group * 128)


@pytest.mark.parametrize("seed", range(6))
def test_the_merge_quantizes_its_output_as_quantize_activations(seed):
  """mla_merge.merge_chunks(quantize=True) over 1 to 16 chunks, some rows seen by no chunk,
  the rows of one token or of a window of 2 to 4 in KV-head groups (`token_groups`): the
  merged rows as without, bit for bit, token by token, and their e4m3 form and lanes
  quantize_activations' and act_lanes' of them."""
  rng = np.random.default_rng(RUN_SEED + 100 + seed)
  b, splits, rows = int(rng.choice([1, 2, 5])), int(rng.integers(1, 17)), int(
      rng.choice([1, 4, 32]))
  tokens = 1 if seed < 3 else int(rng.integers(2, 5))
  group = int(rng.choice([g for g in (1, 2, 4) if rows % g == 0]))
  kv_heads = rows // group
  rows *= tokens
  parts = jnp.asarray(rng.standard_normal((b, splits, rows, 128))
                      * 2.0 ** rng.integers(-6, 6, (1, 1, rows, 1)), jnp.float32)
  lse = rng.standard_normal((b, splits, rows))
  lse[rng.random(lse.shape) < 0.2] = -np.inf
  lse = jnp.asarray(lse, jnp.float32)
  want = token_major(mla_merge.merge_chunks(parts, lse, dtype=jnp.bfloat16), kv_heads, tokens,
                     group)
  out, x8, lanes = mla_merge.merge_chunks(parts, lse, dtype=jnp.bfloat16, quantize=True,
                                          token_groups=(tokens, group))
  np.testing.assert_array_equal(_f32(out), _f32(want))
  check_quantized(want.reshape(b * tokens, -1), x8, lanes, b * tokens, rows // tokens * 128)


def test_the_quantize_forms_refuse_what_o_proj_cannot_take():
  q, keys = jnp.zeros((1, 4, 128)), jnp.zeros((1, 2, 32, 128))
  start = jnp.zeros(1, jnp.int32)
  with pytest.raises(ValueError, match="quantizes 128-wide heads once for up to 64 tokens, "
                                       "got H=64"):
    short_attention(jnp.zeros((1, 4, 64)), jnp.zeros((1, 2, 32, 64)), jnp.zeros((1, 2, 32, 64)),
                    start, group=2, scale=1.0, quantize=True)
  with pytest.raises(ValueError, match="2 copies"):
    short_attention(q, keys, keys, start, group=2, scale=1.0, copies=2, quantize=True)
  with pytest.raises(ValueError, match="65 x 1 tokens"):
    short_attention(jnp.zeros((65, 4, 128)), jnp.zeros((65, 2, 32, 128)),
                    jnp.zeros((65, 2, 32, 128)), jnp.zeros(65, jnp.int32), group=2, scale=1.0,
                    quantize=True)
  with pytest.raises(ValueError, match="17 x 4 tokens"):  # a window of 4 over 17 sequences
    short_attention(jnp.zeros((17, 8, 128)), jnp.zeros((17, 2, 32, 128)),
                    jnp.zeros((17, 2, 32, 128)), jnp.zeros(17, jnp.int32), group=1, scale=1.0,
                    quantize=True)
  parts, lse = jnp.zeros((1, 2, 4, 64)), jnp.zeros((1, 2, 4))
  with pytest.raises(ValueError, match="quantizes every row of C=128"):
    mla_merge.merge_chunks(parts, lse, dtype=jnp.float32, quantize=True)
  with pytest.raises(ValueError, match="3 of 4 rows"):
    mla_merge.merge_chunks(jnp.zeros((1, 2, 4, 128)), lse, dtype=jnp.float32, rows=3,
                           quantize=True)
  with pytest.raises(ValueError, match=r"\(T, G\) = \(3, 1\)"):  # 4 rows are no 3-token window
    mla_merge.merge_chunks(jnp.zeros((1, 2, 4, 128)), lse, dtype=jnp.float32, quantize=True,
                           token_groups=(3, 1))
  with pytest.raises(ValueError, match="token by token all R rows"):
    mla_merge.merge_chunks(jnp.zeros((1, 2, 4, 128)), lse, dtype=jnp.float32, rows=2,
                           token_groups=(2, 1))



def _moe_config():
  from tests.test_moe_e4m3 import _qwen3_moe_config
  return _qwen3_moe_config()


def _dense_config():
  from tests.test_fp8_gpu_configuration import _tiny_fp8_qwen3
  # down_proj's input 384 wide: no product but o_proj takes N x H = 256 columns
  return _tiny_fp8_qwen3().replace(intermediate_size=384)


def _llm(monkeypatch, config, attention_out: bool, drafter: str | None = None):
  """A tiny FP8 model as a Hopper GPU runs it (interpreted; attention "auto": the short-context
  kernel), the norms' e4m3 rows on, every few-row FP8 product and the experts' gate / up on e4m3
  activations (quantized by XLA where no kernel wrote them), the attention's own e4m3 output
  for o_proj on or off; `drafter` "ngram": every step a verify window of 3 tokens."""
  spec = drafter and {"method": drafter, "num_speculative_tokens": 2}
  monkeypatch.setattr(fp8_gemm, "DEFAULT_ACTIVATIONS", "e4m3")
  monkeypatch.setattr(fp8_experts, "X_E4M3", True)
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)
    patch.setattr(backends, "FP8_E4M3_ROWS", True)
    patch.setattr(backends, "FP8_E4M3_ATTENTION_OUT", attention_out)
    return jspec.LLM.from_random(config, dtype="float32", seed=8, max_model_len=64,
                                 max_num_seqs=2, attention_backend="auto", norm_backend="pallas",
                                 speculative_config=spec)


def _decode_logprobs(llm):
  """Each sequence's tokens and the logprobs of its 5 likeliest tokens at every decode step."""
  from tests.test_fp8_gpu_configuration import PROMPTS
  params = jspec.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=5)
  return [[(token, sorted((t, e.logprob, e.rank) for t, e in step.items()))
           for token, step in zip(out.token_ids, out.logprobs)]
          for out in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.usefixtures("fresh_traces")
@pytest.mark.parametrize("model, split, drafter", [("dense", True, "ngram"),
                                                   ("moe", False, None), ("moe", False, "ngram")])
def test_o_proj_reads_the_attention_kernels_e4m3_rows(monkeypatch, model, split, drafter):
  """Every decode step's o_proj (a dense model's into the norm kernel that sums its partials,
  a MoE model's through its own K-slice sum), or every n-gram verify window's, takes the e4m3
  rows the short-context attention kernel wrote token by token (`split`: its slots split over
  programs, the merge kernel writing them; each kernel form and each route once, the suite's
  time being short), with no quantizing pass of XLA's; the tokens and the logprobs of every
  token equal those of the same model with o_proj's activations quantized by XLA, bit for
  bit. (The merge at decode steps is the kernel tests' alone here.)"""
  config = {"dense": _dense_config, "moe": _moe_config}[model]()
  if split:  # as the GPU's choice splits a few sequences' slots (2 ways in 16-slot blocks)
    monkeypatch.setattr(short_lib, "choose_splits",
                        lambda b, k, slots, sms: (2, 16) if slots >= 32 else (1, None))
  quantized, o_rows = [], []
  kernel = short_lib.short_attention

  def attention_spy(q, keys, *args, quantize=False, **kwargs):
    tokens = q.shape[1] // keys.shape[1] // kwargs["group"]
    quantized.append((tokens, quantize))
    return kernel(q, keys, *args, quantize=quantize, **kwargs)

  monkeypatch.setattr(short_lib, "short_attention", attention_spy)
  for name in ("fp8_partials_many", "fp8_matmul"):
    def spy(x, *args, act_lanes_X=None, fn=getattr(fp8_gemm, name), **kwargs):
      if x.shape[-1] == config.num_heads * config.head_dim:
        o_rows.append((x.shape[0], act_lanes_X is not None))
      return fn(x, *args, act_lanes_X=act_lanes_X, **kwargs)
    monkeypatch.setattr(fp8_gemm, name, spy)
  reference = _llm(monkeypatch, config, attention_out=False, drafter=drafter)
  want = _decode_logprobs(reference)
  assert o_rows and not any(e for _, e in o_rows) and not any(q for _, q in quantized)
  llm = _llm(monkeypatch, config, attention_out=True, drafter=drafter)
  assert all(layer.attn.fp8_e4m3_o for layer in llm.target.layers)
  o_rows.clear()
  quantized.clear()
  got = _decode_logprobs(llm)
  # every step's attention quantized: the prompts' 16-token chunk, then decode's one token or
  # the verify windows' 3
  assert quantized and all(q for _, q in quantized)
  assert {t for t, _ in quantized} == {16, 3 if drafter else 1}
  # every decode step's or verify window's o_proj (2 sequences of 1 or 3 tokens): the kernel's
  # rows
  step_rows = [e for rows, e in o_rows if rows == 2 * (3 if drafter else 1)]
  assert step_rows and all(step_rows)
  assert got == want


def test_the_setting_off_too_many_tokens_or_a_bf16_o_proj_keep_its_input_as_it_is(monkeypatch):
  """FP8_E4M3_ATTENTION_OUT off: no layer's attention quantizes its output; on, a decode step's
  and a verify window's, but not a step of more tokens than the FP8 kernel's rows (a prefill
  chunk) or a layer whose o_proj is not FP8."""
  config = _dense_config()
  off = _llm(monkeypatch, config, attention_out=False)
  assert not any(layer.attn.fp8_e4m3_o for layer in off.target.layers)
  attn = _llm(monkeypatch, config, attention_out=True).target.layers[0].attn
  q = lambda b, t: jnp.zeros((b, t, config.num_heads, config.head_dim))
  assert attn._quantizes_out(q(2, 1)) and attn._quantizes_out(q(16, 4))
  assert not attn._quantizes_out(q(17, 4)) and not attn._quantizes_out(q(1, 128))
  attn.o_proj_scale = None
  assert not attn._quantizes_out(q(2, 1))



@pytest.mark.parametrize("dp, tokens", [(2, 1), (4, 3)])
def test_the_sharded_attentions_e4m3_rows_on_a_mesh_equal_one_device(dp, tokens):
  """decode_attention.sharded_short_attention(quantize=True) on dp shards, a decode step or a
  verify window: the values and e4m3 rows one device gives, bit for bit, the values the
  attention without `quantize` gives, and each batch shard's lanes (E4m3Rows.lanes, a row a
  shard) act_lanes' of its own rows' scales, as the FP8 product per shard reads them."""
  from jspec.models.decode_attention import sharded_short_attention
  from jspec.models.linear import E4m3Rows
  from jspec.sharding.rules import ShardingRules
  rng = np.random.default_rng(RUN_SEED + 200 + dp)
  b, kv_heads, group, slots = 4, 2, 2, 48
  _, keys, values, start = _case(rng, b, kv_heads, group, slots, jnp.float32, tokens)
  q_BTNH = jnp.asarray(rng.standard_normal((b, tokens, kv_heads * group, 128)), jnp.float32)
  outs = []
  for mesh in (jspec.MeshConfig().make_mesh(), jspec.MeshConfig(dp=dp).make_mesh()):
    attend = sharded_short_attention(mesh, ShardingRules(), interpret=True)
    rows = attend(q_BTNH, keys, values, start, quantize=True)
    assert isinstance(rows, E4m3Rows) and rows.lanes.shape[0] == mesh.shape["dp"]
    assert (rows.values.shape == q_BTNH.shape
            and rows.x8.shape == (b, tokens, kv_heads * group * 128))
    outs.append(rows)
  one, meshed = outs
  np.testing.assert_array_equal(_f32(one.values), _f32(attend(q_BTNH, keys, values, start)))
  np.testing.assert_array_equal(_f32(meshed.values), _f32(one.values))
  np.testing.assert_array_equal(_f32(meshed.x8), _f32(one.x8))
  per_shard = b // dp
  for shard in range(dp):
    rows = slice(shard * per_shard, (shard + 1) * per_shard)
    _, scale = fp8_gemm.quantize_activations(one.values[rows].reshape(per_shard * tokens, -1))
    np.testing.assert_array_equal(np.asarray(meshed.lanes[shard]),
                                  np.asarray(fp8_gemm.act_lanes(scale)))


@pytest.mark.gpu
@pytest.mark.parametrize("b, kv_heads, group, slots, tokens", [
    (1, 4, 8, 640, 1), (8, 4, 8, 640, 1), (8, 8, 4, 640, 1), (3, 8, 4, 128, 1),
    (1, 8, 4, 640, 4), (4, 4, 8, 640, 4), (16, 8, 4, 640, 4), (2, 8, 4, 128, 3)])
def test_gpu_the_attention_kernels_quantize_as_quantize_activations(b, kv_heads, group, slots,
                                                                     tokens):
  """Compiled (Triton) at Qwen3-30B-A3B's and Qwen3-8B's heads, decode steps and verify windows
  of MTP's 3 drafts (4 tokens) or 2, split and merged where the GPU's choice splits, bf16: the
  output as without `quantize` within a bf16 ulp (the quantize form's merge holds a whole row a
  program, and its float32 sums over the splits may round in another order: 1 element of
  32768 did), token by token, and its e4m3 form and lanes exactly quantize_activations' and
  act_lanes' of the output it wrote."""
  rng = np.random.default_rng(RUN_SEED + b + slots + tokens)
  q, keys, values, start = _case(rng, b, kv_heads, group, slots, jnp.bfloat16, tokens)
  call = lambda quantize: short_attention(q, keys, values, start, group=group, scale=0.1,
                                          quantize=quantize)
  want = token_major(call(False), kv_heads, tokens, group)
  out, x8, lanes = call(True)
  np.testing.assert_allclose(_f32(out), _f32(want), rtol=2.0 ** -7, atol=0)
  assert np.mean(_f32(out) != _f32(want)) < 1e-3
  check_quantized(out.reshape(b * tokens, -1), x8, lanes, b * tokens, kv_heads * group * 128)
