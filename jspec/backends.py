"""Kernel backends put into a built model's layers: experts, decode attention, projections,
and how linear-attention layers commit a verify window.

Each function walks the NNX graphs of the target and the drafter and sets a layer's backend
attribute; the layers read them when they run (jspec.models). Nothing here reads weights.
"""

from __future__ import annotations

from flax import nnx

from jspec.models.decode_attention import (sharded_mla_decode, sharded_short_attention,
                                           sharded_window_attention)
from jspec.models.gated_deltanet import GatedDeltaNet
from jspec.models.layers import Attention
from jspec.models import mlp
from jspec.models.mlp import MLP
from jspec.models.mla import MLAttention
from jspec.models.norms import RMSNorm
from jspec.models.prefill_attention import cudnn_version, fits_cudnn, sharded_prefill_attention
from jspec.models.moe import MoE
from jspec.models.moe_backends import get_experts_fn
from jspec.models.projections import sharded_fp8_projection, sharded_projection, weights_replicated
from jspec.models import row_kernels
from jspec.models.fp8_row_kernels import (sharded_fp8_add_rms_norm, sharded_fp8_qkv_norm_rope,
                                        sharded_fp8_swiglu, takes_fp8_qkv_kernel)
from jspec.models import fp8_tensor_parallel
from jspec.models.row_kernels import (resolve_norm_backend, sharded_kv_write,
                                      sharded_norm_router, sharded_router, sharded_qk_norm_rope,
                                      sharded_qkv_norm_rope, sharded_rms_norm, sharded_swiglu)
from jspec.pallas_kernels import fp8_gemm, platform
from jspec.sharding.moe import needs_shard_map, per_token_shard, sharded_experts
from jspec.sharding.rules import axis_size
from jspec.sharding.tensor_parallel import resolve_all_reduce_backend, tensor_parallel_products
from jspec.sharding.vocab import sharded_embedding_lookup

# "auto"'s limit on an MLA window's query rows per shard for the latent kernel.
MLA_KERNEL_MAX_ROWS = 128


def _modules(pairs):
  return [(module, rules) for module, rules in pairs if module is not None]


def set_recurrent_commit(target, mode: str):
  """How linear-attention layers keep a verify window until commit (jspec.models.caches):
  "replay" reruns the emitted positions from the state before the window, "store" keeps
  the state after every position and picks one."""
  for _, node in nnx.iter_graph(target):
    if isinstance(node, GatedDeltaNet):
      node.commit_mode = mode


def use_vocab_lookup(mesh, pairs, custom_all_reduce: bool = False):
  """Models whose mesh splits the vocabulary look tokens up shard by shard
  (jspec.sharding.vocab says why), their sum through the workspace all-reduce where
  `custom_all_reduce`."""
  for module, rules in _modules(pairs):
    for _, node in nnx.iter_graph(module):
      if hasattr(node, "embedding_lookup") and hasattr(node, "embed"):
        rows_axis = node.embed.get_metadata()["logical_axes"][0]
        node.embedding_lookup = sharded_embedding_lookup(mesh, rules, custom_all_reduce,
                                                         rows_axis)


def use_experts(moe_backend: str, mesh, ep_strategy: str, target_and_rules, draft_and_rules,
                custom_all_reduce: bool = False):
  """(experts_fn, draft_experts_fn): the backend's expert product, wrapped in a shard_map over
  the expert axes where the mesh has them; each MoE layer told its expert shards.
  `custom_all_reduce`: its collectives through the workspace kernel (jspec.sharding.moe)."""
  base_experts = get_experts_fn(moe_backend)
  for module, rules in _modules((target_and_rules, draft_and_rules)):
    for _, node in nnx.iter_graph(module):
      if isinstance(node, MoE):
        node.expert_shards = axis_size(mesh, rules.experts)
        wrapper = per_token_shard(mesh, rules)
        if wrapper is not None:
          node.per_token_shard = wrapper
  if not needs_shard_map(mesh):
    return base_experts, base_experts
  return (sharded_experts(base_experts, mesh, target_and_rules[1], ep_strategy,
                          custom_all_reduce),
          sharded_experts(base_experts, mesh, draft_and_rules[1], ep_strategy,
                          custom_all_reduce))


