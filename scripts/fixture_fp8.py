#!/usr/bin/env python
"""Tiny fine-grained FP8 checkpoints quantized and written by transformers' own FP8 classes, with
float32 reference outputs of transformers' dequantized model: tests/fixtures/<name>_fp8, made from
tests/fixtures/<name>, tested by tests/test_fp8_transformers.py. This file writes and checks the
checkpoints; scripts/fixture_fp8_reference.py makes the reference.

HOW TO RUN (a CUDA GPU of compute capability >= 8.9, torch, transformers 5.x, accelerate):

    PYTHONPATH=. python3 scripts/fixture_fp8.py                          # all five
    PYTHONPATH=. python3 scripts/fixture_fp8.py --only qwen3_dense deepseek_v3

transformers quantizes a checkpoint on the fly only on a GPU: its FineGrainedFP8HfQuantizer
refuses to without one (`--device` names another accelerator).

Each fixture, in order; a failing one is reported and the others still run (exit status 1 then):
  1. transformers loads the source with `quantization_config=FineGrainedFP8Config(weight_block_size=
     (b, b), modules_to_not_convert=[...])`: its Fp8Quantize turns every nn.Linear and every fused
     experts tensor not listed into float8_e4m3fn with a float32 `weight_scale_inv` per block;
     `save_pretrained` writes the weights and config.json (its quantization_config included).
  2. The MTP / NextN layers' tensors (`mtp.*`, `model.layers.{L + m}.*`), which no transformers
     class holds, are quantized by the same Fp8Quantize (the quantizer's own `get_quantize_ops()`),
     fed as the load path fed it in step 1 (recorded there): the source weight cast to the dtype
     and device the op was handed. transformers 5.24 hands it the float32 weight; 5.17 casts the
     weight to the FP8 parameter's dtype, float8_e4m3fn, before its Fp8Quantize (a second
     rounding), and so is followed. Every target weight handed whole must equal the source so
     cast, and the op must reproduce byte for byte what transformers wrote for every target
     projection (a mismatch is reported with how many e4m3 bytes differ and how the scales do).
  3. transformers 5.24 writes the experts' weights per expert but their scales fused
     (`mlp.experts.gate_up_proj_scale_inv` [E, 2F / b, D / b]); those are written per expert
     (`mlp.experts.{e}.gate_proj.weight_scale_inv`, ...), as the published checkpoints and jspec
     have them. Slicing only: no value changes.
  4. Every tensor of the source is checked: each projection e4m3 with its scales, within e4m3's
     rounding of the weight the quantize op was given; everything else (embeddings, lm_head, norms, routers and their
     bias, eh_proj / mtp.fc, Gated DeltaNet's A_log / conv1d / dt_bias / in_proj_a / in_proj_b /
     in_proj_ba / norm) byte for byte the source's.
  5. The reference: the written checkpoint loaded by transformers with
     FineGrainedFP8Config(dequantize=True) into a float32 model on the CPU (eager attention, eager
     experts; the CPU has no TF32), its parameters checked equal to e4m3 x scale computed here.
     Prompts whose greedy steps have a top-1 / top-2 logit margin > MIN_MARGIN and whose routers a
     top-k gap > MIN_ROUTER_GAP: the fixed PROMPTS first, seeded random ones in place of any that
     is not. 8 greedy tokens each (a cache-free re-forward loop, checked equal to generate()), and
     the logits of prompt + continuation.

The block b is the largest power of two dividing every quantized weight's rows and columns and each
dimension jspec cuts into blocks (head_dim, MLA's qk_nope / v head dims, moe_intermediate_size,
hidden_size, the linear-attention key and value head dims): 32 for qwen3_dense and qwen3_moe, 8 for
the others (deepseek_v3's kv_a_proj_with_mqa has 40 rows, the Qwen3.5 / Qwen3-Next linear value
heads 24 dims). transformers' Fp8Quantize leaves a weight that is not whole blocks unquantized, so
partial edge blocks are tested by tests/test_fp8_families.py, not here.

Written: config.json, generation_config.json, model.safetensors (from save_pretrained, plus the
MTP tensors), reference.npz (prompt_i, gen_i, logits_i) and reference.json (versions, block,
prompts, margins, what was done). See tests/fixtures/README.md ("FP8 fixtures").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile
import traceback

import numpy as np
import safetensors
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_fp8_reference import (NEW_TOKENS, SCALE_SUFFIX, FixtureError,  # noqa: E402
                                   choose_prompts, dequantize, eager, fp8_config,
                                   load_dequantized)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
SOURCES = ("qwen3_dense", "qwen3_moe", "deepseek_v3", "qwen3_5_text", "qwen3_next")
MIN_FP8_EFFECT = 1e-3  # the FP8 model's logits must differ from the float source's by more

# The projections the published FP8 releases keep in e4m3, in decoder and MTP layers alike
# (`mtp.layers.0.` and DeepSeek's `model.layers.{L + m}.` both match).
QUANTIZED = re.compile(
    r"(?:^|\.)layers\.\d+\.(?:"
    r"self_attn\.(?:q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)"
    r"|linear_attn\.(?:in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.(?:experts\.\d+\.|shared_experts?\.)?(?:gate_proj|up_proj|down_proj)"
    r")\.weight$")
# Modules kept in their dtype besides transformers' defaults (lm_head, tied embeddings): routers,
# Qwen3-Next's shared-expert gate, the Gated DeltaNet parts Qwen's FP8 releases list, and the MTP
# layers' input projection, head and embedding. Listed by full name, as Qwen's releases list them.
KEPT = re.compile(
    r"(?:\.mlp\.gate|\.shared_expert_gate"
    r"|\.linear_attn\.(?:A_log|conv1d|dt_bias|in_proj_a|in_proj_b|in_proj_ba|norm)"
    r"|^mtp\.fc|\.eh_proj|\.shared_head\.head|\.layers\.\d+\.embed_tokens)$")
# Config dimensions jspec cuts into whole blocks (jspec.models.quantization.refuse_unsupported).
BLOCKED_DIMS = ("head_dim", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size",
                "hidden_size", "linear_key_head_dim", "linear_value_head_dim")
FUSED_EXPERT_SCALE = re.compile(r"^(.*\.experts\.)(gate_up_proj|down_proj)" + SCALE_SUFFIX + "$")

torch.set_grad_enabled(False)



# ---- what gets quantized, in which blocks ------------------------------------------------------

def block_size(config: dict, shapes: dict[str, tuple]) -> int:
  """The largest power of two dividing every quantized weight's dimensions and BLOCKED_DIMS."""
  dims = [d for name, shape in shapes.items() if QUANTIZED.search(name) for d in shape]
  dims += [config[key] for key in BLOCKED_DIMS if config.get(key)]
  common = math.gcd(*dims)
  return common & -common  # its largest power-of-two divisor


