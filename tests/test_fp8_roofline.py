"""The roofline of an FP8 checkpoint (jspec.bench.roofline.step_bytes): its layers' weights at
one byte and a float32 scale per 128 x 128 block, the lm_head and the caches as before."""

import dataclasses

import pytest

from jspec.bench.presets import PRESETS
from jspec.bench.roofline import step_bytes


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b", "deepseek-v3"])
def test_fp8_step_reads_its_layer_weights_at_one_byte_and_a_scale_per_block(name):
  bf16 = PRESETS[name]
  fp8 = dataclasses.replace(bf16, fp8_block=(128, 128))
  batch, context = 1, 512
  empty = dataclasses.replace(bf16, num_layers=0, layer_types=())
  # What stays at two bytes: lm_head, final norm and the KV cache; no layer, no cache.
  head = step_bytes(empty, batch, 1, context)
  assert step_bytes(dataclasses.replace(empty, fp8_block=(128, 128)), batch, 1, context) == head
  layers_bf16 = step_bytes(bf16, batch, 1, context) - head
  layers_fp8 = step_bytes(fp8, batch, 1, context) - head
  # The layers' weights halve, their scales adding 4 bytes per 16,384 weights; the routers
  # (MoE) and the KV cache (small at this context) stay at two bytes.
  assert 0.5 < layers_fp8 / layers_bf16 < 0.5 + 0.02
