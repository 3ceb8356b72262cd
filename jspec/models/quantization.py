"""Quantized checkpoints: what a config's `quantization_config` says, what jspec loads of it,
and the refusal of the rest before any weight is read.

jspec loads unquantized checkpoints (bfloat16, float16, float32) and the fine-grained FP8
layout of DeepSeek-V3 / R1 and the Qwen FP8 releases (`quant_method: "fp8"`, dynamic
activation scheme, `weight_block_size` [out, in]): a projection's weight is float8_e4m3fn and
its `weight_scale_inv` [ceil(out / block), ceil(in / block)] float32 holds, despite its name,
the factor each block's values are multiplied by. jspec keeps both as they are, in the
checkpoint's [out, in] order (half the bytes of bf16, K contiguous for the FP8 kernel), and
multiplies by the scale inside the product (jspec.models.linear.project).
Attention (GQA, gated and multi-head latent), Gated DeltaNet's q / k / v / z and output
projections, dense MLP and MoE expert projections, MTP / NextN layers included.
"""

from __future__ import annotations

import collections
import math
import re

import numpy as np

from jspec.pallas_kernels.shared import dequantize, expand_scale  # noqa: F401  (re-exported)

FP8_METHOD = "fp8"

# The projection kinds jspec holds in FP8, each in one precision in every layer (target and
# MTP): attention's (GQA and MLA), the dense MLP's and the shared expert's (gate and up as one
# matrix), the routed experts (all of a layer's, as one stack) and Gated DeltaNet's.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                         "kv_a_proj_with_mqa", "kv_b_proj")
MLP_KINDS = ("mlp.gate_up_proj", "mlp.down_proj")
SHARED_KINDS = ("mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj")
LINEAR_KINDS = ("linear_attn.in_proj_qkvz", "linear_attn.out_proj")
# A module of a decoder or MTP layer, as modules_to_not_convert names it.
_LAYER_MODULE = re.compile(r"^(.*?)(?:^|\.)layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts(?:\.(\d+)(?:\.(\w+))?)?$")


def quantization_config(hf_config) -> dict | None:
  """The config's quantization_config as a dict (transformers keeps a dict or an object)."""
  qc = getattr(hf_config, "quantization_config", None)
  if qc is None:
    return None
  return qc if isinstance(qc, dict) else qc.to_dict()


def fp8_block_size(hf_config, model_dir: str) -> tuple[int, int] | None:
  """The (out, in) block of a fine-grained FP8 checkpoint, None for an unquantized one; any
  other quantization is refused."""
  qc = quantization_config(hf_config)
  if not qc:
    return None
  method = qc.get("quant_method", "<none given>")
  if method != FP8_METHOD:
    raise ValueError(
        f"{model_dir} is quantized with quant_method {method!r}, which jspec does not load; it "
        "loads unquantized checkpoints (bfloat16, float16, float32) and fine-grained FP8 "
        "(quant_method 'fp8' with weight_block_size).")
  blocks = qc.get("weight_block_size")
  if not blocks:
    raise ValueError(f"{model_dir} is an FP8 checkpoint with per-tensor scales (no "
                     "weight_block_size); jspec loads the fine-grained layout only (a scale "
                     "per block, as DeepSeek-V3 and the Qwen FP8 releases)")
  if qc.get("activation_scheme", "dynamic") != "dynamic":
    raise ValueError(f"{model_dir}: FP8 activation_scheme {qc['activation_scheme']!r} is not "
                     "supported; jspec loads the 'dynamic' scheme (weights quantized only)")
  if qc.get("fmt", "e4m3") != "e4m3":
    raise ValueError(f"{model_dir}: FP8 weights in format {qc['fmt']!r} are not supported; "
                     "jspec loads e4m3 (float8_e4m3fn) weights")
  # "ue8m0" scales (DeepSeek-V3.1) are powers of two, stored as float32 like the others.
  if qc.get("scale_fmt") not in (None, "float", "ue8m0"):
    raise ValueError(f"{model_dir}: FP8 block scales in format {qc['scale_fmt']!r} are not "
                     "supported; jspec reads float32 scales ('float' or 'ue8m0')")
  if qc.get("modules_to_convert"):
    raise ValueError(f"{model_dir}: FP8 'modules_to_convert' is not supported")
  return int(blocks[0]), int(blocks[1])