def use_fused_prefill_attention(mesh, pairs):
  """Prefill chunks of the given (module, rules) pairs attend through cuDNN's fused attention
  (two XLA products in the same call off GPU): GQA layers (more than 64 query rows per KV
  head) and MLA layers' expanded form (more than 64 tokens), where cuDNN takes their heads.
  GQA's was measured faster than XLA's attention at every chunk size, MLA's at DeepSeek-V3's
  shapes in chunks of 256 (BENCHMARKS.md, "Prefill attention through cuDNN's fused kernel",
  "MLA prefill through cuDNN; …")."""
  interpret = not platform.on_gpu()
  implementation = "xla" if interpret else "cudnn"
  hopper, version = platform.on_hopper(), cudnn_version()
  for module, rules in _modules(pairs):
    prefill = sharded_prefill_attention(mesh, rules, implementation)
    mla_prefill = {}  # one call per softmax scale (every MLA layer of a model has the same)
    for _, node in nnx.iter_graph(module):
      if isinstance(node, Attention) and (interpret or fits_cudnn(node.head_dim, hopper)):
        node.prefill_attention = prefill
      elif isinstance(node, MLAttention) and (interpret or fits_cudnn(
          node.nope_dim + node.rope_dim, hopper, node.value_dim, version)):
        if node.scale not in mla_prefill:
          mla_prefill[node.scale] = sharded_prefill_attention(mesh, rules, implementation,
                                                              "BSKH", node.scale)
        node.prefill_attention = mla_prefill[node.scale]


def use_pallas_attention(mesh, pairs, explicit: bool = True):
  """Decode, verify and draft steps of the given (module, rules) pairs attend through the
  split-S kernels, laid out like their caches (interpreted off GPU, where Triton cannot compile
  them): GQA layers through `window_attention` (`explicit`; with "auto", through
  `short_attention` over short caches, XLA's path over longer ones), MLA layers through
  `mla_decode` where the compiled kernel takes their latent width
  (jspec.pallas_kernels.mla_decode.fits_kernel).
  Prefill chunks through cuDNN (use_fused_prefill_attention), whether or not `explicit`."""
  from jspec.pallas_kernels.mla_decode import fits_kernel
  from jspec.pallas_kernels.mla_decode_wgmma import fits_latent as fits_wgmma
  from jspec.pallas_kernels.short_attention import fits_heads
  interpret = not platform.on_gpu()
  use_fused_prefill_attention(mesh, pairs)
  for module, rules in _modules(pairs):
    kernel = sharded_window_attention(mesh, rules, interpret)
    short = sharded_short_attention(mesh, rules, interpret)
    for _, node in nnx.iter_graph(module):
      if isinstance(node, Attention) and explicit:
        node.window_attention = kernel
      elif isinstance(node, Attention) and fits_heads(node.head_dim):
        # "auto": GQA steps over short caches in one kernel; longer ones keep XLA's path
        # (BENCHMARKS.md, "Short-context decode attention in one kernel").
        node.short_attention = short
      elif isinstance(node, MLAttention) and (interpret or fits_kernel(node.latent_dim,
                                                                       node.rope_dim)):
        node.latent_kernel = sharded_mla_decode(mesh, rules, node.latent_dim, node.scale,
                                                interpret)
        if not explicit and not (platform.on_hopper()
                                 and fits_wgmma(node.latent_dim, node.rope_dim)):
          # "auto" without the wgmma form: the Triton form where it was measured faster
          # than XLA's path on an H200 (BENCHMARKS.md, "MLA decode attention"): windows of
          # up to 128 query rows per shard; wider ones (128 heads x 4 positions: 0.76-0.80x
          # at batch 8 and 32) keep XLA's. The wgmma form (windows of 64 rows and more)
          # was measured faster than XLA's at every window of 128 heads: no limit then.
          node.latent_kernel_max_rows = MLA_KERNEL_MAX_ROWS * axis_size(mesh, rules.q_heads)


