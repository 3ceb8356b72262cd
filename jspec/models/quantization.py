"""Quantized checkpoints: what a config's `quantization_config` says, what jspec loads of it,
and the refusal of the rest before any weight is read.

jspec loads unquantized checkpoints (bfloat16, float16, float32) and the fine-grained FP8
layout of DeepSeek-V3 / R1 and the Qwen FP8 releases (`quant_method: "fp8"`, dynamic
activation scheme, `weight_block_size` [out, in]): a projection's weight is float8_e4m3fn and
its `weight_scale_inv` [ceil(out / block), ceil(in / block)] float32 holds, despite its name,
the factor each block's values are multiplied by. jspec keeps both as they are, in the
checkpoint's [out, in] order (half the bytes of bf16, K contiguous for the FP8 kernel), and
multiplies by the scale inside the product (jspec.models.layers.project).
So far the attention and dense MLP projections of decoder layers: a checkpoint whose experts,
latent attention or linear attention are quantized is refused, naming what is missing.
"""

from __future__ import annotations

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
  """What jspec's FP8 layout covers: attention (GQA) and dense MLP projections whose head
  dim, hidden and intermediate sizes are whole blocks."""
  out_block, in_block = cfg.fp8_block
  missing = [what for what, present in (
      ("MoE experts", cfg.is_moe), ("multi-head latent attention", cfg.kv_lora_rank > 0),
      ("linear attention", "linear_attention" in cfg.layer_types)) if present]
  if missing:
    raise ValueError(f"{model_dir} is an FP8 checkpoint of a model with {', '.join(missing)}: "
                     "jspec's FP8 loading covers attention and dense MLP projections so far")
  sizes = {"head_dim": cfg.head_dim, "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size}
  off = {name: size for name, size in sizes.items()
         if size % out_block or size % in_block}
  if off:
    raise ValueError(f"{model_dir}: FP8 blocks of {out_block} x {in_block} do not tile {off}; "
                     "jspec needs whole blocks along every projection axis")


def stored_shape(shape, in_axes: int) -> tuple[int, ...]:
  """An FP8 weight's shape as jspec keeps it: the checkpoint's [out, in] order (its output axes
  first), the K-contiguous layout the FP8 kernel streams, where unquantized weights are kept
  input-first. `shape`: the unquantized weight's, whose first `in_axes` axes are its input."""
  return tuple(shape[in_axes:]) + tuple(shape[:in_axes])


def stored_spec(spec: str, in_axes: int) -> str:
  """An einsum over an unquantized weight (its operand input-first) rewritten for the FP8
  weight's stored order."""
  inputs, out = spec.split("->")
  x, w = inputs.split(",")
  return f"{x},{w[in_axes:]}{w[:in_axes]}->{out}"


def scale_shape(stored, in_axes: int, block: tuple[int, int]) -> tuple[int, ...]:
  """The block grid of a stored FP8 weight ([..out.., ..in..], the last `in_axes` axes its
  input): the last output axis over the output block, the last axis over the input block."""
  out_block, in_block = block
  grid = list(stored)
  grid[-in_axes - 1] //= out_block
  grid[-1] //= in_block
  return tuple(grid)


def expand_scale(scale, stored, in_axes: int, xp=np):
  """A block scale (scale_shape's grid) repeated to the stored weight's shape."""
  last_out = len(stored) - in_axes - 1
  scale = xp.repeat(scale, stored[last_out] // scale.shape[last_out], axis=last_out)
  return xp.repeat(scale, stored[-1] // scale.shape[-1], axis=-1)


def dequantize(weight, scale, in_axes: int, dtype, xp=np):
  """The stored FP8 weight times its block scales, in float32, cast to `dtype`."""
  full = expand_scale(scale, weight.shape, in_axes, xp)
  return (weight.astype(xp.float32) * full).astype(dtype)
