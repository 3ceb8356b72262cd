"""Quantized checkpoints: what a config's `quantization_config` says, and the refusal of what
jspec does not load, before any weight is read.

jspec loads unquantized checkpoints (bfloat16, float16, float32). A quantized one would fail
deep in loading (a float8 tensor, a `weight_scale_inv` nobody reads) or, worse, load scales as
weights; its config says what it is, so the refusal comes first and names it.
"""

from __future__ import annotations

# The fine-grained FP8 layout (DeepSeek-V3 / R1, Qwen FP8 releases): e4m3 weights with one
# float32 scale per block. Its product kernel exists (jspec.pallas_kernels.fp8_gemm); the
# loading and the models' use of it do not yet.
FP8_METHOD = "fp8"


def quantization_config(hf_config) -> dict | None:
  """The config's quantization_config as a dict (transformers keeps a dict or an object)."""
  qc = getattr(hf_config, "quantization_config", None)
  if qc is None:
    return None
  return qc if isinstance(qc, dict) else qc.to_dict()


def refuse_quantized(hf_config, model_dir: str) -> None:
  qc = quantization_config(hf_config)
  if not qc:
    return
  method = qc.get("quant_method", "<none given>")
  if method == FP8_METHOD:
    blocks = qc.get("weight_block_size")
    layout = (f"float8 weights with a scale per {blocks[0]} x {blocks[1]} block" if blocks
              else "float8 weights with per-tensor scales")
    raise ValueError(
        f"{model_dir} is an FP8 checkpoint (quant_method 'fp8': {layout}); jspec does not "
        "load FP8 weights yet. A bfloat16 copy of the same model loads.")
  raise ValueError(
      f"{model_dir} is quantized with quant_method {method!r}, which jspec does not load; it "
      "loads unquantized checkpoints (bfloat16, float16, float32).")
