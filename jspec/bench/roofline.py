"""What a step must read from HBM, and how fast this device can read it.

A decode or verify step is memory-bound: its floor is the bytes it must move (every weight
matrix it uses once, plus the valid part of the KV cache) over the device's bandwidth,
measured in the same run by a large copy and a large read.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig


def median_seconds(fn, *args, repeats: int = 20, warmup: int = 3) -> float:
  """Median wall time of fn(*args) after warm-up, each call blocked until ready."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def hbm_bandwidth(num_bytes: int = 2 << 30) -> dict:
  """Copy (read + write) and read-only bandwidth in bytes/s over random bf16 data."""
  n = num_bytes // 2
  data = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
  copy_s = median_seconds(jax.jit(lambda a: a * 2), data, repeats=10)
  read_s = median_seconds(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), data, repeats=10)
  return {"copy": 2 * num_bytes / copy_s, "read": num_bytes / read_s}


def expected_experts_used(num_experts: int, top_k: int, num_tokens: int) -> float:
  """Distinct experts hit by num_tokens tokens routed uniformly to top_k of num_experts."""
  miss = (1 - top_k / num_experts) ** num_tokens
  return num_experts * (1 - miss)


def step_bytes(cfg: ModelConfig, batch: int, width: int, context: int, itemsize: int = 2) -> int:
  """Least bytes one forward of `width` tokens per sequence must read at this context:
  every weight it uses once (the embedding rows are negligible; experts that receive tokens
  under uniform routing) plus each sequence's valid keys and values."""
  d, h = cfg.hidden_size, cfg.head_dim
  attention = d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * h + 2 * d
  weights = 0
  for layer in range(cfg.num_layers):
    weights += attention
    if cfg.layer_is_moe(layer):
      used = expected_experts_used(cfg.num_experts, cfg.num_experts_per_tok, batch * width)
      weights += d * cfg.num_experts + used * 3 * d * cfg.moe_intermediate_size
    else:
      weights += 3 * d * cfg.intermediate_size
  weights += d * cfg.vocab_size + d  # lm_head (tied or not, it is read once) and final norm
  kv = batch * (context + width) * cfg.num_layers * 2 * cfg.num_kv_heads * h
  return int(np.ceil((weights + kv) * itemsize))
