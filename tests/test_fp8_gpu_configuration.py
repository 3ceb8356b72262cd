"""FP8 models as a Hopper GPU runs them, interpreted on the CPU: a DeepSeek-V3-style one with
the FP8 product kernel on the MLA and MLP projections (jspec.pallas_kernels.fp8_gemm) and the
FP8 expert kernels (jspec.pallas_kernels.fp8_experts), and a Qwen3.5-style hybrid one with the
product kernel on the Gated DeltaNet, gated attention and MLP projections, each against the
same seeded model with its weights scaled before XLA's products (the CPU's configuration)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jspec
from jspec import backends
from jspec.bench.presets import PRESETS
from jspec.bench.steps import StepTimer
from jspec.models.caches import KVCache
from jspec.models import fp8_row_kernels, gated_deltanet, layers, linear, mlp, row_kernels
from jspec.models.gated_deltanet import GatedDeltaNet
from jspec.models.layers import Attention
from jspec.models.mlp import MLP
from jspec.models.mla import MLAttention
from jspec.pallas_kernels import fp8_experts, fp8_gemm, platform
from jspec.sharding.rules import ShardingRules


PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 300, 12]]


def _assert_same_outputs(reference, candidate, max_tokens: int):
  """candidate's logits within 10^-3 of the largest of reference's (x goes to float16, 2^-11,
  in each kernel: 10^-3 bounds it with room), and the same greedy tokens."""
  want, got = reference.compute_logits(PROMPTS[:1])[0], candidate.compute_logits(PROMPTS[:1])[0]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
  params = jspec.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
  tokens = [[o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            for llm in (reference, candidate)]
  assert tokens[0] == tokens[1]


def _tiny_fp8_mla():
  # Dimensions of whole 128 x 128 blocks where the kernels need them (q_a, q_b, o, the MLPs,
  # the experts); kv_a's 128 + 64 rows end in a partial block and keep the scaled XLA path.
  return PRESETS["tiny-mla"].replace(
      hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=2, fp8_block=(128, 128),
      mla=dict(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
               v_head_dim=128),
      moe=dict(intermediate_size=128))


def _llm(**kwargs):
  return jspec.LLM.from_random(_tiny_fp8_mla(), jspec.MTPSpec("deepseek_v3", 1, is_moe=True),
                               dtype="float32", seed=5, max_model_len=64, max_num_seqs=2,
                               attention_backend="xla",
                               speculative_config={"method": "mtp",
                                                   "num_speculative_tokens": 2}, **kwargs)


def test_fp8_kernels_in_the_model_equal_the_scaled_xla_products(monkeypatch):
  """The GPU's choices, the row kernels included: the FP8 products through the few-row
  kernel, and the decode steps' experts read their scales' lanes made before the loop."""
  cpu = _llm()
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)  # the GPU's choices, interpreted
    # the activations as they are, as XLA's scaled products take them (the norms' e4m3 rows:
    # test_e4m3_rows, test_moe_e4m3)
    patch.setattr(backends, "FP8_E4M3_ROWS", False)
    gpu = _llm(norm_backend="pallas")
  projections = [node.fp8_projection for _, node in nnx.iter_graph(gpu.target)
                 if isinstance(node, (MLAttention, MLP))]
  assert projections and all(p is not None for p in projections)
  assert gpu.target.layers[1].mlp.fp8_to_backend and not cpu.target.layers[1].mlp.fp8_to_backend
  by_expert = []  # per decode-size expert product: whether its scales' lanes were made before

  def spy(x, weights, *args, products=fp8_experts.slot_products, **kwargs):
    if x.dtype != jnp.float8_e4m3fn:
      by_expert.append(all(w.lanes is not None for w in weights))
    return products(x, weights, *args, **kwargs)

  monkeypatch.setattr(fp8_experts, "slot_products", spy)
  _assert_same_outputs(cpu, gpu, max_tokens=4)
  assert any(by_expert)  # the decode steps' experts read scale lanes made before their loop


def test_bench_steps_read_the_scale_lanes_made_before_their_loop(monkeypatch):
  """`jspec bench` times the steps as `generate` runs them: every FP8 kernel call of its target
  and MTP step programs reads block scales repeated over the kernel's lanes once, before the
  loop of steps (projections.with_loop_constants), not a repeat inside every step."""
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)  # the GPU's choices, traced on the CPU
    llm = _llm()
  lanes = []
  for name in ("fp8_matmul", "fp8_matmul_many"):
    def spy(*args, kernel=getattr(fp8_gemm, name), lanes_NbX=None, **kwargs):
      lanes.extend(lanes_NbX if isinstance(lanes_NbX, tuple) else [lanes_NbX])
      return kernel(*args, lanes_NbX=lanes_NbX, **kwargs)
    monkeypatch.setattr(fp8_gemm, name, spy)
  timer, batch, slots = StepTimer(llm), 2, 64
  tokens_BT, positions_BT = jnp.ones((batch, 1), jnp.int32), jnp.full((batch, 1), 9, jnp.int32)
  caches = jax.eval_shape(lambda: llm.target.init_caches(batch, slots, llm.dtype))
  jax.eval_shape(timer._target_steps(slots), timer.target_state, caches, tokens_BT, positions_BT)
  target_calls = len(lanes)
  draft_cache = jax.eval_shape(lambda: llm.mtp.init_caches(batch, slots, llm.dtype)[0])
  hidden_BTD = jnp.zeros((batch, 1, llm.config.hidden_size), llm.dtype)
  jax.eval_shape(timer._mtp_steps(slots), timer.target_state, timer.mtp_state, draft_cache,
                 tokens_BT, hidden_BTD, positions_BT)
  assert 0 < target_calls < len(lanes)
  assert all(prepared is not None for prepared in lanes)


def _tiny_fp8_hybrid():
  # One Gated DeltaNet and one gated-attention layer, every projection whole 128 x 128 blocks:
  # in_proj [1 key head, q | k | v | z = 4 x 128, 128], out_proj [128, 128], q [2 x 128, 128].
  return PRESETS["qwen3.5-9b"].replace(vocab_size=512, hidden_size=128, intermediate_size=256,
      num_layers=2, layer_types=("linear_attention", "full_attention"), num_heads=1,
      num_kv_heads=1, head_dim=128,
      fp8_block=(128, 128),
      linear=dict(num_key_heads=1, num_value_heads=1))


def test_fp8_kernel_in_a_hybrid_model_equals_the_scaled_xla_products(monkeypatch):
  """The GPU's choices, the row kernels included: the linear attention's, the gated
  attention's and the MLPs' FP8 products through the few-row kernel."""
  def llm(**kwargs):
    return jspec.LLM.from_random(_tiny_fp8_hybrid(), jspec.MTPSpec("qwen3_next", 1, is_moe=False),
                                 dtype="float32", seed=3, max_model_len=64, max_num_seqs=2,
                                 attention_backend="xla",
                                 speculative_config={"method": "mtp",
                                                     "num_speculative_tokens": 2}, **kwargs)

  cpu = llm()
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)  # the GPU's choices, interpreted
    # the activations as they are (the e4m3 rows have tests of their own: test_e4m3_rows.py)
    patch.setattr(backends, "FP8_E4M3_ROWS", False)
    gpu = llm(norm_backend="pallas")
  kinds = {type(node) for _, node in nnx.iter_graph(gpu.target)
           if isinstance(node, (GatedDeltaNet, Attention, MLP)) and node.fp8_projection}
  assert {GatedDeltaNet, MLP} <= kinds and any(issubclass(k, Attention) for k in kinds)
  # The attention's q, k and v go to the kernel as one call (fp8_gemm.fp8_matmul_many).
  weight_counts = []
  shared = {id(node.fp8_projection): node.fp8_projection
            for _, node in nnx.iter_graph(gpu.target) if isinstance(node, Attention)}
  for projection in shared.values():  # the layers of one mesh share one
    many = projection.many
    projection.many = lambda x, w8s, *rest, many=many, **kwargs: (
        weight_counts.append(len(w8s)) or many(x, w8s, *rest, **kwargs))
  _assert_same_outputs(cpu, gpu, max_tokens=4)
  assert weight_counts and set(weight_counts) == {3}


def test_k_slice_sums_left_to_elementwise_readers(monkeypatch):
  """An FP8 kernel call's K-slice sum stays a kernel of its own (fp8_gemm.fp8_matmul's
  sum_apart) only where a norm reduces over the product's row next (o_proj and down_proj
  where the row kernels are off, the linear attention's out_proj); the sums of gate / up
  (read by SwiGLU) and of q, k, v (read by their norms, RoPE and the cache writes) go into
  their readers' fusions."""
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)  # the GPU's choices, traced on the CPU
    llm = jspec.LLM.from_random(_tiny_fp8_hybrid(), jspec.MTPSpec("qwen3_next", 1, is_moe=False),
                                dtype="float32", seed=3, max_model_len=64, max_num_seqs=2,
                                attention_backend="xla")
  apart = {}

  def record(names, flag):
    for name in names:
      assert apart.setdefault(name, flag) == flag

  for module in (layers, mlp, gated_deltanet, linear):  # linear: o_proj's, down_proj's (to_norm)
    one = module.project_named
    monkeypatch.setattr(module, "project_named", lambda layer, x, name, *a, _one=one, **kw: (
        record([name], kw.get("fp8_sum_apart", True)) or _one(layer, x, name, *a, **kw)))
  many = layers.project_many_named
  monkeypatch.setattr(layers, "project_many_named", lambda layer, x, specs, *a, **kw: (
      record([n for n, _ in specs], kw.get("fp8_sum_apart", True))
      or many(layer, x, specs, *a, **kw)))
  llm.compute_logits(PROMPTS[:1])
  assert apart == {"q_proj": False, "k_proj": False, "v_proj": False, "gate_up_proj": False,
                   "o_proj": True, "down_proj": True, "in_proj": True, "out_proj": True}


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("config, mtp", [
    (_tiny_fp8_mla, jspec.MTPSpec("deepseek_v3", 1, is_moe=True)),
    (_tiny_fp8_hybrid, jspec.MTPSpec("qwen3_next", 1, is_moe=False))], ids=["mla", "hybrid"])
