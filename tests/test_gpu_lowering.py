"""The decode step's GPU kernels as a Hopper GPU would be handed them, lowered on a machine
without one: the Triton and Mosaic GPU lowerings (which run in Python, where a form a kernel
cannot take fails) for every layout, row count and route the models use, with no interpreter.

The rest of the CPU suite runs these kernels in interpret mode, which checks their numbers but
not that the GPU's compiler takes them: a kernel change that the interpreter runs and the
lowering refuses would otherwise first fail on a GPU runner. What lowering does not check:
the PTX compile and the run itself (`make test-gpu`)."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
from jax._src.pallas.triton import gpu_info as triton_gpu_info

import jspec
from jspec.bench.collectives import step_programs
from jspec.bench.presets import PRESETS
from jspec.models.mla import kv_a_width
from jspec.pallas_kernels import (decode_routing, fp8_experts, fp8_gemm, fp8_layout, norm_router,
                                  platform, residual_norm, row_norms)
from jspec.pallas_kernels.fp8_experts import Fp8Experts, experts_fp8_decode
from jspec.pallas_kernels import short_attention as short_lib

S = jax.ShapeDtypeStruct
E4M3 = jnp.float8_e4m3fn
H200_SMS = 132


# jspec's short-context attention and its merge are Pallas Triton kernels, whose lowering warns
# of that backend's deprecation at every call.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.fixture(scope="module")
def as_on_hopper():
  """The kernels' view of the device made an H200's: on a GPU, Hopper, 132 SMs, no interpreter;
  Triton's and cuDNN's lowerings told they target compute capability 9.0. JAX's caches emptied
  before and after the module: no trace of a kernel made for the GPU outlives it into a CPU
  test, and no interpreted one made before it is lowered here."""
  jax.clear_caches()
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(platform, "on_gpu", lambda: True)
    patch.setattr(platform, "on_hopper", lambda: True)
    patch.setattr(platform, "num_sms", lambda: H200_SMS)
    patch.setattr(platform, "device_kind", lambda: "NVIDIA H200")
    patch.setattr(platform, "interpret_params", lambda: None)
    patch.setattr(triton_gpu_info, "get_gpu_info", lambda: triton_gpu_info.GpuInfo(
        gpu_version=None, arch_name="9.0", compute_capability=90))
    # cuDNN's fused attention (prefill chunks) asks the device for its version and capability
    patch.setattr(cudnn_attention, "check_cudnn_version", lambda: 91000)
    patch.setattr(cudnn_attention, "check_compute_capability",
                  lambda capability: tuple(map(int, capability.split("."))) <= (9, 0))
    patch.setattr(cudnn_attention, "is_cuda_compute_capability_equal",
                  lambda capability: capability == "9.0")
    yield
  jax.clear_caches()


def lowered_kernels(fn, *args) -> list[str]:
  """The Pallas kernels' custom calls of fn(*args) lowered for CUDA, in order."""
  return _kernel_calls(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text())


def _kernel_calls(text: str) -> list[str]:
  """A lowered module's Pallas kernel calls; it must hold no host callback (an interpreted
  kernel)."""
  assert "callback" not in text
  return re.findall(r"custom_call @(__gpu\$xla\.gpu\.triton|mosaic_gpu\w*)", text)


def _call_sites(text: str, marker: str) -> int:
  """Calls of the functions whose bodies hold `marker` (a kernel's name, inside its module): the
  lowered text holds each distinct kernel once, in a function that each call site calls."""
  funcs = re.split(r"(?=func\.func )", text)[1:]
  names = [re.match(r"func\.func \w+ @([\w$.-]+)", f).group(1) for f in funcs if marker in f]
  return sum(len(re.findall(rf"call @{re.escape(name)}\(", text)) for name in names)


QWEN3_8B_QKV = (4096, (4096, 1024, 1024))  # K, the weights' N: q, k and v


