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

import math

import numpy as np

FP8_METHOD = "fp8"


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
  if qc.get("modules_to_convert"):
    raise ValueError(f"{model_dir}: FP8 'modules_to_convert' is not supported")
  return int(blocks[0]), int(blocks[1])


def refuse_unsupported(cfg, model_dir: str) -> None:
  """What jspec's FP8 layout covers: attention (GQA and multi-head latent), linear attention,
  dense MLP and MoE expert projections; blocks at a weight's edges may be partial (DeepSeek-V3's 576-row
  kv_a_proj_with_mqa), and a block may hold several whole GQA heads, except along a dimension
  that tp or ep splits (jspec.sharding.plan). Weights whose inner axes are not whole blocks are
  scaled per axis before XLA's product (jspec.models.linear.project), not by the kernel."""
  # Gated DeltaNet's projections are kept per key head (jspec.models.gated_deltanet): the
  # checkpoint's row blocks must each fall in one head's q, k, v or z rows, and out_proj's
  # column blocks in one value head.
  if "linear_attention" in cfg.layer_types and any(
      size % cfg.fp8_block[0] for size in (cfg.linear_key_head_dim, cfg.linear_value_head_dim)
  ) or "linear_attention" in cfg.layer_types and cfg.linear_value_head_dim % cfg.fp8_block[1]:
    raise ValueError(f"{model_dir}: FP8 blocks of {cfg.fp8_block[0]} x {cfg.fp8_block[1]} do "
                     f"not tile the linear-attention heads (linear_key_head_dim="
                     f"{cfg.linear_key_head_dim}, linear_value_head_dim="
                     f"{cfg.linear_value_head_dim}); jspec keeps those projections per head "
                     "and needs whole blocks in each")
  # GQA projections are kept split by head ([N, H, D] for q): a block must hold whole heads
  # or tile each head, or one stored scale would stand for two of the checkpoint's. (MLA's
  # per-head FP8 weights are kept flattened, as published, and need no such check.)
  if cfg.kv_lora_rank == 0 and any(cfg.head_dim % b and b % cfg.head_dim
                                   for b in cfg.fp8_block):
    raise ValueError(f"{model_dir}: FP8 blocks of {cfg.fp8_block[0]} x {cfg.fp8_block[1]} "
                     f"straddle attention heads of head_dim={cfg.head_dim}; jspec keeps those "
                     "weights per head and needs blocks that hold whole heads or tile each")
  if cfg.kv_lora_rank and any(size % cfg.fp8_block[0] for size in (
      cfg.qk_nope_head_dim, cfg.v_head_dim)) or cfg.kv_lora_rank and (
          cfg.v_head_dim % cfg.fp8_block[1]):
    raise ValueError(f"{model_dir}: FP8 blocks of {cfg.fp8_block[0]} x {cfg.fp8_block[1]} do "
                     f"not tile kv_b_proj's per-head rows (qk_nope_head_dim="
                     f"{cfg.qk_nope_head_dim}, v_head_dim={cfg.v_head_dim}); jspec splits them "
                     "into the key and value parts and needs whole blocks in each")
  if cfg.is_moe and (cfg.moe_intermediate_size % cfg.fp8_block[0]
                     or cfg.hidden_size % cfg.fp8_block[1]):
    raise ValueError(f"{model_dir}: FP8 blocks of {cfg.fp8_block[0]} x {cfg.fp8_block[1]} do "
                     f"not tile the experts (moe_intermediate_size={cfg.moe_intermediate_size}, "
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


def expand_scale(scale, stored, in_axes: int, block: tuple[int, int], xp=np):
  """A block scale (scale_shape's grid) repeated to the stored weight's shape."""
  last_out = len(stored) - in_axes - 1
  scale = xp.repeat(scale, block[0], axis=last_out)
  scale = xp.repeat(scale, block[1], axis=-1)
  return scale[(slice(None),) * last_out + (slice(0, stored[last_out]),) + (slice(None),) * (
      in_axes - 1) + (slice(0, stored[-1]),)]


def dequantize(weight, scale, in_axes: int, block: tuple[int, int], dtype, xp=np):
  """The stored FP8 weight times its block scales, in float32, cast to `dtype`."""
  full = expand_scale(scale, weight.shape, in_axes, block, xp)
  return (weight.astype(xp.float32) * full).astype(dtype)
