"""Timing the pieces of a speculative step in isolation, on caches filled with random values.

Each piece runs exactly as the decoding loop runs it (same modules, same cache bucket,
kv_window = the whole bucket), `STEPS_PER_CALL` times inside one `lax.fori_loop` whose carry
is the KV cache (donated, updated in place) and the previous step's argmax token: as in the
engine's while loop, no host work or argument dispatch happens between steps. The time of a
piece is the time of one call over `STEPS_PER_CALL`.
  - target forward of `width` tokens per sequence at a context (width 1: a decode step;
    width k+1: a verify step), logits and argmax included;
  - one MTP draft step (the head on one token, its logits and argmax) and the draft extend
    over k+1 positions;
  - prefill of a prompt bucket (one call, no loop);
  - MLA models: the attention over the latent cache alone (`mla_attention`), to set against the
    latent bytes it must read;
  - MoE models: the experts each layer routes in a step (`routed_experts`), for its bytes.
The programs of one (batch, context) are compiled concurrently (XLA compiles off the GIL).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.bench.roofline import seconds_per_call
from jspec.device import module_cache_shardings
from jspec.models import caches as cache_lib
from jspec.models.projections import with_loop_constants
from jspec.shapes import buckets
from jspec.speculative.sampling import vocab_argmax

STEPS_PER_CALL = 8


def _random_caches(shapes, shardings, seed: int):
  """Caches of these shapes filled with random values (recurrent states scaled small, as
  trained states are bounded), each born in its sharding."""
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(seed), len(leaves))

  def draw(zero, sharding, key):
    scale = 0.05 if zero.dtype == jnp.float32 else 1.0
    fill = jax.jit(lambda k: (scale * jax.random.normal(k, zero.shape, jnp.float32)
                              ).astype(zero.dtype), out_shardings=sharding)
    return fill(key)

  return jax.tree.unflatten(treedef, [draw(z, sh, k) for z, sh, k in
                                      zip(leaves, jax.tree.leaves(shardings), keys)])


def abstract_like(tree, shardings):
  return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree,
                      shardings)


def _positions(batch: int, context: int, width: int):
  return jnp.broadcast_to(context - 1 + jnp.arange(width, dtype=jnp.int32), (batch, width))


class StepTimer:
  """Times target and MTP pieces of one LLM (`jspec.LLM`, e.g. from `LLM.from_random`)."""

  def __init__(self, llm):
    self.llm = llm
    self.target_graphdef, self.target_state = nnx.split(llm.target)
    self.mtp_graphdef, self.mtp_state = (nnx.split(llm.mtp) if llm.mtp is not None
                                         else (None, None))
    self.compile_seconds = {}
    # {("target" | "mtp", width): zero-argument call of the last measured program}, for
    # profiling a piece after timing it (benchmarks/decode_step.py).
    self.runs = {}
    self.programs = {}  # (kind, width) -> compiled program of the last measure()
    runner = llm._runner
    self.cache_shardings = runner.ctx.cache_shardings
    # The head's layout even when the runner's method needs none (timing an MTP step anyway).
    self.draft_cache_shardings = (None if llm.mtp is None else module_cache_shardings(
        llm.mtp, llm.draft_rules, llm.mesh, llm.dtype))

  # --- programs ------------------------------------------------------------------------------

  def _target_steps(self, cache_len: int, experts_of_step=None):
    """experts_of_step(i) -> the experts_fn of loop step i (default: the LLM's, every step)."""
    llm, tgd = self.llm, self.target_graphdef
    experts_of_step = experts_of_step or (lambda i: llm.experts_fn)

    def steps(state, caches, tokens_BT, positions_BT):
      # The FP8 kernels' scale lanes made before the loop, as the schedulers' programs do.
      target = with_loop_constants(nnx.merge(tgd, state))

      def body(i, carry):
        caches, tokens_BT = carry
        hidden, window = target(tokens_BT, positions_BT, caches, cache_len, experts_of_step(i))
        next_BT = vocab_argmax(target.logits(hidden)).astype(jnp.int32)
        # As the loop does: commit the window (all of it; recurrent layers pay their commit).
        num_emit_B = jnp.full((tokens_BT.shape[0],), tokens_BT.shape[1], jnp.int32)
        return cache_lib.commit(window, num_emit_B), next_BT

      caches, tokens_BT = jax.lax.fori_loop(0, STEPS_PER_CALL, body, (caches, tokens_BT))
      return tokens_BT, caches

    return steps

  def _mtp_steps(self, cache_len: int):
    llm, tgd, mgd = self.llm, self.target_graphdef, self.mtp_graphdef

    def steps(t_state, m_state, cache, tokens_BT, hidden_BTD, positions_BT):
      target = with_loop_constants(nnx.merge(tgd, t_state))
      mtp = with_loop_constants(nnx.merge(mgd, m_state))
      layer = mtp.layers[0]

      def body(_, carry):
        cache, tokens_BT, hidden_BTD = carry
        normed, feedback, cache = layer(target, tokens_BT, hidden_BTD, positions_BT, cache,
                                        cache_len, llm.draft_experts_fn)
        draft_B1 = vocab_argmax(layer.logits(target, normed[:, -1:])).astype(jnp.int32)
        # The next call drafts from this one's output, as chained draft steps do.
        tokens_BT = jnp.broadcast_to(draft_B1, tokens_BT.shape)
        return cache, tokens_BT, jnp.broadcast_to(feedback[:, -1:], hidden_BTD.shape)

      cache, tokens_BT, _ = jax.lax.fori_loop(0, STEPS_PER_CALL, body,
                                              (cache, tokens_BT, hidden_BTD))
      return tokens_BT, cache

    return steps

  def _compile(self, label, fn, args, donate):
    start = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    self.compile_seconds[label] = time.perf_counter() - start
    print(f"  compiled {label} in {self.compile_seconds[label]:.1f} s", flush=True)
    return compiled

  # --- measurements --------------------------------------------------------------------------

  def measure(self, batch: int, context: int, target_widths, mtp_widths=()) -> dict:
    """Seconds per step for each target width and each MTP width at this batch and context:
    {("target", w): s, ("mtp", w): s}."""
    llm = self.llm
    if mtp_widths and self.mtp_graphdef is None:
      raise ValueError("this model has no MTP head to time")
    widths = sorted(set(target_widths) | set(mtp_widths))
    cache_len = buckets.cache_bucket(context + max(widths), 0, llm.max_model_len)
    target_caches = jax.eval_shape(lambda: llm.target.init_caches(batch, cache_len, llm.dtype))
    draft_cache = (jax.eval_shape(lambda: llm.mtp.init_caches(batch, cache_len, llm.dtype)[0])
                   if llm.mtp is not None else None)
    inputs = {w: (jnp.ones((batch, w), jnp.int32),
                  jnp.ones((batch, w, llm.config.hidden_size), llm.dtype),
                  _positions(batch, context, w)) for w in widths}
    jobs = {}
    for w in sorted(set(target_widths)):
      tokens, _, positions = inputs[w]
      jobs[("target", w)] = (
          f"target B={batch} S={cache_len} T={w}", self._target_steps(cache_len),
          (self.target_state, abstract_like(target_caches, self.cache_shardings), tokens, positions),
          (1,))
    for w in sorted(set(mtp_widths)):
      jobs[("mtp", w)] = (
          f"mtp B={batch} S={cache_len} T={w}", self._mtp_steps(cache_len),
          (self.target_state, self.mtp_state,
           abstract_like(draft_cache, self.draft_cache_shardings[0]),
           *inputs[w]), (2,))
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
      futures = {key: pool.submit(self._compile, *job) for key, job in jobs.items()}
      programs = {key: f.result() for key, f in futures.items()}
    self.programs.update(programs)  # the compiled step programs, for their HLO

    holder = {"target": _random_caches(target_caches, self.cache_shardings, 1)}
    if mtp_widths:
      holder["mtp"] = _random_caches(draft_cache, self.draft_cache_shardings[0], 2)
    seconds = {}
    for key, program in programs.items():
      kind, w = key
      tokens, hidden, positions = inputs[w]

      def run(program=program, kind=kind, tokens=tokens, hidden=hidden, positions=positions):
        if kind == "target":
          out, holder[kind] = program(self.target_state, holder[kind], tokens, positions)
        else:
          out, holder[kind] = program(self.target_state, self.mtp_state, holder[kind], tokens,
                                      hidden, positions)
        return out

      seconds[key] = seconds_per_call(run, [()]) / STEPS_PER_CALL
      self.runs[key] = run
    return seconds

  def routed_experts(self, batch: int, context: int, width: int = 1) -> list[np.ndarray]:
    """The expert ids [steps, B*T, top_k] each MoE layer of the target routes in the loop that
    `measure` times (STEPS_PER_CALL steps from token 1 at the context's positions, the same
    random caches, each step fed the previous step's argmax), in layer order: what the timed
    steps' MoE layers must read, however far from uniform the router is. The first step alone
    is not enough: its batch rows all hold token 1, and a router sends such rows to few
    experts, while the argmax tokens of the later steps differ from row to row."""
    llm = self.llm
    cache_len = buckets.cache_bucket(context + width, 0, llm.max_model_len)
    shapes = jax.eval_shape(lambda: llm.target.init_caches(batch, cache_len, llm.dtype))
    caches = _random_caches(shapes, self.cache_shardings, 1)
    recorded = {}

    def record(layer, step, ids_TK):
      recorded[int(step), layer] = np.asarray(ids_TK)

    def recording_experts(step):
      order = itertools.count()  # MoE layers call the experts in layer order while tracing

      def experts(x_TD, ids_TK, *weights):
        jax.debug.callback(functools.partial(record, next(order)), step, ids_TK)
        return llm.experts_fn(x_TD, ids_TK, *weights)

      return experts

    program = jax.jit(self._target_steps(cache_len, recording_experts))
    jax.block_until_ready(program(self.target_state, caches, jnp.ones((batch, width), jnp.int32),
                                  _positions(batch, context, width)))
    jax.effects_barrier()
    layers = sorted({layer for _, layer in recorded})
    return [np.stack([recorded[step, layer] for step in range(STEPS_PER_CALL)])
            for layer in layers]

  def prefill(self, batch: int, prompt_len: int) -> float:
    """Seconds to run the target over a prompt bucket from position 0 (no sampling)."""
    llm, tgd = self.llm, self.target_graphdef
    tokens = jax.random.randint(jax.random.key(3), (batch, prompt_len), 0, llm.config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    cache_len = buckets.cache_bucket(prompt_len, 0, llm.max_model_len)

    def forward(state, tokens_BP, positions_BP):
      target = nnx.merge(tgd, state)
      caches = cache_lib.constrain(target.init_caches(batch, cache_len, llm.dtype),
                                   self.cache_shardings)
      hidden, caches = target(tokens_BP, positions_BP, caches, prompt_len, llm.experts_fn,
                              seq_lens_B=jnp.full((batch,), prompt_len, jnp.int32))
      return vocab_argmax(target.logits(hidden[:, -1:])), caches

    step = self._compile(f"prefill B={batch} P={prompt_len}", forward,
                         (self.target_state, tokens, positions), ())
    return seconds_per_call(step, [(self.target_state, tokens, positions)])

  def mla_attention(self, batch: int, context: int, width: int = 1) -> float:
    """Seconds of the target's first-layer attention over its latent cache for a window of
    `width` tokens ending at this context: `MLAttention.latent_context` alone (the kernel that
    attention_backend set, else XLA's scores against every row of the bucket, causal softmax,
    the weighted rows), from random queries in latent space,
    `STEPS_PER_CALL` chained calls in one loop."""
    llm = self.llm
    attn = llm.target.layers[0].attn
    cache_len = buckets.cache_bucket(context + width, 0, llm.max_model_len)
    shapes = jax.eval_shape(lambda: llm.target.layer_cache(0, batch, cache_len, llm.dtype))
    cache = _random_caches(shapes, self.cache_shardings[0], 4)
    width_l = shapes.latent.shape[-1]
    q_sharding = llm.rules.sharding(llm.mesh, ("batch", "seq", "q_heads", "latent"))
    draw = jax.jit(lambda key: jax.random.normal(
        key, (batch, width, llm.config.num_heads, width_l), jnp.float32).astype(llm.dtype),
                   out_shardings=q_sharding)
    q_BTNL = draw(jax.random.key(5))
    positions_BT = _positions(batch, context, width)
    # The layer's own path: the MLA kernel where the LLM set it, else XLA's over the bucket.
    latent_context = attn.latent_context

    def steps(q_BTNL, cache):
      def body(_, q_BTNL):  # each call's query depends on the previous call's output
        context_BTNC = latent_context(q_BTNL, cache.latent, positions_BT)
        return q_BTNL + (1e-3 * jnp.mean(context_BTNC)).astype(q_BTNL.dtype)
      return jax.lax.fori_loop(0, STEPS_PER_CALL, body, q_BTNL)

    program = self._compile(f"mla attention B={batch} S={cache_len} T={width}", steps,
                            (q_BTNL, cache), ())
    run = lambda: program(q_BTNL, cache)
    self.runs[("mla_attention", width)] = run
    return seconds_per_call(run, [()]) / STEPS_PER_CALL