def test_on_the_gpu_fp8_kernels_equal_the_scaled_xla_products(config, mtp, monkeypatch):
  """The compiled kernels (registers, TMA, wgmma) where the tests above interpret them (the
  activations as they are, as there)."""
  monkeypatch.setattr(backends, "FP8_E4M3_ROWS", False)
  def llm(backend):
    return jspec.LLM.from_random(config(), mtp, dtype="float32", seed=3, max_model_len=64,
                                 max_num_seqs=2, projection_backend=backend,
                                 speculative_config={"method": "mtp",
                                                     "num_speculative_tokens": 2})

  xla, kernels = llm("xla"), llm("auto")
  assert all(node.fp8_projection is None for _, node in nnx.iter_graph(xla.target)
             if hasattr(node, "fp8_projection"))
  assert any(node.fp8_projection is not None for _, node in nnx.iter_graph(kernels.target)
             if hasattr(node, "fp8_projection"))
  _assert_same_outputs(xla, kernels, max_tokens=6)


def _tiny_fp8_qwen3():
  # q [2 x 128, 128], k and v [128, 128]: whole 128 x 128 blocks for the one q / k / v call.
  return PRESETS["qwen3-8b"].replace(vocab_size=512, hidden_size=128, intermediate_size=256,
                                     num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
                                     fp8_block=(128, 128))


