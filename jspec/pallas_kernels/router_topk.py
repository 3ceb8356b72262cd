"""Softmax routing of a decode or verify step in two small Pallas (Triton) kernels: the router
product, then the softmax, the top-k and the renormalisation.

Why: at batch 1 the router is a handful of tiny XLA kernels a MoE layer, each costing its
launch and a few hundred bytes of work: Qwen3-30B-A3B's router product as a convert and a
multiply-reduce (XLA strength-reduces a one-row dot), the softmax, a copy, a sort for the top-k
and three small fusions: 14.6 µs a layer, 0.70 ms of a 3.8 ms step on an H200 (BENCHMARKS.md,
"Softmax routing in two kernels"). Here:

  router_partials  program (t, s): token t's x against slice s of the router weight's rows,
                   the float32 partial logits of every expert. The slices spread the weight's
                   read (0.5 MB for 2048 x 128) over several SMs; one program alone streams it
                   at a single SM's rate.
  router_select    program t: the partials summed, rounded to the activations' dtype (XLA's
                   einsum hands the router logits over in that dtype), softmax in float32, the
                   top-k by repeated maxima, ties to the lower expert index as `lax.top_k`
                   breaks them, and the k weights renormalised when asked.

It computes what jspec.models.moe.route computes on XLA's logits, up to the order of the
float32 sums (the router product's, the softmax's).

One token (batch-1 decode): route_softmax_plan's select kernel also writes that token's decode
plan (jspec.pallas_kernels.decode_routing.plan_decode of its ids and weights, bit for bit), so
that no XLA kernel runs between the top-k and the expert kernels: plan_decode's select and pad
were two small kernels a MoE layer (~1.9 µs at Qwen3-30B-A3B's shapes on an H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import decode_routing, platform
from jspec.pallas_kernels.decode_routing import DecodePlan

MAX_TOKENS = 64      # decode, verify and draft steps; prefill chunks keep XLA's
MAX_EXPERTS = 1024   # one Triton block of logits a program
ROW_CHUNK = 64       # router rows a loop step of router_partials reads
SLICE_ROWS = 128     # router rows a program of router_partials reads, about (num_slices)
NUM_WARPS = 4


def fits_kernel(num_tokens: int, hidden: int, num_experts: int, top_k: int) -> bool:
  """Tokens of a step, experts a power of two (a Triton block), the hidden size in whole
  loop steps."""
  return (1 <= num_tokens <= MAX_TOKENS and 8 <= num_experts <= MAX_EXPERTS
          and num_experts & (num_experts - 1) == 0 and hidden % ROW_CHUNK == 0
          and 1 <= top_k <= num_experts)


def num_slices(hidden: int) -> int:
  """Slices of the router's rows (a power of two: a Triton block of partials): about
  SLICE_ROWS rows each, whole loop steps."""
  slices = 1
  while hidden // (2 * slices) >= SLICE_ROWS and hidden % (2 * slices * ROW_CHUNK) == 0:
    slices *= 2
  return slices


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _partials_kernel(x_ref, w_ref, out_ref, *, rows: int):
  t, s = pl.program_id(0), pl.program_id(1)
  first = s * rows

  # Products summed per row of the chunk, across rows once at the end: a sum across the
  # chunk's rows in every loop step (threads exchanging partials) ran at a fraction of the
  # loads' rate.
  def body(i, acc_CE):
    cols = pl.ds(first + i * ROW_CHUNK, ROW_CHUNK)
    x_C = x_ref[t, cols].astype(jnp.float32)
    return acc_CE + x_C[:, None] * w_ref[cols, :].astype(jnp.float32)

  experts = w_ref.shape[1]
  acc_CE = lax.fori_loop(0, rows // ROW_CHUNK, body,
                         jnp.zeros((ROW_CHUNK, experts), jnp.float32))
  out_ref[t, s, :] = jnp.sum(acc_CE, axis=0)


def _top_k(parts_ref, t, width: int, *, top_k: int, norm: bool, logits_dtype):
  """(ids [W] int32, float32 weights [W]) of token t, lanes past top_k 0: the partials summed,
  rounded to the logits' dtype, softmax, the top-k and its renormalisation."""
  experts = parts_ref.shape[2]
  logits_E = jnp.sum(parts_ref[t, :, :], axis=0).astype(logits_dtype).astype(jnp.float32)
  top_E = jnp.max(logits_E)
  exp_E = jnp.exp(logits_E - top_E)
  probs_E = exp_E / jnp.sum(exp_E)
  expert_E = lax.broadcasted_iota(jnp.int32, (experts,), 0)
  k_K = lax.broadcasted_iota(jnp.int32, (width,), 0)
  ids_K = jnp.zeros((width,), jnp.int32)
  weights_K = jnp.zeros((width,), jnp.float32)
  left_E = probs_E
  for k in range(top_k):  # k picks in order: the largest left, the lowest index of equals
    best = jnp.max(left_E)
    pick = jnp.min(jnp.where(left_E == best, expert_E, experts))
    ids_K = jnp.where(k_K == k, pick, ids_K)
    weights_K = jnp.where(k_K == k, best, weights_K)
    left_E = jnp.where(expert_E == pick, -1.0, left_E)  # probabilities are >= 0
  if norm:
    weights_K = weights_K / jnp.sum(weights_K)
  return ids_K, weights_K