def _kinds_of(module: str):
  """(kinds, group member or None) of a module under a layer: the projection kinds listing
  `module` keeps unquantized, and, where jspec holds it with others as one matrix, which part
  it is (those parts must be listed together)."""
  attention = tuple(f"self_attn.{p}" for p in ATTENTION_PROJECTIONS)
  whole = {"self_attn": attention, "linear_attn": LINEAR_KINDS,
           "mlp": MLP_KINDS + SHARED_KINDS + ("mlp.experts",), "block_sparse_moe": ("mlp.experts",),
           "mlp.shared_expert": SHARED_KINDS, "mlp.shared_experts": SHARED_KINDS}
  if module in whole:
    return whole[module], None
  if module in attention or module in ("mlp.down_proj", "linear_attn.out_proj",
                                       "linear_attn.in_proj_qkvz"):
    return (module,), None
  parts = module.rsplit(".", 1)
  if module in ("mlp.gate_proj", "mlp.up_proj"):
    return ("mlp.gate_up_proj",), parts[1]
  if parts[0] in ("mlp.shared_expert", "mlp.shared_experts"):
    if parts[1] == "down_proj":
      return ("mlp.shared_expert.down_proj",), None
    if parts[1] in ("gate_proj", "up_proj"):
      return ("mlp.shared_expert.gate_up_proj",), parts[1]
  if module in ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"):
    return ("linear_attn.in_proj_qkvz",), parts[1]
  expert = _EXPERT.match(module)
  if expert:  # a whole expert, or one of its projections
    return ("mlp.experts",), (expert.group(1), expert.group(2)) if expert.group(1) else None
  return (), None  # norms, routers, b / a projections...: unquantized in jspec anyway


def unconverted_kinds(hf_config, cfg, model_dir: str) -> tuple[str, ...]:
  """The projection kinds an FP8 checkpoint's `modules_to_not_convert` keeps unquantized,
  which jspec then builds unquantized. A list naming only part of what jspec multiplies as one
  matrix (gate without up, in_proj_qkv without in_proj_z, some of a layer's experts) is
  refused; that every layer lists a kind, or none, is checked by the loader (tensor dtypes)."""
  listed = (quantization_config(hf_config) or {}).get("modules_to_not_convert") or ()
  kinds, members = set(), collections.defaultdict(set)
  for name in listed:
    layer_module = _LAYER_MODULE.match(name)
    if not layer_module:
      continue  # lm_head, embeddings, mtp.fc, a vision tower: never FP8 in jspec
    scope, layer, module = layer_module.groups()
    found, member = _kinds_of(module)
    kinds.update(found)
    for kind in found:
      if member is not None:
        members[(scope, layer, kind)].add(member)
  experts = cfg.moe.num_experts * 3 if cfg.is_moe else 0
  for (scope, layer, kind), seen in members.items():
    if kind == "mlp.experts":
      whole = {e for e, part in seen if part is None}
      covered = len(whole) * 3 + len({(e, p) for e, p in seen if e not in whole})
      complete = covered == experts
    else:
      complete = len(seen) == 2
    if not complete:
      layer_name = f"{scope + '.' if scope else ''}layers.{layer}"
      raise ValueError(
          f"{model_dir}: modules_to_not_convert lists only part of {layer_name}'s {kind} "
          f"({', '.join(sorted(map(str, seen)))}); jspec multiplies those weights as one "
          "matrix in one precision and needs all of them listed, or none")
  return tuple(sorted(kinds))


def block_for(cfg, kind: str) -> tuple[int, int] | None:
  """The FP8 block of a projection kind (ATTENTION_PROJECTIONS under "self_attn.", MLP_KINDS,
  SHARED_KINDS, "mlp.experts", LINEAR_KINDS), None where it is unquantized: an unquantized
  checkpoint, or a kind its modules_to_not_convert lists."""
  return None if cfg.fp8_block is None or kind in cfg.fp8_unconverted else cfg.fp8_block


def blocks_for(cfg, kinds) -> tuple:
  return tuple(block_for(cfg, kind) for kind in kinds)