def use_projections(backend: str, fp8_block, mesh, pairs, all_reduce_backend: str) -> str:
  """Sets the attention layers' projection product (jspec.models.projections); returns the
  backend in effect: "auto" becomes "pallas" on Hopper where the weights are whole on every
  shard (the kernel then takes only the products XLA would strength-reduce), else "xla".
  Where the mesh splits a model's weights over tp, `all_reduce_backend` (resolved by
  jspec.sharding.tensor_parallel.resolve_all_reduce_backend) "partitioner" leaves its products
  and their all-reduces to XLA's partitioner; "xla" or "kernel", or projection backend
  "pallas", gives it the shard-by-shard products of jspec.sharding.tensor_parallel, reduced by
  the workspace kernel where it is "kernel"."""
  all_reduce_backend = resolve_all_reduce_backend(all_reduce_backend, backend, mesh)
  forced = backend == "pallas"
  custom = all_reduce_backend == "kernel"
  if fp8_block is not None and backend != "xla":
    _use_fp8_projections(fp8_block, mesh, pairs)
  fp8_tp = fp8_tensor_parallel.block_for(fp8_block, backend)
  split = [module for module, rules in _modules(pairs)
           if _use_tensor_parallel(module, mesh, rules, custom, forced, fp8_tp)
           ] if forced or all_reduce_backend in ("xla", "kernel") else []
  if backend == "auto":
    replicated = all(weights_replicated(mesh, rules) or any(module is m for m in split)
                     for module, rules in _modules(pairs))
    backend = "pallas" if platform.on_hopper() and replicated else "xla"
  if backend == "xla":
    return backend
  for module, rules in _modules(pairs):
    if any(module is m for m in split):
      continue
    if not weights_replicated(mesh, rules):
      raise ValueError("projection_backend='pallas' needs the attention weights whole on "
                       "every shard, and this mesh splits them over tp; use 'auto' or 'xla'")
    kernel = sharded_projection(mesh, rules, always=forced)
    for _, node in nnx.iter_graph(module):
      if isinstance(node, Attention):
        node.projection = kernel
  return backend


def _use_tensor_parallel(module, mesh, rules, custom_all_reduce: bool, forced: bool,
                         fp8_block=None) -> bool:
  """Gives `module`'s GQA attention layers and dense MLPs (not an MoE layer's shared experts,
  whose sum XLA adds to the routed experts' first) the tensor-parallel products where the mesh
  splits them, with `fp8_block` their FP8 form (MLA layers that alone); whether it did."""
  products = tensor_parallel_products(mesh, rules, custom_all_reduce, kernel_always=forced)
  if products is None:
    return False
  shared = {id(getattr(node, name)) for _, node in nnx.iter_graph(module)
            if isinstance(node, MoE) for name in ("shared_expert", "shared_experts")
            if hasattr(node, name)}
  fp8 = fp8_block and fp8_tensor_parallel.Fp8TensorParallel(products, fp8_block) or None
  for _, node in nnx.iter_graph(module):
    if isinstance(node, (Attention, MLP)) and id(node) not in shared:
      node.tp_products, node.fp8_tp = products, fp8
    elif isinstance(node, MLAttention):
      node.fp8_tp = fp8
  return True


def _use_fp8_projections(fp8_block, mesh, pairs):
  """On a GPU, FP8 projections go to the FP8 kernels (a few rows: fp8_gemm; more: fp8_prefill)
  where the mesh keeps the weights whole on every shard (split over tp: _use_tensor_parallel's
  Fp8TensorParallel); elsewhere they are scaled before XLA's dot."""
  if not platform.on_hopper():
    return
  for module, rules in _modules(pairs):
    if not weights_replicated(mesh, rules):
      continue
    kernel = sharded_fp8_projection(mesh, rules, fp8_block)
    mlp_whole = axis_size(mesh, rules.mlp) == 1
    linear_heads_whole = axis_size(mesh, rules.linear_heads) == 1
    for _, node in nnx.iter_graph(module):
      if (isinstance(node, (Attention, MLAttention)) or (isinstance(node, MLP) and mlp_whole)
          or (isinstance(node, GatedDeltaNet) and linear_heads_whole)):
        node.fp8_projection = kernel