def _select_kernel(parts_ref, ids_ref, weights_ref, **pick):
  t = pl.program_id(0)
  # ids_ref's width: top_k rounded up to a power of two (a Triton block)
  ids_K, weights_K = _top_k(parts_ref, t, ids_ref.shape[1], **pick)
  ids_ref[t, :] = ids_K
  weights_ref[t, :] = weights_K.astype(weights_ref.dtype)


def _select_plan_kernel(parts_ref, ids_ref, weights_ref, slot_expert_ref, weight_ref, **pick):
  """_select_kernel of the one token, and plan_decode's slot_expert_S and weight_SR of it."""
  ids_K, weights_K = _top_k(parts_ref, 0, ids_ref.shape[1], **pick)
  weights_K = weights_K.astype(weights_ref.dtype)
  ids_ref[0, :] = ids_K
  weights_ref[0, :] = weights_K
  # A pick is an expert in [0, E), or E itself where the logits are not finite (no maximum
  # compares equal): E is plan_decode's slot expert for an invalid id already, with weight 0.
  slot_expert_ref[...] = ids_K
  # As plan_decode reads them: rounded to x's dtype (route_softmax's output), then float32.
  valid_K = ids_K < parts_ref.shape[2]
  weight_K = jnp.where(valid_K, weights_K.astype(jnp.float32), 0.0)
  column_KR = lax.broadcasted_iota(jnp.int32, weight_ref.shape, 1)
  weight_ref[...] = jnp.where(column_KR == 0, weight_K[:, None], 0.0)


