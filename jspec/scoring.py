"""Whole sequences scored by the target in one forward each, nothing sampled: the logits of
`LLM.compute_logits` and the prompt log-probabilities a request asks for (`prompt_logprobs`).

Sequences run in batches of at most max_num_seqs, one jitted program per (batch, length)
bucket; each runs the target's prefill path (in chunks of prefill_chunk_size) over a cache of
its own length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.device import DeviceModel
from jspec.models import caches as cache_lib
from jspec.outputs import position_logprobs
from jspec.sharding.rules import to_host
from jspec.shapes import buckets
from jspec.shapes.chunks import in_chunks
from jspec.speculative.logprobs import prompt_logprobs_fn


class Scorer:
  """The target's full-sequence programs over a DeviceModel (jspec.device)."""

  def __init__(self, device: DeviceModel, parts):
    self.device, self.parts = device, parts
    self._logits_programs = {}  # (batch, length) -> jitted full-sequence logits
    self._prompt_programs = {}  # (batch, length, alternatives) -> jitted prompt logprobs

  def logits(self, sequences: list[list[int]]) -> list[np.ndarray]:
    """Full-sequence target logits, in batches of at most max_num_seqs, one program per bucket."""
    results = []
    for start in range(0, len(sequences), self.parts.max_num_seqs):
      results += self._logits_batch(sequences[start:start + self.parts.max_num_seqs])
    return results

  def _logits_batch(self, sequences: list[list[int]]) -> list[np.ndarray]:
    parts = self.parts
    batch = buckets.batch_bucket(len(sequences), parts.mesh_config.batch_width)
    length = buckets.prompt_bucket(max(len(s) for s in sequences), parts.max_model_len)
    tokens = np.zeros((batch, length), np.int32)
    for row, s in enumerate(sequences):
      tokens[row, :len(s)] = s
    if (batch, length) not in self._logits_programs:
      self._logits_programs[batch, length] = jax.jit(self._logits_fn(batch, length))
    logits_fn = self._logits_programs[batch, length]
    logits = to_host(logits_fn(self.device.target_state, self.device.put(tokens, ("batch", "seq"))))
    # The true vocabulary: the columns that pad it to the vocab shards are not the model's.
    vocab = parts.config.vocab_size
    return [logits[row, :len(s), :vocab] for row, s in enumerate(sequences)]

  def _logits_fn(self, batch: int, length: int):
    tgd, ctx = self.device.target_graphdef, self.device.ctx
    chunk = self.parts.prefill_chunk_size

    def logits_fn(target_state, tokens_BT):
      target = nnx.merge(tgd, target_state)
      positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens_BT.shape)
      caches = cache_lib.constrain(target.init_caches(batch, length, ctx.dtype),
                                   ctx.cache_shardings)
      # Every position is "valid": padding after a sequence cannot reach its logits.
      full_B = jnp.full((batch,), length, jnp.int32)
      hidden_BTD, _ = in_chunks(
          lambda t, p, c: target(t, p, c, length, ctx.experts_fn, seq_lens_B=full_B),
          (tokens_BT, positions_BT), caches, chunk)
      return target.logits(hidden_BTD)

    return logits_fn

  def prompt_logprobs(self, prompt_ids, params, decode):
    """{request: [None, {token: Logprob}, ...]} for the requests that ask, or None."""
    asked = [i for i, p in enumerate(params) if p.prompt_logprobs is not None]
    if not asked:
      return None
    device, parts = self.device, self.parts
    num_top = max(params[i].prompt_logprobs for i in asked)
    results = [None] * len(prompt_ids)
    step = parts.max_num_seqs
    for begin in range(0, len(asked), step):
      rows = asked[begin:begin + step]
      batch = buckets.batch_bucket(len(rows), parts.mesh_config.batch_width)
      length = buckets.prompt_bucket(max(len(prompt_ids[i]) for i in rows), parts.max_model_len)
      tokens = np.zeros((batch, length), np.int32)
      for r, i in enumerate(rows):
        tokens[r, :len(prompt_ids[i])] = prompt_ids[i]
      key = (batch, length, num_top)
      if key not in self._prompt_programs:
        self._prompt_programs[key] = jax.jit(prompt_logprobs_fn(
            device.target_graphdef, device.ctx.experts_fn, device.ctx.dtype,
            device.ctx.cache_shardings, batch, length, parts.prefill_chunk_size, num_top))
      out = to_host(self._prompt_programs[key](device.target_state,
                                               device.put(tokens, ("batch", "seq"))))
      for r, i in enumerate(rows):
        prompt, top = prompt_ids[i], params[i].prompt_logprobs
        m = len(prompt) - 1  # position t scores token t + 1
        results[i] = [None] + position_logprobs(
            prompt[1:], out.logprob_N[r, :m], out.rank_N[r, :m], out.top_ids_NX[r, :m, :top],
            out.top_logprobs_NX[r, :m, :top], decode)
    return results