def modules_to_not_convert(src: str, names) -> list[str]:
  """transformers' own default skips (which an explicit list replaces), plus KEPT's modules."""
  try:
    from transformers.quantizers.base import get_keys_to_not_convert
  except ImportError as err:
    raise FixtureError("transformers.quantizers.base.get_keys_to_not_convert is gone in "
                       f"transformers {transformers.__version__}: find where this version "
                       "computes the FP8 quantizer's default modules_to_not_convert") from err
  with torch.device("meta"):
    skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
  kept = set(get_keys_to_not_convert(skeleton))
  for name in names:
    module = re.sub(r"\.(weight|bias|e_score_correction_bias)$", "", name)
    if KEPT.search(module):
      kept.add(module)
  return sorted(kept)




def load_quantized(src: str, block: int, kept: list[str], device: str):
  """transformers' FP8 model of `src`; its quantizer; and what its load path handed the quantize
  op, {target key: the tensor (on the CPU), its dtype, its device}."""
  from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
  config = fp8_config(weight_block_size=(block, block), modules_to_not_convert=kept)
  handed, get_ops = {}, FineGrainedFP8HfQuantizer.get_quantize_ops

  def recording_ops(self):  # the load path's own op, its inputs recorded on their way in
    op = get_ops(self)
    convert = op.convert

    def recorded(input_dict, **kwargs):
      for key, value in input_dict.items():
        tensor = value[0] if isinstance(value, list) else value
        handed[key] = (tensor.detach().cpu().clone(), tensor.dtype, tensor.device)
      return convert(input_dict, **kwargs)

    op.convert = recorded
    return op

  FineGrainedFP8HfQuantizer.get_quantize_ops = recording_ops
  try:
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config,
                                                 dtype=torch.float32, device_map=device)
  finally:
    FineGrainedFP8HfQuantizer.get_quantize_ops = get_ops
  quantizer = getattr(model, "hf_quantizer", None)
  if type(quantizer).__name__ != "FineGrainedFP8HfQuantizer":
    raise FixtureError(f"the model was loaded with quantizer {type(quantizer).__name__}, "
                       "not FineGrainedFP8HfQuantizer")
  if getattr(quantizer.quantization_config, "dequantize", False):
    raise FixtureError("transformers chose to dequantize instead of quantizing (no GPU of compute "
                       "capability >= 8.9?): nothing FP8 would be written")
  if not handed:
    raise FixtureError("transformers' load path never called its quantize op "
                       "(get_quantize_ops().convert): nothing was quantized on the way in")
  return model, quantizer, handed


