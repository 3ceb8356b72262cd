"""The collectives of a model's step programs, read from their optimized HLO.

`step_programs` compiles (or only traces) one step of each kind the decoding loop runs (a decode
step, a verify window of k+1 tokens, an MTP draft step, a prefill chunk) as its own program,
exactly as the loop calls the modules; `collectives` lists every collective of an HLO text with
its element type, shape and bytes. The two give, per mesh, what a step exchanges between
devices: the table of benchmarks/collectives.py and the budgets of tests/test_collectives.py.
"""

from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.bench.profile import HLO_ARRAY, HLO_BYTES
from jspec.bench.steps import abstract_like
from jspec.device import module_cache_shardings
from jspec.models import caches as cache_lib
from jspec.models.projections import with_loop_constants
from jspec.shapes import buckets

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute", "collective-broadcast")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (.*?) (" + "|".join(KINDS) + r")(-start)?\(")


class Collective(NamedTuple):
  kind: str    # "all-reduce", "all-gather", ...
  shape: str   # its result, e.g. "bf16[1,1,4096]" (several for a combined collective)
  bytes: int   # the result's bytes (per device)


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective of an optimized HLO text, in program order. An async pair counts once
  (its -start); a -start's result is the last array of its tuple (the operands come first)."""
  found = []
  for line in hlo_text.splitlines():
    match = _OP.match(line)
    if not match:
      continue
    out_type, kind, start = match.groups()
    arrays = HLO_ARRAY.findall(re.sub(r"\{[^}]*\}", "", out_type))
    if start and kind != "all-reduce" and len(arrays) > 1:
      arrays = arrays[-1:]  # (operand, result[, scratch]) tuples: the result
    size = sum(HLO_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims in arrays)
    found.append(Collective(kind, ",".join(f"{t}[{d}]" for t, d in arrays), size))
  return found


def counts(found: list[Collective]) -> dict[str, int]:
  """{kind: how many}, kinds in KINDS order."""
  tally = collections.Counter(c.kind for c in found)
  return {kind: tally[kind] for kind in KINDS if tally[kind]}


def step_programs(llm, batch: int, k: int = 3, context: int = 64, chunk: int | None = None,
                  kinds=("decode", "verify", "draft", "prefill"), traced: bool = False) -> dict:
  """{kind: optimized HLO text} of one step of each kind, compiled alone for `llm`'s mesh:
  "decode" (1 token per sequence at `context`, its argmax and the cache commit), "verify"
  (k+1 tokens), "draft" (one MTP head step and its argmax; only where the LLM has a head),
  "prefill" (a chunk of `chunk` tokens from position 0, default the LLM's chunk size).
  `traced`: {kind: jax.stages.Traced} instead, nothing lowered or compiled."""
  def build(jitted, *args):
    return jitted.trace(*args) if traced else jitted.lower(*args).compile().as_text()

  tgd, t_state = nnx.split(llm.target)
  cache_shardings = llm._runner.ctx.cache_shardings
  # The loop's own argmax over the target's and the draft's logits (LoopContext).
  argmax, draft_argmax = llm._runner.ctx.vocab_argmax, llm._runner.ctx.draft_vocab_argmax
  batch_spec = llm.rules.sharding(llm.mesh, ("batch", "seq"))
  hidden_spec = llm.rules.sharding(llm.mesh, ("batch", "seq", None))
  ints = lambda width: jax.ShapeDtypeStruct((batch, width), jnp.int32, sharding=batch_spec)
  programs = {}

  def window(width):
    cache_len = buckets.cache_bucket(context + width, 0, llm.max_model_len)
    caches = jax.eval_shape(lambda: llm.target.init_caches(batch, cache_len, llm.dtype))

    def step(state, caches, tokens_BT, positions_BT):
      target = with_loop_constants(nnx.merge(tgd, state))
      hidden, win = target(tokens_BT, positions_BT, caches, cache_len, llm.experts_fn)
      num_emit_B = jnp.full((tokens_BT.shape[0],), tokens_BT.shape[1], jnp.int32)
      return argmax(target.logits(hidden)), cache_lib.commit(win, num_emit_B)
    return build(jax.jit(step, donate_argnums=1), t_state,
                 abstract_like(caches, cache_shardings), ints(width), ints(width))

  if "decode" in kinds:
    programs["decode"] = window(1)
  if "verify" in kinds:
    programs["verify"] = window(k + 1)
  if "draft" in kinds and llm.mtp is not None:
    mgd, m_state = nnx.split(llm.mtp)
    cache_len = buckets.cache_bucket(context + 1, 0, llm.max_model_len)
    cache = jax.eval_shape(lambda: llm.mtp.init_caches(batch, cache_len, llm.dtype)[0])
    draft_shardings = module_cache_shardings(llm.mtp, llm.draft_rules, llm.mesh, llm.dtype)[0]

    def draft(t_state, m_state, cache, tokens_BT, hidden_BTD, positions_BT):
      target = with_loop_constants(nnx.merge(tgd, t_state))
      layer = with_loop_constants(nnx.merge(mgd, m_state)).layers[0]
      normed, _, cache = layer(target, tokens_BT, hidden_BTD, positions_BT, cache, cache_len,
                               llm.draft_experts_fn)
      return draft_argmax(layer.logits(target, normed[:, -1:])), cache
    hidden = jax.ShapeDtypeStruct((batch, 1, llm.config.hidden_size), llm.dtype,
                                  sharding=hidden_spec)
    programs["draft"] = build(jax.jit(draft, donate_argnums=2), t_state, m_state,
                              abstract_like(cache, draft_shardings), ints(1), hidden, ints(1))
  if "prefill" in kinds:
    width = chunk or llm.prefill_chunk_size

    def prefill(state, tokens_BP, positions_BP):
      target = nnx.merge(tgd, state)
      caches = cache_lib.constrain(target.init_caches(batch, width, llm.dtype), cache_shardings)
      hidden, caches = target(tokens_BP, positions_BP, caches, width, llm.experts_fn,
                              seq_lens_B=jnp.full((batch,), width, jnp.int32))
      return argmax(target.logits(hidden[:, -1:])), caches
    programs["prefill"] = build(jax.jit(prefill), t_state, ints(width), ints(width))
  return programs