def refuse_unsupported(cfg, model_dir: str) -> None:
  """What jspec's FP8 layout covers: attention (GQA and multi-head latent), linear attention,
  dense MLP and MoE expert projections; blocks at a weight's edges may be partial
  (DeepSeek-V3's 576-row kv_a_proj_with_mqa), and a block may hold several whole GQA heads,
  except along a dimension that tp or ep splits (jspec.sharding.plan). Weights whose inner
  axes are not whole blocks are scaled per axis before XLA's product
  (jspec.models.linear.project), not by the kernel."""
  # Gated DeltaNet's projections are kept per key head (jspec.models.gated_deltanet): the
  # checkpoint's row blocks must each fall in one head's q, k, v or z rows, and out_proj's
  # column blocks in one value head.
  bo, bi = cfg.fp8_block
  fp8_linear_attention = "linear_attention" in cfg.layer_types and any(
      block_for(cfg, kind) for kind in LINEAR_KINDS)
  linear = cfg.linear
  if fp8_linear_attention and (linear.key_head_dim % bo or linear.value_head_dim % bo
                               or linear.value_head_dim % bi):
    raise ValueError(f"{model_dir}: FP8 blocks of {cfg.fp8_block[0]} x {cfg.fp8_block[1]} do "
                     f"not tile the linear-attention heads (linear_key_head_dim="
                     f"{linear.key_head_dim}, linear_value_head_dim="
                     f"{linear.value_head_dim}); jspec keeps those projections per head "
                     "and needs whole blocks in each")
  # GQA projections are kept split by head ([N, H, D] for q): a block must hold whole heads
  # or tile each head, or one stored scale would stand for two of the checkpoint's. (MLA's
  # per-head FP8 weights are kept flattened, as published, and need no such check.)
  if not cfg.is_mla and any(cfg.head_dim % b and b % cfg.head_dim for b in cfg.fp8_block):
    raise ValueError(f"{model_dir}: FP8 blocks of {cfg.fp8_block[0]} x {cfg.fp8_block[1]} "
                     f"straddle attention heads of head_dim={cfg.head_dim}; jspec keeps those "
                     "weights per head and needs blocks that hold whole heads or tile each")
  if cfg.is_mla and (any(size % cfg.fp8_block[0] for size in (
      cfg.mla.qk_nope_head_dim, cfg.mla.v_head_dim)) or cfg.mla.v_head_dim % cfg.fp8_block[1]):
    raise ValueError(f"{model_dir}: FP8 blocks of {cfg.fp8_block[0]} x {cfg.fp8_block[1]} do "
                     f"not tile kv_b_proj's per-head rows (qk_nope_head_dim="
                     f"{cfg.mla.qk_nope_head_dim}, v_head_dim={cfg.mla.v_head_dim}); jspec splits "
                     "them into the key and value parts and needs whole blocks in each")
  if cfg.is_moe and block_for(cfg, "mlp.experts") and (
      cfg.moe.intermediate_size % cfg.fp8_block[0] or cfg.hidden_size % cfg.fp8_block[1]):
    raise ValueError(f"{model_dir}: FP8 blocks of {cfg.fp8_block[0]} x {cfg.fp8_block[1]} do "
                     f"not tile the experts (moe_intermediate_size={cfg.moe.intermediate_size}, "
                     f"hidden_size={cfg.hidden_size}); jspec needs whole expert blocks")


def stored_shape(shape, in_axes: int, lead: int = 0, flatten_out: bool = False):
  """An FP8 weight's shape as jspec keeps it: the checkpoint's [out, in] order (its output axes
  first), the K-contiguous layout the FP8 kernel streams, where unquantized weights are kept
  input-first. `shape`: the unquantized weight's: `lead` batch axes (experts), then `in_axes`
  input axes, then the output axes; `flatten_out`: the output axes as one (a per-head weight
  whose heads the checkpoint's blocks straddle, as MLA's q_b_proj [N x 192, Q])."""
  lead_axes, ins, outs = shape[:lead], shape[lead:lead + in_axes], shape[lead + in_axes:]
  if flatten_out:
    outs = (math.prod(outs),) if isinstance(outs[0], int) else outs[:1]
  return tuple(lead_axes) + tuple(outs) + tuple(ins)


def scale_shape(stored, in_axes: int, block: tuple[int, int]) -> tuple[int, ...]:
  """The block grid of a stored FP8 weight ([..out.., ..in..], the last `in_axes` axes its
  input): the last output axis over the output block, the last axis over the input block,
  each rounded up (a partial block at the edge has its own scale, as published)."""
  out_block, in_block = block
  grid = list(stored)
  grid[-in_axes - 1] = -(-grid[-in_axes - 1] // out_block)
  grid[-1] = -(-grid[-1] // in_block)
  return tuple(grid)