def quantize_op(quantizer, handed: dict, source: dict):
  """transformers' own weight -> (e4m3, scale_inv) operation, for the MTP tensors, fed as its load
  path feeds it: the source weight cast by one `.to(device=, dtype=)` to the dtype and device the
  load path handed the op (float32 in transformers 5.24; transformers 5.17 casts to the FP8
  parameter's own dtype, float8_e4m3fn, first, so every weight is rounded twice), checked on every
  target weight handed whole. (quantize(name, weight) -> (e4m3, scale_inv, the tensor the op was
  given, on the CPU), the op's name, what the load path handed it.)"""
  get_ops = getattr(quantizer, "get_quantize_ops", None)
  if get_ops is None:
    raise FixtureError(f"transformers {transformers.__version__}'s FP8 quantizer has no "
                       "get_quantize_ops(): find its weight quantization routine")
  op = get_ops()
  kinds = {(dtype, device) for _, dtype, device in handed.values()}
  if len(kinds) != 1:
    raise FixtureError(f"the load path handed the quantize op tensors of several dtypes / devices: "
                       f"{sorted(map(str, kinds))}")
  (dtype, device), = kinds

  def prepare(weight: torch.Tensor) -> torch.Tensor:
    return weight.to(device=device, dtype=dtype)  # as transformers materializes a tensor

  whole = 0
  for key, (tensor, _, _) in sorted(handed.items()):
    if key not in source:
      continue  # fused experts: checked through what was written, per expert
    mine = prepare(source[key]).cpu()
    if mine.shape != tensor.shape or not torch.equal(_bytes(mine), _bytes(tensor)):
      raise FixtureError(f"{key}: the load path handed the quantize op a {tensor.dtype} tensor "
                         f"unequal to the source weight cast to it ({mismatch(mine, tensor)})")
    whole += 1

  def quantize(name: str, weight: torch.Tensor):
    given = prepare(weight)
    out = op.convert({name: given})
    scale_name = name + SCALE_SUFFIX
    if set(out) != {name, scale_name} or out[name].dtype != torch.float8_e4m3fn:
      raise FixtureError(f"{type(op).__name__}.convert gave {sorted(out)} "
                         f"({out[name].dtype}) for {name}, not e4m3 + {scale_name}")
    return out[name].cpu(), out[scale_name].cpu(), given.cpu()

  fed = {"dtype": str(dtype).removeprefix("torch."), "device": str(device),
         "target_weights_checked_equal_to_the_source_so_cast": whole,
         "fused_inputs": len(handed) - whole}
  return quantize, type(op).__name__, fed


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
  return tensor.contiguous().view(torch.uint8)


