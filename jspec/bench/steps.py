"""Timing the pieces of a speculative step in isolation, on caches filled with random values.

Each measurement jits one piece exactly as the decoding loop runs it (same modules, same
cache bucket, kv_window = the whole bucket) and times it with the KV cache donated and fed
back, so nothing is copied between calls:
  - target forward of `width` tokens per sequence at a context (width 1: a decode step;
    width k+1: a verify step), logits and argmax included;
  - one MTP draft step (the head on one token, its logits and argmax) and the draft extend
    over k+1 positions;
  - prefill of a prompt bucket.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.bench.roofline import median_seconds
from jspec.models.qwen3 import empty_caches
from jspec.speculative import buckets


def _random_caches(llm, num_layers: int, batch: int, cache_len: int, sharding, seed: int):
  shapes = empty_caches(llm.config, num_layers, batch, cache_len, llm.dtype)
  keys = iter(jax.random.split(jax.random.key(seed), 2 * num_layers))

  def draw(zero):
    fill = jax.jit(lambda key: jax.random.normal(key, zero.shape, jnp.float32).astype(zero.dtype),
                   out_shardings=sharding)
    return fill(next(keys))

  return tuple((draw(k), draw(v)) for k, v in shapes)


def _positions(batch: int, context: int, width: int):
  return jnp.broadcast_to(context - 1 + jnp.arange(width, dtype=jnp.int32), (batch, width))


class StepTimer:
  """Times target and MTP pieces of one LLM (`jspec.LLM`, e.g. from `LLM.from_random`)."""

  def __init__(self, llm, repeats: int = 20):
    self.llm = llm
    self.repeats = repeats
    self.target_graphdef, self.target_state = nnx.split(llm.target)
    self.mtp_graphdef, self.mtp_state = (nnx.split(llm.mtp) if llm.mtp is not None
                                         else (None, None))
    self.compile_seconds = {}
    runner = llm._runner
    self.cache_sharding = runner.ctx.cache_sharding
    self.draft_cache_sharding = runner.ctx.draft_cache_sharding

  def _timed_compile(self, label, fn, *args, donate=()):
    start = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    self.compile_seconds[label] = time.perf_counter() - start
    return compiled

  def target_forward(self, batch: int, context: int, width: int) -> float:
    """Seconds for one target forward of `width` tokens per sequence after `context` tokens."""
    llm, tgd = self.llm, self.target_graphdef
    cache_len = buckets.cache_bucket(context + width, 0, llm.max_model_len)
    caches = _random_caches(llm, llm.config.num_layers, batch, cache_len, self.cache_sharding, 1)
    tokens = jnp.ones((batch, width), jnp.int32)
    positions = _positions(batch, context, width)

    def forward(state, caches, tokens_BT, positions_BT):
      target = nnx.merge(tgd, state)
      hidden, caches = target(tokens_BT, positions_BT, caches, cache_len, llm.experts_fn)
      return jnp.argmax(target.logits(hidden), axis=-1), caches

    step = self._timed_compile(f"target B={batch} S={cache_len} T={width}", forward,
                               self.target_state, caches, tokens, positions, donate=(1,))
    holder = {"caches": caches}

    def run():
      out, holder["caches"] = step(self.target_state, holder["caches"], tokens, positions)
      return out

    return median_seconds(run, repeats=self.repeats)

  def mtp_forward(self, batch: int, context: int, width: int) -> float:
    """Seconds for the MTP head over `width` positions (1: a draft step; k+1: draft extend),
    logits and argmax at one position per sequence, as the loop computes them."""
    llm, tgd, mgd = self.llm, self.target_graphdef, self.mtp_graphdef
    if mgd is None:
      raise ValueError("this model has no MTP head to time")
    cache_len = buckets.cache_bucket(context + width, 0, llm.max_model_len)
    caches = _random_caches(llm, 1, batch, cache_len, self.draft_cache_sharding, 2)[0]
    tokens = jnp.ones((batch, width), jnp.int32)
    hidden = jnp.ones((batch, width, llm.config.hidden_size), llm.dtype)
    positions = _positions(batch, context, width)

    def forward(t_state, m_state, cache, tokens_BT, hidden_BTD, positions_BT):
      target, mtp = nnx.merge(tgd, t_state), nnx.merge(mgd, m_state)
      layer = mtp.layers[0]
      normed, feedback, cache = layer(target, tokens_BT, hidden_BTD, positions_BT, cache,
                                      cache_len, llm.draft_experts_fn)
      logits = layer.logits(target, normed[:, -1:])
      return jnp.argmax(logits, axis=-1), feedback[:, -1], cache

    step = self._timed_compile(f"mtp B={batch} S={cache_len} T={width}", forward,
                               self.target_state, self.mtp_state, caches, tokens, hidden,
                               positions, donate=(2,))
    holder = {"cache": caches}

    def run():
      out, _, holder["cache"] = step(self.target_state, self.mtp_state, holder["cache"], tokens,
                                     hidden, positions)
      return out

    return median_seconds(run, repeats=self.repeats)

  def prefill(self, batch: int, prompt_len: int) -> float:
    """Seconds to run the target over a prompt bucket from position 0 (no sampling)."""
    llm, tgd = self.llm, self.target_graphdef
    tokens = jax.random.randint(jax.random.key(3), (batch, prompt_len), 0, llm.config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    cache_len = buckets.cache_bucket(prompt_len, 0, llm.max_model_len)

    def forward(state, tokens_BP, positions_BP):
      target = nnx.merge(tgd, state)
      caches = jax.tree.map(lambda c: jax.lax.with_sharding_constraint(c, self.cache_sharding),
                            empty_caches(target.cfg, target.cfg.num_layers, batch, cache_len,
                                         llm.dtype))
      hidden, caches = target(tokens_BP, positions_BP, caches, prompt_len, llm.experts_fn)
      return jnp.argmax(target.logits(hidden[:, -1:]), axis=-1), caches

    step = self._timed_compile(f"prefill B={batch} P={prompt_len}", forward, self.target_state,
                               tokens, positions)
    return median_seconds(step, self.target_state, tokens, positions,
                          repeats=max(3, self.repeats // 4))