def _qwen3_llm(**kwargs):
  return jspec.LLM.from_random(_tiny_fp8_qwen3(), dtype="float32", seed=4, max_model_len=64,
                               max_num_seqs=2, attention_backend="xla",
                               speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 2}, **kwargs)


def test_fp8_q_k_v_partials_summed_in_the_norm_kernel_equal_the_scaled_xla_products(
    monkeypatch):
  """With the row kernels on, a plain attention layer's q, k and v are one FP8 kernel call
  whose K-slice partials the q / k norm and RoPE kernel sums as it reads them
  (row_norms.qkv_partials_norm_rope: no sum of XLA's), which also writes its keys and values
  into the cache (no KV write kernel); decode and the n-gram verify windows give the CPU
  configuration's logits and tokens."""
  cpu = _qwen3_llm()
  with monkeypatch.context() as patch:
    patch.setattr(platform, "on_hopper", lambda: True)  # the GPU's choices, interpreted
    patch.setattr(backends, "FP8_E4M3_ROWS", False)  # as in the hybrid model's test
    gpu = _qwen3_llm(norm_backend="pallas")
  attn = gpu.target.layers[0].attn
  assert attn.fp8_qkv_kernel is not None and attn.kv_write is not None
  assert attn.qk_kernel_above == fp8_gemm.MAX_ROWS  # the kernel for more rows only
  assert cpu.target.layers[0].attn.fp8_qkv_kernel is None
  def summed_products(*args, **kwargs):
    raise AssertionError("q, k and v were summed before the kernel")

  x = jnp.ones((2, 3, 128), jnp.float32)
  with monkeypatch.context() as patch:
    patch.setattr(fp8_gemm, "_products", summed_products)
    project = str(jax.make_jaxpr(attn._project_rotated)(x, jnp.zeros((2, 3), jnp.int32)))
  assert "qkv_partials_norm_rope" in project
  zeros = jnp.zeros((2, attn.num_kv_heads, 32, attn.head_dim), jnp.float32)
  step = str(jax.make_jaxpr(lambda x, c: attn(x, jnp.zeros((2, 3), jnp.int32), c, 32))(
      x, KVCache(zeros, zeros)))
  assert "qkv_partials_norm_rope" in step and "write_kv" not in step
  _assert_same_outputs(cpu, gpu, max_tokens=4)


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_q_k_v_kernel_writes_the_caches_as_the_kv_write_kernel(monkeypatch, tp):
  """sharded_fp8_qkv_norm_rope(caches=): q as without, the caches those kv_write gives with
  its k and v, bit for bit: from the same kernel where the cache's KV heads are whole (tp = 1),
  by kv_write where tp splits them (the FP8 call's heads are whole on every shard). At tp = 2
  the FP8 call's partials are XLA's product of the scaled weights (one slice): the Mosaic GPU
  interpreter runs on one device."""
  if tp > 1:
    def one_slice(x_MK, w8s, scales, lanes):
      w = jnp.concatenate([w.astype(jnp.float32) * jnp.repeat(s, 128, 0)[:, :1]
                           for w, s in zip(w8s, scales)])
      return (x_MK @ w.T).T[None], None
    monkeypatch.setattr(fp8_gemm, "fp8_partials_many", one_slice)
  mesh, rules = jspec.MeshConfig(tp=tp).make_mesh(), ShardingRules()
  call = fp8_row_kernels.sharded_fp8_qkv_norm_rope(mesh, rules, 1e-6, 1e6, interpret=True)
  rng = np.random.default_rng(7)
  b, t, d, h, kv_heads, q_heads, slots = 2, 3, 128, 128, 2, 4, 16
  w8s = tuple(jnp.asarray(rng.standard_normal((n * h, d)) * 0.3, jnp.float8_e4m3fn)
              for n in (q_heads, kv_heads, kv_heads))
  scales = tuple(jnp.asarray(rng.uniform(0.5, 2, (n, 1)), jnp.float32)
                 for n in (q_heads, kv_heads, kv_heads))
  x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  positions = jnp.asarray([[3, 4, 5], [slots + 2, 0, 1]])  # one out of the cache: dropped
  norms = [jnp.asarray(1 + 0.1 * rng.standard_normal(h), jnp.float32) for _ in "qk"]
  caches = tuple(jnp.asarray(rng.standard_normal((b, kv_heads, slots, h)), jnp.float32)
                 for _ in "kv")
  args = (x, w8s, scales, None, positions, *norms)
  q, k, v = call(*args, q_heads=q_heads, kv_heads=kv_heads)
  want = row_kernels.sharded_kv_write(mesh, rules, True)(*caches, k, v, positions)
  got_q, *got = call(*args, q_heads=q_heads, kv_heads=kv_heads, caches=caches)
  np.testing.assert_array_equal(np.asarray(got_q), np.asarray(q))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_hopper(), reason="needs a Hopper GPU")
def test_on_the_gpu_fp8_q_k_v_partials_equal_the_scaled_xla_products(monkeypatch):
  """Compiled: the FP8 q / k / v call's partials through the norm and RoPE kernel (Triton)
  give the XLA products' logits and tokens (the activations as they are)."""
  monkeypatch.setattr(backends, "FP8_E4M3_ROWS", False)
  xla, kernels = _qwen3_llm(projection_backend="xla"), _qwen3_llm()
  assert kernels.target.layers[0].attn.fp8_qkv_kernel is not None
  assert xla.target.layers[0].attn.fp8_qkv_kernel is None
  _assert_same_outputs(xla, kernels, max_tokens=6)