# o_proj's and a layer MLP's down_proj's FP8 K-slice partials, rows first, summed inside the
# residual add and RMSNorm kernel after them (residual_norm.add_partials_rms_norm) in place of
# a sum kernel of XLA's per product: a Qwen3-8B FP8 step at batch 1 2.6% shorter on an H200
# (BENCHMARKS.md, "FP8 o_proj and down_proj partials summed in the norm, rows first ...").
FP8_PARTIALS_IN_NORM = True
# The few-row FP8 products after a norm that sums an FP8 product's partials (q / k / v after
# the input norm, gate / up after the post-attention norm) multiply e4m3 activations on the
# FP8 tensor cores, quantized by that norm's kernel per row and 128 columns (the checkpoints'
# "dynamic" activation scheme, as transformers' FP8 layer, vLLM and SGLang run them; the
# prefill products already do): the tile's widening to bf16 leaves the product. Qwen3-8B FP8
# step at batch 1 on an H200 -2.1% (BENCHMARKS.md, "e4m3 activations for the FP8 few-row
# products ..."). down_proj's input (SwiGLU's) stays as it is.
FP8_E4M3_ROWS = True
# With FP8_E4M3_ROWS, o_proj's input too: a step's short-context attention kernel (or the merge
# after its splits) writes its output in e4m3 as well, for steps of at most 64 rows (decode,
# verify windows; Attention._quantizes_out).
FP8_E4M3_ATTENTION_OUT = True
# With it, a dense MLP's gate / up partials go to one kernel that sums them, applies SwiGLU and
# quantizes the activation for down_proj (jspec.pallas_kernels.swiglu_e4m3), in place of
# XLA's fusion of the sum and SwiGLU: Qwen3-8B FP8's profiled step 1.2 µs a layer shorter at
# batch 1 on an H100, unchanged at batch 8 (BENCHMARKS.md, "down_proj on e4m3 rows ...").
FP8_E4M3_SWIGLU = True


