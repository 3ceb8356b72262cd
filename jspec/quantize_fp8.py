"""`jspec convert --quantize fp8`: a bfloat16 / float16 / float32 Hugging Face checkpoint
written as a fine-grained FP8 one, in the layout DeepSeek-V3 / R1 and the Qwen FP8 releases
ship (and jspec.models.quantization loads).

Each projection weight of a decoder or MTP layer (attention q/k/v/o and the MLA forms, the
linear-attention qkv(z)/z/out projections, dense MLP, expert and shared-expert gate/up/down)
is quantized by DeepSeek-V3's weight_quant recipe, per (out, in) block of the [out, in]
weight: scale = amax / 448 (e4m3's largest finite value), weight = round-to-nearest-even e4m3
of w / scale; edge blocks may be partial. The weight is written as float8_e4m3fn under its own
name and the scale as float32 `{name}_scale_inv` [ceil(out / b), ceil(in / b)] (despite the
name, the factor the e4m3 values are multiplied by). Everything else (embeddings, lm_head and
MTP heads, norms, biases, MoE routers and their correction bias, the MTP input projection,
Gated DeltaNet's A_log / conv1d / dt_bias / in_proj_a / in_proj_b, a vision tower) is copied
byte for byte, and its modules listed in `modules_to_not_convert` as the Qwen FP8 releases do.

Fused 3-D experts (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F],
transformers' own save format) are written per expert (`mlp.experts.{e}.gate_proj.weight`, ...)
as the published FP8 checkpoints are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jspec.checkpoint import check_output_dir
from jspec.progress import progress

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_SUFFIX = "_scale_inv"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
           "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
           "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_FLOATS = ("F16", "BF16", "F32", "F64")

# The nn.Linear projections of a decoder or MTP layer; a router (`mlp.gate`,
# `shared_expert_gate`), `in_proj_a` / `in_proj_b` / `in_proj_ba`, `eh_proj` / `mtp.fc` and
# the MTP layers' own embedding and head do not match, so stay in their dtype.
_PROJECTION = re.compile(
    r"(?:^|\.)layers\.\d+\.(?:"
    r"self_attn\.(?:q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)"
    r"|linear_attn\.(?:in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.(?:experts\.\d+\.|shared_experts?\.)?(?:gate_proj|up_proj|down_proj)"
    r"|block_sparse_moe\.experts\.\d+\.(?:w1|w2|w3)"
    r")\.weight$")
_FUSED_EXPERTS = re.compile(r"^(.*(?:^|\.)layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_VISION = re.compile(r"(?:^|\.)(?:visual|vision\w*)\.")


@dataclasses.dataclass(frozen=True)
class QuantizeSummary:
  quantized: int  # FP8 weights written (each with its scales)
  kept: int       # tensors copied as they were
  files: int      # safetensors files written


def quantize_block_fp8(w_OI: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
  """(float8_e4m3fn weight [O, I], float32 scale_inv [ceil(O / bo), ceil(I / bo)]) of a [O, I]
  weight, by DeepSeek-V3's weight_quant. An all-zero block gets a tiny scale, not 0 (0 / 0)."""
  (o, i), (bo, bi) = w_OI.shape, block
  go, gi = -(-o // bo), -(-i // bi)
  padded = np.zeros((go * bo, gi * bi), np.float32)  # zeros leave each block's amax alone
  padded[:o, :i] = w_OI
  blocks = padded.reshape(go, bo, gi, bi)
  amax = np.abs(blocks).max(axis=(1, 3))
  if not np.isfinite(amax).all():
    raise ValueError("weight holds inf or NaN: it has no FP8 scale")
  scale = (np.maximum(amax, np.float32(1e-12)) / np.float32(FP8_MAX)).astype(np.float32)
  w8 = (blocks / scale[:, None, :, None]).astype(ml_dtypes.float8_e4m3fn)
  return np.ascontiguousarray(w8.reshape(go * bo, gi * bi)[:o, :i]), scale


def dequantize_block_fp8(w8_OI: np.ndarray, scale: np.ndarray,
                         block: tuple[int, int]) -> np.ndarray:
  """The float32 weight an FP8 one stands for: each e4m3 value times its block's scale."""
  (o, i), (bo, bi) = w8_OI.shape, block
  full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:o, :i]
  return w8_OI.astype(np.float32) * full


