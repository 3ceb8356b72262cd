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


def seconds_per_call(fn, arg_sets, min_batch_s: float = 5e-3, warmup: int = 2,
                     batches: int | None = None, clock=time.perf_counter) -> float:
  """Device seconds per call of fn(*args), args rotating over `arg_sets`: the slope of a
  batch's time over its calls, from `batches` pairs of batches (None: 3).

  Calls are queued back to back and blocked on once per batch, so that host dispatch overlaps
  device work; rotating over several argument sets keeps a small input from being served from
  L2. What a batch cannot hide is a fixed part: the first call's dispatch, which the device
  waits for, and the final wait. For a model's step program that dispatch is milliseconds (its
  hundreds of weight arrays: 2.0 ms a call for Qwen3-30B-A3B's 48 layers on an H200), and a
  batch of 3 calls divided by 3 put that model's batch-1 step 5% above its slope
  (BENCHMARKS.md, "The step timer's slope ..."). So batches of n and of 3n calls are timed in
  turns and the figure is their medians' difference over 2n calls, which the fixed part does
  not enter. n: enough calls for `min_batch_s`, at least 2 (1 for calls over 50 ms).
  `clock`: seconds from any origin (a simulated device's clock in tests).
  """
  for i in range(warmup):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  start = clock()
  jax.block_until_ready(fn(*arg_sets[0]))
  first = clock() - start
  short_n = int(min(50, max(1 if first > 0.05 else 2, min_batch_s / max(first, 1e-6))))
  long_n = 3 * short_n
  num_pairs = batches or 3

  calls_made = 1  # the argument sets rotate over every call from the one timed alone on

  def batch_seconds(calls: int) -> float:
    nonlocal calls_made
    start = clock()
    out = None
    for _ in range(calls):
      out = fn(*arg_sets[calls_made % len(arg_sets)])
      calls_made += 1
    jax.block_until_ready(out)
    return clock() - start

  shorts, longs = [], []
  for _ in range(num_pairs):
    shorts.append(batch_seconds(short_n))
    longs.append(batch_seconds(long_n))
  short_s, long_s = statistics.median(shorts), statistics.median(longs)
  slope = (long_s - short_s) / (long_n - short_n)
  # Calls far shorter than the clock's jitter (tiny CPU programs) can give a slope at or
  # below zero (or under a nanosecond, no call's time); then the long batches' mean per
  # call, an upper bound, is returned.
  return slope if slope > 1e-9 else long_s / long_n


READS_PER_CALL = 16