def _router_partials(x_TD: jax.Array, router_DE: jax.Array, top_k: int, slices: int | None,
                     interpret: bool):
  """The shapes checked, then the partials kernel: float32 partial logits [T, S, E]."""
  num_tokens, hidden = x_TD.shape
  experts = router_DE.shape[1]
  if router_DE.shape[0] != hidden or not fits_kernel(num_tokens, hidden, experts, top_k):
    raise ValueError(f"route_softmax takes x [T <= {MAX_TOKENS}, D], a router [D, E] with E a "
                     f"power of two in [8, {MAX_EXPERTS}] and D a multiple of {ROW_CHUNK}, "
                     f"and 1 <= top_k <= E; got {x_TD.shape}, {router_DE.shape}, "
                     f"top_k={top_k}")
  slices = slices or num_slices(hidden)
  if hidden % (slices * ROW_CHUNK) or slices & (slices - 1):
    raise ValueError(f"slices must be a power of two that cuts the router's {hidden} rows "
                     f"into whole loop steps of {ROW_CHUNK}, got {slices}")
  params = pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2)
  return pl.pallas_call(
      functools.partial(_partials_kernel, rows=hidden // slices),
      out_shape=jax.ShapeDtypeStruct((num_tokens, slices, experts), jnp.float32),
      grid=(num_tokens, slices), compiler_params=params, interpret=interpret,
      name="router_partials",
  )(x_TD, router_DE)


def _select_call(kernel, parts_TSE, logits_dtype, out_shape, name: str, *, top_k: int,
                 norm: bool, interpret: bool):
  return pl.pallas_call(
      functools.partial(kernel, top_k=top_k, norm=norm, logits_dtype=logits_dtype),
      out_shape=out_shape, grid=(parts_TSE.shape[0],),
      compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret, name=name,
  )(parts_TSE)


def select(parts_TSE: jax.Array, x_dtype, router_dtype, *, top_k: int, norm: bool,
           plan: bool = False, interpret: bool):
  """The select kernel on the router product's float32 partials [T, S, E] of x (x_dtype) and
  the router (router_dtype): (ids [T, K] int32, weights [T, K] in x's dtype), and with `plan`
  (one token) its DecodePlan as route_softmax_plan's."""
  num_tokens, _, experts = parts_TSE.shape
  # The logits in the dtype XLA's einsum of x and the router would give them.
  logits_dtype = jnp.result_type(x_dtype, router_dtype)
  width = _pow2(top_k)
  pick = dict(top_k=top_k, norm=norm, interpret=interpret)
  if not plan:
    ids_TW, weights_TW = _select_call(
        _select_kernel, parts_TSE, logits_dtype,
        (jax.ShapeDtypeStruct((num_tokens, width), jnp.int32),
         jax.ShapeDtypeStruct((num_tokens, width), x_dtype)), "router_select", **pick)
    if width == top_k:
      return ids_TW, weights_TW
    return ids_TW[:, :top_k], weights_TW[:, :top_k]
  if num_tokens != 1:
    raise ValueError(f"a decode plan is written for one token, got {num_tokens}")
  columns = decode_routing.weight_columns(1)
  ids_1W, weights_1W, slot_expert_W, weight_WR = _select_call(
      _select_plan_kernel, parts_TSE, logits_dtype,
      (jax.ShapeDtypeStruct((1, width), jnp.int32), jax.ShapeDtypeStruct((1, width), x_dtype),
       jax.ShapeDtypeStruct((width,), jnp.int32),
       jax.ShapeDtypeStruct((width, columns), jnp.float32)), "router_select_plan", **pick)
  if width != top_k:  # the lanes past top_k
    ids_1W, weights_1W = ids_1W[:, :top_k], weights_1W[:, :top_k]
    slot_expert_W, weight_WR = slot_expert_W[:top_k], weight_WR[:top_k]
  # plan_decode's slot_TK is -1 for an invalid pick only: finite logits give none (a pick of
  # non-finite ones is expert E with weight 0 above, whose slot adds zeros).
  decode_plan = DecodePlan(
      slot_expert_S=slot_expert_W, num_slots_1=jnp.full((1,), top_k, jnp.int32),
      weight_SR=weight_WR, slot_TK=jnp.arange(top_k, dtype=jnp.int32)[None])
  return ids_1W, weights_1W, decode_plan


@functools.partial(jax.jit, static_argnames=("top_k", "norm", "slices", "interpret"))
def route_softmax(x_TD: jax.Array, router_DE: jax.Array, *, top_k: int, norm: bool,
                  slices: int | None = None, interpret: bool | None = None):
  """(expert ids [T, K] int32, weights [T, K] in x's dtype): jspec.models.moe.route of the
  logits x @ router, for a step's few tokens."""
  interpret = not platform.on_gpu() if interpret is None else interpret
  parts_TSE = _router_partials(x_TD, router_DE, top_k, slices, interpret)
  return select(parts_TSE, x_TD.dtype, router_DE.dtype, top_k=top_k, norm=norm,
                interpret=interpret)


@functools.partial(jax.jit, static_argnames=("top_k", "norm", "slices", "interpret"))
def route_softmax_plan(x_1D: jax.Array, router_DE: jax.Array, *, top_k: int, norm: bool,
                       slices: int | None = None, interpret: bool | None = None):
  """route_softmax of one token and its decode plan: (ids [1, K], weights [1, K], DecodePlan
  equal to decode_routing.plan_decode(ids, weights, E) bit for bit). The select kernel writes
  the plan's slot experts and weight columns; the slot count and each pick's slot are
  constants (each of the K picks its own slot), which no kernel computes."""
  if x_1D.shape[0] != 1:
    raise ValueError(f"route_softmax_plan routes one token, got x of shape {x_1D.shape}")
  interpret = not platform.on_gpu() if interpret is None else interpret
  parts_1SE = _router_partials(x_1D, router_DE, top_k, slices, interpret)
  return select(parts_1SE, x_1D.dtype, router_DE.dtype, top_k=top_k, norm=norm, plan=True,
                interpret=interpret)