class _SafetensorsFile:
  """One safetensors file's header, and its tensors read from their bytes (safetensors' NumPy
  reader has no float8, and bytes copied are bytes kept)."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      header_len = int.from_bytes(f.read(8), "little")
      header = json.loads(f.read(header_len))
    self.metadata = header.pop("__metadata__", None)
    self.entries = header
    self._data_start = 8 + header_len

  def read(self, name: str) -> np.ndarray:
    entry = self.entries[name]
    if entry["dtype"] not in _DTYPES:
      raise ValueError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, which this "
                       f"converter does not copy (known: {', '.join(_DTYPES)})")
    begin, end = entry["data_offsets"]
    with open(self.path, "rb") as f:
      f.seek(self._data_start + begin)
      data = f.read(end - begin)
    if len(data) != end - begin:
      raise ValueError(f"{self.path}: tensor {name!r} ends past the end of the file")
    return np.frombuffer(data, _DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _source_files(model_dir: str) -> tuple[list[str], dict | None]:
  """(the weight files in order, the index json or None for a single model.safetensors)."""
  index_path = os.path.join(model_dir, INDEX_FILE)
  if os.path.isfile(index_path):
    with open(index_path) as f:
      index = json.load(f)
    return sorted(set(index["weight_map"].values())), index
  if os.path.isfile(os.path.join(model_dir, SINGLE_FILE)):
    return [SINGLE_FILE], None
  raise FileNotFoundError(f"{model_dir!r} has no {SINGLE_FILE} or {INDEX_FILE}")


def _refuse_quantized(model_dir: str, config: dict, files: dict[str, _SafetensorsFile]):
  qc = config.get("quantization_config")
  if qc:
    raise ValueError(f"{model_dir} is already quantized (quantization_config quant_method "
                     f"{qc.get('quant_method', '<none given>')!r}); --quantize fp8 takes an "
                     "unquantized checkpoint (bfloat16, float16 or float32)")
  for fname, file in files.items():
    for name, entry in file.entries.items():
      if entry["dtype"].startswith("F8_") or name.endswith(SCALE_SUFFIX):
        raise ValueError(f"{model_dir} holds quantized tensors ({name!r}, {entry['dtype']}, in "
                         f"{fname}) though its config.json declares no quantization; "
                         "--quantize fp8 takes an unquantized checkpoint")


def _quantized_names(name: str, entry: dict) -> list[tuple[str, int | None, int]] | None:
  """What a source tensor becomes: None to copy it, else [(written name, expert or None, which
  half of a fused gate_up: 0 gate, 1 up, -1 the whole)] of [out, in] weights to quantize."""
  if _VISION.search(name):
    return None
  if _PROJECTION.search(name) and len(entry["shape"]) == 2:
    return [(name, None, -1)]
  fused = _FUSED_EXPERTS.match(name)
  if fused and len(entry["shape"]) == 3:
    prefix, which = fused.groups()
    experts = range(entry["shape"][0])
    if which == "down_proj":
      return [(f"{prefix}{e}.down_proj.weight", e, -1) for e in experts]
    return [(f"{prefix}{e}.{part}.weight", e, half) for e in experts
            for half, part in enumerate(("gate_proj", "up_proj"))]
  return None


def _weight(array: np.ndarray, expert: int | None, half: int) -> np.ndarray:
  w = array if expert is None else array[expert]
  if half >= 0:  # fused gate_up_proj [2F, D]: gate rows first
    f = w.shape[0] // 2
    w = w[half * f:(half + 1) * f]
  return w.astype(np.float32)


def _copy_other_files(model_dir: str, out_dir: str):
  """Tokenizer, generation config and the rest at the top level; not the weights (rewritten),
  not config.json (written with its quantization_config), not subfolders (e.g. `original/`
  with a second copy of the unquantized weights)."""
  weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
  for fname in sorted(os.listdir(model_dir)):
    src = os.path.join(model_dir, fname)
    if (os.path.isfile(src) and not fname.endswith(weights)
        and fname not in (INDEX_FILE, "config.json")):
      shutil.copy(src, os.path.join(out_dir, fname))


def _write(path: str, tensors: dict[str, np.ndarray], metadata: dict | None,
           weight_map: dict[str, str]) -> int:
  save_file(tensors, path, metadata=metadata or {"format": "pt"})
  # safetensors writes its files readable by their owner only (0600); a checkpoint is read by
  # others as any file the user writes is: the mode the umask leaves.
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)
  weight_map.update(dict.fromkeys(tensors, os.path.basename(path)))
  return sum(t.nbytes for t in tensors.values())


def quantize_checkpoint(model_dir: str, out_dir: str, block_size: int = 128) -> QuantizeSummary:
  """Writes the Hugging Face checkpoint in `model_dir` to `out_dir` as fine-grained FP8 with
  `block_size` x `block_size` blocks, one output file per source file (same names, an index
  json where the source has one)."""
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
    raise ValueError(f"FP8 block size must be a positive integer, got {block_size!r} "
                     "(the published checkpoints use 128)")
  check_output_dir(out_dir)
  config_path = os.path.join(model_dir, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{model_dir!r} has no config.json")
  with open(config_path) as f:
    config = json.load(f)
  fnames, index = _source_files(model_dir)
  files = {fname: _SafetensorsFile(os.path.join(model_dir, fname)) for fname in fnames}
  _refuse_quantized(model_dir, config, files)

  block = (block_size, block_size)
  plan = {fname: {name: _quantized_names(name, entry) for name, entry in file.entries.items()}
          for fname, file in files.items()}
  for fname, targets in plan.items():
    for name, written in targets.items():
      if written and files[fname].entries[name]["dtype"] not in _FLOATS:
        raise ValueError(f"{name} is {files[fname].entries[name]['dtype']}; --quantize fp8 "
                         f"quantizes floating-point weights ({', '.join(_FLOATS)})")
  kept_modules = {"lm_head"}  # transformers' FP8 classes would convert a tied head otherwise
  weight_map, total_bytes, quantized, kept = {}, 0, 0, 0
  os.makedirs(out_dir, exist_ok=True)
  _copy_other_files(model_dir, out_dir)
  tensors_of = {fname: {} for fname in files}
  left = {fname: len(plan[fname]) for fname in files}
  items = [(fname, name) for fname in files for name in plan[fname]]
  for fname, name in progress(items, f"quantizing to FP8 ({block_size}x{block_size} blocks)"):
    array, tensors, written = files[fname].read(name), tensors_of[fname], plan[fname][name]
    if written is None:
      tensors[name] = array
      kept += 1
      if name.endswith(".weight") and array.ndim >= 2:
        kept_modules.add(name.removesuffix(".weight"))
    else:
      for out_name, expert, half in written:
        try:
          w8, scale = quantize_block_fp8(_weight(array, expert, half), block)
        except ValueError as err:
          raise ValueError(f"{name}: {err}") from None
        tensors[out_name], tensors[out_name + SCALE_SUFFIX] = w8, scale
        quantized += 1
    left[fname] -= 1
    if not left[fname]:  # one file's tensors held at a time: the items go file by file
      total_bytes += _write(os.path.join(out_dir, fname), tensors_of.pop(fname),
                            files[fname].metadata, weight_map)
  for fname in list(tensors_of):  # a source file without tensors
    total_bytes += _write(os.path.join(out_dir, fname), tensors_of.pop(fname),
                          files[fname].metadata, weight_map)
  if index is not None:
    metadata = dict(index.get("metadata") or {}, total_size=total_bytes)
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
      json.dump({"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}, f,
                indent=2)
  config["quantization_config"] = {
      "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": [block_size, block_size],
      "modules_to_not_convert": sorted(kept_modules)}
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return QuantizeSummary(quantized=quantized, kept=kept, files=len(files))