def hbm_bandwidth(num_bytes: int = 2 << 30) -> dict:
  """Copy (read + write) and read-only bandwidth in bytes/s over random bf16 data.

  The read is timed as `READS_PER_CALL` full reads inside one on-device loop, as the step
  timer runs its steps: with one read per call, queued half-millisecond calls relied on the
  host keeping up, and probes of one GPU ranged from 3.5 to 4.3 TB/s while other processes
  compiled on the same host.
  """
  a = jax.random.normal(jax.random.key(0), (num_bytes // 2,), jnp.bfloat16)
  b = a + 1
  copy_s = seconds_per_call(jax.jit(lambda x: x * 2), [(a,), (b,)])

  def reads(x):
    def body(i, total):
      # The scale depends on the previous pass's total: the passes run one after another,
      # each reading all of x (independent passes could be fused into one read).
      scale = (i + (total > 1e30)).astype(x.dtype)
      return total + jnp.sum(x * scale, dtype=jnp.float32)
    return jax.lax.fori_loop(0, READS_PER_CALL, body, jnp.float32(0))

  read_s = seconds_per_call(jax.jit(reads), [(a,), (b,)]) / READS_PER_CALL
  return {"copy": 2 * num_bytes / copy_s, "read": num_bytes / read_s}


def expected_experts_used(num_experts: int, top_k: int, num_tokens: int) -> float:
  """Distinct experts hit by num_tokens tokens routed uniformly to top_k of num_experts."""
  miss = (1 - top_k / num_experts) ** num_tokens
  return num_experts * (1 - miss)


def distinct_experts(ids) -> float:
  """Experts that at least one of a step's tokens was routed to in one MoE layer (ids
  [tokens, top_k]): each is read once, however many tokens it takes. For the ids of several
  steps ([steps, tokens, top_k], as StepTimer.routed_experts records them) the mean over the
  steps of each step's count.

  Uniform routing is what `expected_experts_used` assumes; real routers are not uniform, and
  random ones with a correction bias (benchmark models) send most tokens to a few experts, so
  a step's MoE bytes are counted from the experts it routed (StepTimer.routed_experts)."""
  ids = np.asarray(ids)
  if ids.ndim == 3:
    return float(np.mean([np.unique(step).size for step in ids]))
  return int(np.unique(ids).size)


def routed_expert_bytes(cfg: ModelConfig, experts_used, itemsize: int = 2) -> int:
  """Bytes of the routed experts' weights a step reads: gate, up and down of every expert
  counted in `experts_used` (one count per MoE layer)."""
  return int(sum(experts_used)) * 3 * cfg.hidden_size * cfg.moe.intermediate_size * itemsize


def cache_values_per_token(cfg: ModelConfig) -> int:
  """Values one full-attention layer caches per token: keys and values of every KV head, or
  MLA's latent and rope key (shared by all heads)."""
  if cfg.is_mla:
    return cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
  return 2 * cfg.num_kv_heads * cfg.head_dim


def mla_weights(cfg: ModelConfig) -> int:
  """Parameters of one MLA layer's attention, and the layer's two norms."""
  d, n, q, c = cfg.hidden_size, cfg.num_heads, cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank
  p, r, v = cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
  query = d * q + q + q * n * (p + r) if q else d * n * (p + r)
  return query + d * (c + r) + c + n * (p + v) * c + n * v * d + 2 * d


def mla_attention_bytes(cfg: ModelConfig, batch: int, context: int, itemsize: int = 2) -> int:
  """Least bytes of MLA decode attention over the latent (jspec.models.mla.latent_attention):
  each sequence's cached rows, read once."""
  return batch * context * cache_values_per_token(cfg) * itemsize


def step_bytes(cfg: ModelConfig, batch: int, width: int, context: int, itemsize: int = 2,
               experts_used=None) -> int:
  """Least bytes one forward of `width` tokens per sequence must read at this context:
  every weight it uses once (the embedding rows are negligible; the routed experts that
  receive tokens) plus each sequence's valid keys and values (or MLA latent rows) in
  full-attention layers, and each sequence's float32 state in linear-attention layers, read
  once and written once. `experts_used`: the distinct experts each MoE layer routed in the
  step (`distinct_experts`, in layer order); None: the expectation under uniform routing.
  With `cfg.fp8_block` set: the layers' weights at one byte each plus a float32 scale per block
  (FP8 checkpoints; their norms and biases, a negligible share, counted likewise), the
  routers, the lm_head and the caches at `itemsize`."""
  layer_itemsize = itemsize
  if cfg.fp8_block is not None:
    layer_itemsize = 1 + 4 / (cfg.fp8_block[0] * cfg.fp8_block[1])
  return _step_bytes(cfg, batch, width, context, itemsize, layer_itemsize, experts_used)


def _step_bytes(cfg: ModelConfig, batch: int, width: int, context: int, itemsize: float,
                layer_itemsize: float, experts_used) -> int:
  """step_bytes with the layers' weights at `layer_itemsize` bytes each."""
  d, h = cfg.hidden_size, cfg.head_dim
  hybrid = bool(cfg.layer_types)
  query = (2 if hybrid else 1) * cfg.num_heads  # gated attention: a query and a gate per head
  attention = d * h * (query + cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * h * cfg.use_qk_norm
  attention += 2 * d + h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.attention_bias
  attention += d * cfg.o_proj_bias
  if cfg.is_mla:
    attention = mla_weights(cfg)
  linear, g, r, dk, dv = 0, 0, 0, 0, 0
  if cfg.linear is not None:
    g, dk, dv = cfg.linear.num_key_heads, cfg.linear.key_head_dim, cfg.linear.value_head_dim
    r = cfg.linear.num_value_heads // g
    linear = d * g * (2 * dk + 2 * r * dv + 2 * r) + g * r * dv * d + 2 * d + dv
  weights, kv_layers, state_bytes = 0, 0, 0
  moe_layers = [layer for layer in range(cfg.num_layers) if cfg.layer_is_moe(layer)]
  if experts_used is not None and len(experts_used) != len(moe_layers):
    raise ValueError(f"experts_used has {len(experts_used)} counts for {len(moe_layers)} MoE "
                     "layers")
  for layer in range(cfg.num_layers):
    if cfg.layer_type(layer) == "linear_attention":
      weights += linear
      state_bytes += 2 * batch * g * r * dk * dv * 4
    else:
      weights += attention
      kv_layers += 1
    if cfg.layer_is_moe(layer):
      moe = cfg.moe
      used = (expected_experts_used(moe.num_experts, moe.num_experts_per_tok, batch * width)
              if experts_used is None else experts_used[moe_layers.index(layer)])
      weights += used * 3 * d * moe.intermediate_size
      weights += 3 * d * moe.shared_expert_intermediate_size + d * bool(
          moe.shared_expert_intermediate_size)
      weights += 3 * d * moe.intermediate_size * moe.num_shared_experts
      # The router in the model's dtype (never quantized), added with the state bytes.
      state_bytes += (d * moe.num_experts + moe.num_experts * moe.router_correction_bias) * (
          itemsize)
    else:
      weights += 3 * d * cfg.intermediate_size
  head = d * cfg.vocab_size + d  # lm_head (tied or not, it is read once) and final norm
  kv = batch * (context + width) * kv_layers * cache_values_per_token(cfg)
  return int(np.ceil(weights * layer_itemsize + (head + kv) * itemsize)) + state_bytes