def mismatch(mine: torch.Tensor, theirs: torch.Tensor, scale=None, their_scale=None) -> str:
  """How two quantizations of one weight differ, for the log: differing bytes, the largest
  relative scale difference, and whether the scales are each other's reciprocal or transpose."""
  parts = []
  if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
    parts.append(f"{mine.dtype} {tuple(mine.shape)} vs {theirs.dtype} {tuple(theirs.shape)}")
  else:
    differ = _bytes(mine) != _bytes(theirs)
    parts.append(f"{int(differ.sum())} of {differ.numel()} bytes differ")
    if theirs.dtype == torch.float8_e4m3fn and differ.any():
      a, b = mine.float(), theirs.float()
      off = (a - b).abs()[differ.reshape(mine.shape)]
      parts.append(f"largest value difference {float(off.max()):.3g}; "
                   f"as e4m3 codes up to {int((_bytes(mine).int() - _bytes(theirs).int()).abs().max())} apart")
  if scale is not None and their_scale is None:
    parts.append("no scale written")
  elif scale is not None:
    s, t = scale.float(), their_scale.float()
    if their_scale.dtype != scale.dtype:
      parts.append(f"scales {scale.dtype} vs written {their_scale.dtype}")
    if s.shape != t.shape:
      parts.append(f"scales {tuple(s.shape)} vs written {tuple(t.shape)}")
      if s.ndim == 2 and s.T.shape == t.shape:
        parts.append(f"transposed: {'equal' if torch.equal(s.T, t) else 'unequal'}")
    else:
      rel = lambda x, y: float(((x - y).abs() / y.abs().clamp(min=1e-30)).max())
      parts.append(f"scales: {int((s != t).sum())} of {s.numel()} differ, largest relative "
                   f"difference {rel(s, t):.3g}; as reciprocals {rel(1 / s, t):.3g}")
      if s.ndim == 2 and s.shape[0] == s.shape[1]:
        parts.append(f"as transposes {rel(s.T, t):.3g}")
  return "; ".join(parts)


# ---- the written checkpoint ---------------------------------------------------------------------

def read_tensors(model_dir: str) -> dict[str, torch.Tensor]:
  index = os.path.join(model_dir, "model.safetensors.index.json")
  files = (sorted(set(json.load(open(index))["weight_map"].values())) if os.path.isfile(index)
           else ["model.safetensors"])
  tensors = {}
  for fname in files:
    tensors.update(load_file(os.path.join(model_dir, fname)))
  return tensors


def expert_scales_per_expert(tensors: dict) -> tuple[dict, bool]:
  """Fused expert scales ([E, 2F / b, D / b] gate rows first; [E, D / b, F / b]) as one
  `weight_scale_inv` per expert weight; (tensors, whether any were fused)."""
  out, fused = {}, False
  for name, value in tensors.items():
    match = FUSED_EXPERT_SCALE.match(name)
    if not match:
      out[name] = value
      continue
    fused, (prefix, which) = True, match.groups()
    for e in range(value.shape[0]):
      if which == "down_proj":
        out[f"{prefix}{e}.down_proj.weight{SCALE_SUFFIX}"] = value[e].contiguous()
      else:  # F is whole blocks (the block divides moe_intermediate_size): rows split cleanly
        half = value.shape[1] // 2
        out[f"{prefix}{e}.gate_proj.weight{SCALE_SUFFIX}"] = value[e, :half].contiguous()
        out[f"{prefix}{e}.up_proj.weight{SCALE_SUFFIX}"] = value[e, half:].contiguous()
  return out, fused