@pytest.mark.usefixtures("as_on_hopper")
@pytest.mark.parametrize("rows", [1, 8, 17, 32, 64])
@pytest.mark.parametrize("rows_first", [False, True])
@pytest.mark.parametrize("e4m3_x", [False, True])
def test_fp8_products_lower_at_every_row_count(monkeypatch, rows, rows_first, e4m3_x):
  """The few-row FP8 kernel at Qwen3-8B's q / k / v: bf16 x, or e4m3 x with its lanes (a norm
  kernel's rows), partials rows last or first; K slices as chosen, and balanced runs where
  PARTIALS_SHARE caps the slices (past 16 rows), and two K blocks a step at every row count
  (TWO_BLOCK_MAX_ROWS): one Mosaic GPU call each."""
  k, ns = QWEN3_8B_QKV
  weights = tuple(S((n, k), E4M3) for n in ns)
  scales = tuple(S((n // 128, k // 128), jnp.float32) for n in ns)
  x = S((rows, k), E4M3 if e4m3_x else jnp.bfloat16)
  lanes = S((fp8_gemm.act_lanes_size(rows, k),), jnp.float32) if e4m3_x else None
  layouts = []
  for share in (None, 0.25):
    monkeypatch.setattr(fp8_layout, "PARTIALS_SHARE", share)
    layouts.append(fp8_layout.choose_layout(k, sum(ns), H200_SMS, rows))
    call = functools.partial(fp8_gemm.fp8_partials_many.__wrapped__, rows_first=rows_first)
    if e4m3_x:
      kernels = lowered_kernels(lambda x, w, s, a: call(x, w, s, act_lanes_X=a), x, weights,
                                scales, lanes)
    else:
      kernels = lowered_kernels(call, x, weights, scales)
    assert len(kernels) == 1 and kernels[0].startswith("mosaic_gpu")
  # past 16 rows the kernel pads to 32 and more: there the cap's balanced runs were lowered
  assert layouts[1][1] == (rows > 16)
  monkeypatch.setattr(fp8_gemm, "TWO_BLOCK_MAX_ROWS", fp8_gemm.MAX_ROWS)  # two blocks a step
  assert fp8_gemm.default_tiling(rows).blocks_per_step == 2
  assert len(lowered_kernels(fp8_gemm.fp8_partials_many.__wrapped__, S((rows, k), jnp.bfloat16),
                             weights, scales)) == 1


# (tokens, split): decode steps and verify windows, whole or split over programs.
ATTENTION_FORMS = [(1, False), (1, True), (4, False), (4, True), (3, True)]


@pytest.mark.usefixtures("as_on_hopper")
@pytest.mark.parametrize("tokens, split", ATTENTION_FORMS)
@pytest.mark.parametrize("batch", [1, 8])
def test_short_attention_lowers_in_every_layout(tokens, split, batch):
  """Qwen3-8B's heads (8 KV heads of 4 queries, 128 wide) over 1024 slots: grouped or token by
  token, with o_proj's e4m3 rows or without, two copies of a batch-1 row; split calls add the
  merge (its e4m3 form where the kernel quantizes)."""
  kv_heads, group, head_dim, slots = 8, 4, 128, 1024
  q = S((batch, kv_heads * tokens * group, head_dim), jnp.bfloat16)
  cache = S((batch, kv_heads, slots, head_dim), jnp.bfloat16)
  start = S((batch,), jnp.int32)
  splits = dict(splits=4, block_slots=64) if split else dict(splits=1)
  forms = [dict(), dict(token_major=True), dict(quantize=True),
           dict(quantize=True, token_major=True)]
  if batch == 1:
    forms.append(dict(copies=2))
  for form in forms:
    call = functools.partial(short_lib.short_attention.__wrapped__, group=group, scale=0.088,
                             **splits, **form)
    kernels = lowered_kernels(call, q, cache, cache, start)
    assert len(kernels) == (2 if split else 1), form


@pytest.mark.usefixtures("as_on_hopper")
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_norm_kernels_lower_with_their_e4m3_rows(rows):
  """The norms that hand the next FP8 product its e4m3 rows at Qwen3-8B's width: the plain
  norm (a first layer's input) and the norm that adds o_proj's or down_proj's K-slice partials
  (rows first); and q / k / v's norm + RoPE kernel on the partials of their product (rows
  last)."""
  width, heads, kv_heads, head_dim, slices = 4096, 32, 8, 128, 8
  x = S((rows, width), jnp.bfloat16)
  scale = S((width,), jnp.bfloat16)
  padded = decode_routing.padded_tokens(rows)
  norm = functools.partial(residual_norm.rms_norm, eps=1e-6, quantize=True)
  assert len(lowered_kernels(norm, x, scale)) == 1
  parts_SRD = S((4, padded, width), jnp.float32)
  add = functools.partial(residual_norm.add_partials_rms_norm, dtype=jnp.bfloat16, eps=1e-6,
                          quantize=True)
  assert len(lowered_kernels(add, x, parts_SRD, scale)) == 1
  parts_SNR = S((slices, (heads + 2 * kv_heads) * head_dim, padded), jnp.float32)
  qkv = functools.partial(row_norms.qkv_partials_norm_rope, q_heads=heads, kv_heads=kv_heads,
                          dtype=jnp.bfloat16, theta=1e6)
  norm_scale = S((head_dim,), jnp.bfloat16)
  assert len(lowered_kernels(qkv, parts_SNR, S((rows,), jnp.int32), None, norm_scale,
                             norm_scale)) == 1


@pytest.mark.usefixtures("as_on_hopper")
@pytest.mark.parametrize("rows", [1, 8])
def test_a_moe_layers_norm_and_router_lowers_with_its_e4m3_rows(rows):
  """The MoE layer's residual add, norm and router partials in one kernel at Qwen3-30B-A3B's
  width and experts (2048 wide, 128 experts), with the experts' e4m3 rows and without."""
  width, experts = 2048, 128
  x = S((rows, width), jnp.bfloat16)
  router = S((width, experts), jnp.bfloat16)
  for quantize in (False, True):
    call = functools.partial(norm_router.add_norm_router_partials, eps=1e-6, quantize=quantize)
    assert len(lowered_kernels(call, x, x, S((width,), jnp.bfloat16), router)) == 1


# Small models of each family in the presets' layer types and head widths (2 layers, 4 for the
# hybrid's 3 Gated DeltaNet layers and 1 gated attention layer; narrower widths, a 4096-token
# vocabulary), each with an MTP head.
R = dataclasses.replace
SMALL_MODELS = {
    "qwen3": R(PRESETS["qwen3-8b"], vocab_size=4096, hidden_size=1024, intermediate_size=3072,
               num_layers=2, num_heads=8, num_kv_heads=2),
    "qwen3_moe": R(PRESETS["qwen3-30b-a3b"], vocab_size=4096, hidden_size=1024, num_layers=2,
                   num_heads=8, num_kv_heads=1,
                   moe=R(PRESETS["qwen3-30b-a3b"].moe, num_experts=16, num_experts_per_tok=4,
                         intermediate_size=256)),
    "qwen3_5_moe": R(PRESETS["qwen3.5-35b-a3b"], vocab_size=4096, hidden_size=1024,
                     num_layers=4, num_heads=8, num_kv_heads=2,
                     layer_types=("linear_attention",) * 3 + ("full_attention",),
                     moe=R(PRESETS["qwen3.5-35b-a3b"].moe, num_experts=16,
                           num_experts_per_tok=4, intermediate_size=256,
                           shared_expert_intermediate_size=256),
                     linear=R(PRESETS["qwen3.5-35b-a3b"].linear, num_key_heads=4,
                              num_value_heads=8)),
    "deepseek_v3": R(PRESETS["deepseek-v3"], vocab_size=4096, hidden_size=1024,
                     intermediate_size=2048, num_layers=2, num_heads=16, num_kv_heads=16,
                     moe=R(PRESETS["deepseek-v3"].moe, num_experts=16, num_experts_per_tok=4,
                           intermediate_size=256, n_group=4, topk_group=2,
                           first_k_dense_replace=1),
                     mla=R(PRESETS["deepseek-v3"].mla, q_lora_rank=512)),
}
# A decode step's attention kernel by family; every family's MoE layers route in the norm's
# kernel where their router is a softmax's.
ATTENTION_KERNEL = {"qwen3": "short_attention", "qwen3_moe": "short_attention",
                    "qwen3_5_moe": "short_attention", "deepseek_v3": "mla_flash_decode"}


@pytest.mark.usefixtures("as_on_hopper")
@pytest.mark.parametrize("family, fp8, mesh", [
    ("qwen3", True, "dp1-tp1-ep1"), ("qwen3_moe", True, "dp1-tp1-ep1"),
    ("qwen3_5_moe", True, "dp1-tp1-ep1"),
    ("deepseek_v3", True, "dp1-tp1-ep1"), ("qwen3", False, "dp1-tp1-ep1"),
    ("qwen3_moe", False, "dp1-tp1-ep1"), ("qwen3", False, "dp1-tp2-ep1"),
    ("qwen3_moe", False, "dp1-tp1-ep2"), ("qwen3", True, "dp1-tp2-ep1"),
    ("qwen3_moe", True, "dp1-tp2-ep1"), ("deepseek_v3", True, "dp1-tp2-ep1")])
def test_a_models_step_programs_lower_with_the_gpus_kernels(family, fp8, mesh):
  """An LLM built as on H200s (the default backends choosing the GPU's kernels, the tp and ep
  collectives jspec's own where it has them), its decode, verify (4 tokens), MTP draft and
  prefill-chunk steps at its least batch (decode and verify at 8 too) lowered for CUDA: every
  kernel compiled for the GPU (no interpreter), the attention kernel in decode, verify and
  draft steps, MoE layers' norm + router kernel, the FP8 kernels in every FP8 step (the few-row
  one in decode, verify and draft steps, shard by shard at tp = 2, MLA's latent products too),
  on one GPU a dense FP8 MLP's SwiGLU kernel for down_proj's e4m3 rows, at tp = 2 each layer's
  row products summed in the next norm's kernel (FP8's too), and cuDNN's
  fused attention in prefill chunks."""
  config = SMALL_MODELS[family]
  if fp8:
    config = R(config, fp8_block=(128, 128))
  dp, tp, ep = (int(part[2:]) for part in mesh.split("-"))
  mtp = jspec.MTPSpec("deepseek_v3" if config.mla else "qwen3_next", 1, is_moe=config.is_moe)
  llm = jspec.LLM.from_random(config, mtp, max_model_len=1024, max_num_seqs=8,
                              mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep),
                              speculative_config={"method": "mtp",
                                                  "num_speculative_tokens": 3})
  # batch 8: the steps whose kernels take other forms at several rows (e4m3 rows, windows)
  least = dp * ep  # sequences are split over dp x ep
  for batch, kinds in ((least, ("decode", "verify", "draft", "prefill")),
                       (8, ("decode", "verify"))):
    steps = step_programs(llm, batch, k=3, context=512, traced=True, kinds=kinds)
    assert sorted(steps) == sorted(kinds)
    for kind, traced in steps.items():
      text = traced.lower(lowering_platforms=("cuda",)).as_text()
      calls = _kernel_calls(text)
      names = set(re.findall(r'name = "(\w+)"', text))
      assert not fp8 or any(c.startswith("mosaic_gpu") for c in calls), (batch, kind)
      # the few-row FP8 kernel (named in its Mosaic module) in every FP8 step, at tp too
      assert not fp8 or kind == "prefill" or "fp8_block_gemm" in text, (batch, kind)
      if config.mla and fp8 and kind != "prefill":  # q_a and kv_a in one call, at tp too
        n = config.mla.q_lora_rank + kv_a_width(config)
        assert f"fp8_block_gemm_{config.hidden_size}x{n}" in text, (batch, kind)
      if kind == "prefill":
        assert "__cudnn$fmha" in text, batch
        continue
      assert any(n.startswith(ATTENTION_KERNEL[family]) for n in names), (batch, kind, names)
      if fp8 and tp == 1 and kind != "draft" and (config.moe is None
                                                  or config.moe.first_k_dense_replace):
        # a dense FP8 MLP's down_proj on the SwiGLU kernel's e4m3 rows (FP8_E4M3_SWIGLU)
        assert "swiglu_e4m3" in names, (batch, kind, names)
      if tp > 1:  # o_proj's and dense MLPs' down_proj's shard sums in the next norm's kernel;
        # a MoE layer's o_proj's in its norm + router kernel where it has one (summed first)
        layers = 1 if kind == "draft" else config.num_layers  # a draft step: the MTP head's
        dense = (layers if config.moe is None
                 else 0 if kind == "draft" else config.moe.first_k_dense_replace)
        routed_in_norm = family in ("qwen3_moe", "qwen3_5_moe")
        fused = _call_sites(text, "workspace_add_norm")
        assert fused >= 2 * dense + (0 if routed_in_norm else layers - dense), (kind, fused)
        assert config.moe or not any(n.startswith("add_rms_norm") for n in names), names
      if family in ("qwen3_moe", "qwen3_5_moe"):
        assert any(n.startswith("add_norm_router") for n in names), (batch, kind, names)


@pytest.mark.usefixtures("as_on_hopper")
@pytest.mark.parametrize("rows_first", [False, True])
@pytest.mark.parametrize("experts, hidden, ffn, e4m3_act", [(128, 2048, 768, False),
                                                            (256, 7168, 2048, True)])
def test_the_fp8_experts_decode_path_lowers(monkeypatch, rows_first, experts, hidden, ffn,
                                            e4m3_act):
  """One token's experts at Qwen3-30B-A3B's and DeepSeek-V3's shapes lowered for an H200, the
  partials rows first or last: the gate / up and down Mosaic GPU calls, and the activation
  kernel in its e4m3 form where the rule takes it (DeepSeek-V3's one K slice) only."""
  monkeypatch.setattr(fp8_experts, "GATE_UP_ROWS_FIRST", rows_first)

  def weight(out, inner):
    blocks = (experts, out // 128, inner // 128)
    lanes = (*blocks[:2], blocks[2] * fp8_gemm.SCALE_LANES)
    return Fp8Experts(S((experts, out, inner), E4M3), S(blocks, jnp.float32),
                      S(lanes, jnp.float32))

  args = (S((1, hidden), jnp.bfloat16), S((1, 8), jnp.int32), S((1, 8), jnp.float32),
          weight(ffn, hidden), weight(ffn, hidden), weight(hidden, ffn))
  text = jax.jit(experts_fp8_decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert sum(k.startswith("mosaic_gpu") for k in _kernel_calls(text)) == 2
  assert ("expert_gate_up_act_e4m3" in text) == e4m3_act