def use_row_kernels(backend: str, mesh, pairs) -> str:
  """Sets the norms' `row_kernel`, the attention layers' `qk_kernel` and `kv_write`, the
  softmax MoE layers' `router_kernel` and, where mlp.SWIGLU_KERNEL is on, the unquantized
  MLPs' (shared experts too) `swiglu_kernel` (jspec.models.row_kernels) where the backend is
  "pallas" and the shapes fit (the router whole on every shard); returns the backend in
  effect ("auto" resolved)."""
  from jspec.pallas_kernels.kv_write import fits_kernel as kv_fits
  from jspec.pallas_kernels.router_topk import fits_kernel as router_fits
  from jspec.pallas_kernels.residual_norm import fits_kernel
  from jspec.pallas_kernels.swiglu_gemm import takes_width as swiglu_takes_width
  backend = resolve_norm_backend(backend)
  if backend == "xla":
    return backend
  interpret = not platform.on_gpu()
  for module, rules in _modules(pairs):
    norms = {}  # one shard_map per (eps, form): the layers share them
    swiglu = None  # one shard_map for the MLPs (mlp.SWIGLU_KERNEL)
    kv_write = None  # the cache's slots and head_dim whole on every shard
    if axis_size(mesh, rules.cache_seq) == 1 and axis_size(mesh, rules.head_dim) == 1:
      kv_write = sharded_kv_write(mesh, rules, interpret)
    fp8_add_norm = sharded_fp8_add_rms_norm(mesh, rules, interpret)
    fp8_swiglu = None  # one shard_map for the MLPs (FP8_E4M3_SWIGLU)
    for path, node in nnx.iter_graph(module):
      # The norms of the hidden size only (layers, final, MTP and EAGLE heads): MLA's latent
      # norms read a slice of their projection's output, which a kernel would copy first.
      if (isinstance(node, RMSNorm) and node.axis_name == "embed"
          and axis_size(mesh, rules.embed) == 1 and fits_kernel(node.scale.shape[0])):
        form = (node.eps, node.zero_centered)
        if form not in norms:
          norms[form] = sharded_rms_norm(mesh, rules, node.eps, node.zero_centered, interpret)
        node.row_kernel = norms[form]
      if (FP8_PARTIALS_IN_NORM and getattr(node, "fp8_projection", None) is not None
          and axis_size(mesh, rules.embed) == 1
          and (isinstance(node, Attention) or (isinstance(node, MLP) and path[-1:] == ("mlp",)))):
        # o_proj's and a layer MLP's down_proj's K slices summed by the norm after them (a
        # shared expert's output is added to the routed experts' first: its sum stays apart)
        node.fp8_add_norm = fp8_add_norm
      fp8_qkv = isinstance(node, Attention) and takes_fp8_qkv_kernel(node)
      if fp8_qkv:  # the K-slice sums of q, k and v read by the norm and RoPE kernel
        node.fp8_qkv_kernel = sharded_fp8_qkv_norm_rope(
            mesh, rules, node.q_norm.eps if node.use_qk_norm else 1e-6, node.rope_theta,
            interpret)
      if (FP8_PARTIALS_IN_NORM and FP8_E4M3_ROWS and axis_size(mesh, rules.embed) == 1
          and (fp8_qkv or (isinstance(node, MLP) and path[-1:] == ("mlp",)
                           and getattr(node, "fp8_projection", None) is not None))):
        node.fp8_e4m3_rows = True
        if isinstance(node, MLP) and FP8_E4M3_SWIGLU:
          fp8_swiglu = fp8_swiglu or sharded_fp8_swiglu(mesh, rules, interpret)
          node.fp8_swiglu = fp8_swiglu
      if (FP8_E4M3_ROWS and FP8_E4M3_ATTENTION_OUT and isinstance(node, Attention)
          and node.fp8_projection is not None
          and all(axis_size(mesh, getattr(rules, a)) == 1
                  for a in ("embed", "q_heads", "head_dim"))):
        node.fp8_e4m3_o = True  # o_proj's input: one batch shard's rows, every head
      if (isinstance(node, Attention) and kv_write is not None and kv_fits(node.head_dim)
          and (node.fp8_projection is None or fp8_qkv)):
        # Other FP8 layers keep XLA's writes, into which XLA fuses the value's K-slice sum:
        # with the kernel that sum is a kernel of its own, and the FP8 step measured no faster
        # (one H100, BENCHMARKS.md, "KV cache writes in one kernel").
        node.kv_write = kv_write
      # The SwiGLU kernel's tiling and shared-memory bound are Hopper's (timed on an H200);
      # MLPs of other shard widths keep their own products
      if (isinstance(node, MLP) and mlp.SWIGLU_KERNEL and node.gate_up_proj_scale is None
          and axis_size(mesh, rules.embed) == 1 and (interpret or platform.on_hopper())
          and swiglu_takes_width(node.gate_up_proj.shape[0],
                                 node.gate_up_proj.shape[2] // axis_size(mesh, rules.mlp))):
        swiglu = swiglu or sharded_swiglu(mesh, rules, interpret)
        node.swiglu_kernel = swiglu
      if (isinstance(node, MoE) and node.scoring == "softmax"
          and axis_size(mesh, rules.embed) == 1 and axis_size(mesh, rules.experts_router) == 1
          and router_fits(1, *node.router.get_value().shape, node.top_k)):
        node.router_kernel = sharded_router(mesh, rules, node.top_k, node.norm_topk_prob,
                                            interpret)
        node.norm_router_kernel = sharded_norm_router(mesh, rules, node.top_k,
                                                      node.norm_topk_prob, interpret)
      if (isinstance(node, MoE) and FP8_E4M3_ROWS and node.fp8_to_backend
          and axis_size(mesh, rules.embed) == 1 and axis_size(mesh, rules.batch) == 1):
        # FP8 experts' gate / up on the norm's e4m3 rows (MoE.reads_e4m3): the experts take
        # one batch shard's rows and scales
        node.fp8_e4m3_rows = True
      if isinstance(node, Attention) and node.takes_qk_kernel():
        kv_axis = "kv_heads" if node.kv_replicas == 1 else None
        eps = node.q_norm.eps if node.use_qk_norm else 1e-6
        node.qk_kernel = sharded_qk_norm_rope(mesh, rules, kv_axis, eps, node.rope_theta,
                                              interpret)
        if node.fp8_projection is not None:
          # Few-row FP8 q and k stay with XLA: with their K-slice sum fused into the norms
          # and RoPE that read them, the kernel plus the fusions it needs to write q, k and v
          # cost what XLA's fusions cost (one H100, BENCHMARKS.md, "FP8 K-slice sums fused
          # ..."). Past those rows (prefill chunks) XLA's q / k norms became two Triton
          # fusions a layer, which XLA compiles one by one: 2-3 s of a 48-layer FP8 warm-up
          # (BENCHMARKS.md, "FP8 prefill's q / k norms through the row kernel ...").
          node.qk_kernel_above = fp8_gemm.MAX_ROWS
        elif node.fused_qkv and not node.has_bias:  # the product's slices into the kernel
          slices = (row_kernels.qkv_k_slices() if axis_size(mesh, rules.embed) == 1
                    and axis_size(mesh, rules.head_dim) == 1 else 0)
          node.qkv_kernel = sharded_qkv_norm_rope(mesh, rules, eps, node.rope_theta, interpret,
                                                  k_slices=slices)
  return backend