def check_quantized(name: str, source: torch.Tensor, w8, scale, block: int):
  grid = (-(-source.shape[0] // block), -(-source.shape[1] // block))
  if w8.dtype != torch.float8_e4m3fn or w8.shape != source.shape:
    raise FixtureError(f"{name}: written as {w8.dtype} {tuple(w8.shape)}, not float8_e4m3fn "
                       f"{tuple(source.shape)}")
  if scale.dtype != torch.float32 or tuple(scale.shape) != grid:
    raise FixtureError(f"{name}{SCALE_SUFFIX}: {scale.dtype} {tuple(scale.shape)}, not "
                       f"float32 {grid}")
  # e4m3 keeps 4 significant bits (relative rounding <= 2^-4) down to its subnormals, spaced
  # 2^-9: each value is within 2^-4 of itself plus half a subnormal step, in units of its scale.
  full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
  error = (dequantize(w8, scale, block) - source).abs()
  bound = 2 ** -4 * source.abs() + 2 ** -10 * full + 1e-6 * source.abs()
  if not (error <= bound).all():
    raise FixtureError(f"{name}: dequantized weight is off the source by up to "
                       f"{float(error.max()):.3g}, past e4m3's rounding")


def complete_checkpoint(source: dict, written: dict, block: int, quantize) -> dict:
  """(the written tensors with the MTP ones added, every source tensor checked; how many were
  quantized in the target and MTP layers and kept; the largest difference between the source
  weights and what the quantize op was given)."""
  tensors, counts = dict(written), {"target": 0, "mtp": 0, "kept": 0}
  precast = 0.0
  for name, value in sorted(source.items()):
    if QUANTIZED.search(name):
      w8, scale, given = quantize(name, value)
      precast = max(precast, float((given.float() - value).abs().max()))
      if name in written:  # transformers' own: the MTP path must reproduce it exactly
        theirs = (written[name], written.get(name + SCALE_SUFFIX))
        if theirs[1] is None or not (w8.shape == theirs[0].shape and w8.dtype == theirs[0].dtype
                                     and torch.equal(_bytes(w8), _bytes(theirs[0]))
                                     and scale.dtype == theirs[1].dtype
                                     and scale.shape == theirs[1].shape
                                     and torch.equal(scale, theirs[1])):
          raise FixtureError(f"{name}: transformers wrote it otherwise than its quantize op "
                             f"makes it now: {mismatch(w8, theirs[0], scale, theirs[1])}")
        counts["target"] += 1
      else:
        tensors[name], tensors[name + SCALE_SUFFIX] = w8, scale
        counts["mtp"] += 1
      check_quantized(name, given.float(), tensors[name], tensors[name + SCALE_SUFFIX], block)
    else:
      if name not in written:
        tensors[name] = value  # an MTP layer's norm, head, router, eh_proj: kept as it is
      elif not (written[name].dtype == value.dtype and torch.equal(written[name], value)):
        raise FixtureError(f"{name}: transformers wrote {written[name].dtype} "
                           f"{tuple(written[name].shape)} unequal to the source's, which the "
                           "published checkpoints keep unquantized")
      counts["kept"] += 1
  expected = set(source) | {n + SCALE_SUFFIX for n in source if QUANTIZED.search(n)}
  if set(tensors) != expected:
    raise FixtureError(f"written tensors differ from the source's: extra "
                       f"{sorted(set(tensors) - expected)[:6]}, missing "
                       f"{sorted(expected - set(tensors))[:6]}")
  return tensors, counts, precast


def write_config(src: str, written_dir: str, out_dir: str) -> list[str]:
  """transformers' config.json, with the source's keys it dropped put back (the MTP layer
  counts jspec reads, say), except the RoPE keys it moved into rope_parameters."""
  source = json.load(open(os.path.join(src, "config.json")))
  config = json.load(open(os.path.join(written_dir, "config.json")))
  moved = set(config.get("rope_parameters") or {}) | {"rope_scaling", "rope_theta"}
  restored = sorted(k for k in source if k not in config and k not in moved)
  config.update({k: source[k] for k in restored})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  return restored


# ---- one fixture --------------------------------------------------------------------------------

@dataclasses.dataclass
class Made:
  """What one fixture's making did, for reference.json and the closing table."""
  block: int
  kept: list[str]
  quantize_op: str = ""
  fed: dict = dataclasses.field(default_factory=dict)  # what the load path gave the quantize op
  counts: dict = dataclasses.field(default_factory=dict)
  relaid: bool = False
  restored: list[str] = dataclasses.field(default_factory=list)
  quantization_config: dict = dataclasses.field(default_factory=dict)
  # Per prompt: (prompt, tries before it, continuation, logits, min margin, min router gaps).
  chosen: list = dataclasses.field(default_factory=list)
  fp8_effect: float = 0.0


def build(name: str, out_root: str, device: str) -> dict:
  src = os.path.join(FIXTURES, name)
  source = load_file(os.path.join(src, "model.safetensors"))
  if any(t.dtype != torch.float32 for t in source.values()):
    raise FixtureError(f"{src}: the source fixtures are float32")
  config = json.load(open(os.path.join(src, "config.json")))
  made = Made(block_size(config, {n: tuple(t.shape) for n, t in source.items()}),
              modules_to_not_convert(src, source))
  print(f"=== {name}: blocks of {made.block} x {made.block}, {len(made.kept)} modules kept",
        flush=True)
  staging = tempfile.mkdtemp(prefix=f"{name}_fp8.")
  try:
    out_dir = os.path.join(staging, "fixture")
    tensors = write_checkpoint(src, source, made, device, staging, out_dir)
    write_reference(src, out_dir, tensors, made, config["vocab_size"])
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
      json.dump(describe(name, made, device), f, indent=2)
    dest = os.path.join(out_root, f"{name}_fp8")
    if os.path.isdir(dest):
      shutil.rmtree(dest)
    shutil.move(out_dir, dest)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return {"block": made.block, **made.counts, "fp8_effect": made.fp8_effect,
          "kib": os.path.getsize(os.path.join(dest, "model.safetensors")) // 1024,
          "margin": min(c[4] for c in made.chosen), "relaid": made.relaid}


def write_checkpoint(src: str, source: dict, made: Made, device: str, staging: str,
                     out_dir: str) -> dict:
  """Steps 1-4: the FP8 checkpoint in `out_dir`; its tensors."""
  model, quantizer, handed = load_quantized(src, made.block, made.kept, device)
  quantize, made.quantize_op, made.fed = quantize_op(quantizer, handed, source)
  print(f"  the load path hands {made.quantize_op} {made.fed['dtype']} weights on "
        f"{made.fed['device']}; the MTP weights are cast so too", flush=True)
  written_dir = os.path.join(staging, "save_pretrained")
  model.save_pretrained(written_dir)
  written, made.relaid = expert_scales_per_expert(read_tensors(written_dir))
  tensors, made.counts, made.fed["max_abs_difference_from_the_source"] = complete_checkpoint(
      source, written, made.block, quantize)
  os.makedirs(out_dir)
  weights = os.path.join(out_dir, "model.safetensors")
  save_file(dict(sorted(tensors.items())), weights, metadata={"format": "pt"})
  os.chmod(weights, 0o644)  # save_file leaves it private to its writer
  made.restored = write_config(src, written_dir, out_dir)
  shutil.copy(os.path.join(written_dir, "generation_config.json"), out_dir)
  with open(os.path.join(out_dir, "config.json")) as f:
    made.quantization_config = json.load(f)["quantization_config"]
  return tensors


def write_reference(src: str, out_dir: str, tensors: dict, made: Made, vocab: int):
  """Step 5: reference.npz from transformers' dequantized model, and how far its logits are
  from the float source's."""
  reference = load_dequantized(out_dir, tensors, made.block)
  float_model = eager(AutoModelForCausalLM.from_pretrained(
      src, dtype=torch.float32, attn_implementation="eager"))
  made.chosen = choose_prompts(reference, vocab)
  arrays = {}
  for i, (prompt, _, gen, logits, _, _) in enumerate(made.chosen):
    arrays[f"prompt_{i}"] = np.array(prompt, np.int32)
    arrays[f"gen_{i}"] = gen.numpy().astype(np.int32)
    arrays[f"logits_{i}"] = logits.numpy().astype(np.float32)
    sequence = torch.cat([torch.tensor(prompt), gen])[None]
    made.fp8_effect = max(made.fp8_effect, float(
        (float_model(sequence, use_cache=False).logits[0] - logits).abs().max()))
  if not made.fp8_effect > MIN_FP8_EFFECT:
    raise FixtureError(f"the FP8 model's logits are within {made.fp8_effect:.2g} of the float "
                       "source's: the test could not tell them apart")
  np.savez_compressed(os.path.join(out_dir, "reference.npz"), **arrays)


def describe(name: str, made: Made, device: str) -> dict:
  chosen, block = made.chosen, made.block
  return {
      "fixture": f"{name}_fp8",
      "source_fixture": name,
      "generated_by": "scripts/fixture_fp8.py",
      "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                   "safetensors": safetensors.__version__, "numpy": np.__version__},
      "quantized_on": _device_name(device),
      "reference_on": "cpu, float32, eager attention, eager experts",
      "weight_block_size": [block, block],
      "quantization": {
          "target": "AutoModelForCausalLM.from_pretrained(source, quantization_config="
                    f"FineGrainedFP8Config(weight_block_size=({block}, {block}), "
                    f"modules_to_not_convert=[...]), dtype=float32, device_map={device!r}) then "
                    "save_pretrained",
          "mtp": f"transformers' {made.quantize_op} (the quantizer's get_quantize_ops()), fed "
                 "as the load path fed it, checked to reproduce every target projection byte "
                 "for byte",
          "quantize_op_input": made.fed,
          "expert_scales_written_per_expert": made.relaid,
          "config_keys_restored_from_source": made.restored,
          "modules_to_not_convert_passed": made.kept,
          "quantization_config_written": made.quantization_config,
          "tensors": {"quantized_target": made.counts["target"],
                      "quantized_mtp": made.counts["mtp"], "kept": made.counts["kept"]},
      },
      "reference": "the written checkpoint loaded by transformers with FineGrainedFP8Config("
                   "dequantize=True): each weight e4m3 x its block's scale in float32 (checked)",
      "new_tokens": NEW_TOKENS,
      "min_top1_top2_margin": {f"prompt_{i}": c[4] for i, c in enumerate(chosen)},
      "min_router_gap": {f"prompt_{i}": {k: v for k, v in c[5].items() if v != math.inf}
                         for i, c in enumerate(chosen)},
      "prompt_replaced_after_tries": {f"prompt_{i}": c[1] for i, c in enumerate(chosen)},
      "fp8_vs_float_source_max_abs_dlogit": made.fp8_effect,
      "arrays": {
          "prompt_{i}": "int32 [n] prompt ids",
          "gen_{i}": f"int32 [{NEW_TOKENS}] greedy continuation (no EOS; a cache-free re-forward "
                     "loop, equal to generate())",
          "logits_{i}": f"float32 [n + {NEW_TOKENS}, V] logits of prompt_i + gen_i, full forward "
                        "without cache",
      },
      "values": {f"{key}_{i}": [int(t) for t in value] for i, c in enumerate(chosen)
                 for key, value in (("prompt", c[0]), ("gen", c[2]))},
  }


def _device_name(device: str) -> str:
  if device.startswith("cuda") and torch.cuda.is_available():
    return f"{device}: {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
  return device


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--only", nargs="+", choices=SOURCES, metavar="NAME",
                      help=f"source fixtures to make FP8 twins of (default: {' '.join(SOURCES)})")
  parser.add_argument("--out", default=FIXTURES, help="where <name>_fp8/ are written")
  parser.add_argument("--device", default="cuda", help="the device transformers quantizes on")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
  # float32 products in float32 (the reference runs on the CPU; this keeps any GPU step exact too)
  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  results = {}
  for name in args.only or SOURCES:
    try:
      results[name] = build(name, args.out, args.device)
    except Exception as err:  # noqa: BLE001  (one family's failure must not hide the others)
      traceback.print_exc()
      results[name] = f"FAILED: {type(err).__name__}: {err}"
  print_summary(results)
  return 0 if all(isinstance(r, dict) for r in results.values()) else 1


def print_summary(results: dict):
  print(f"\n{'fixture':<16} {'block':>5} {'target':>6} {'mtp':>4} {'kept':>4} {'KiB':>5} "
        f"{'min margin':>10} {'FP8 effect':>10}  expert scales")
  for name, r in results.items():
    if isinstance(r, str):
      print(f"{name + '_fp8':<16} {r}")
      continue
    print(f"{name + '_fp8':<16} {r['block']:>5} {r['target']:>6} {r['mtp']:>4} {r['kept']:>4} "
          f"{r['kib']:>5} {r['margin']:>10.4f} {r['fp8_effect']:>10.4f}  "
          f"{'re-laid per expert' if r['relaid'] else 'as written'}")


if __name__ == "__main__":
  sys.exit(main())
