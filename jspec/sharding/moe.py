"""Expert parallelism: the expert backend under `shard_map` over the ("dp", "ep", "tp") mesh.

Tokens are split over dp x ep, experts over ep, each expert's intermediate over tp. Two ways
bring tokens to the shard holding their experts and the results back:

  all_gather  every ep shard gathers the ep group's tokens, computes its own experts' share
              for all of them, and a reduce-scatter returns each token's sum to its owner.
              Traffic ~ 2 x T x D per shard whatever the routing; no capacity, no padding.
  all_to_all  each shard sends every (token, expert) copy to the shard owning that expert in a
              fixed worst-case buffer (T_local x K rows per destination), the owner computes,
              and a second all_to_all sends results back to be combined. Traffic scales with
              T x K but the buffers are ep times larger than the tokens actually routed.

Both produce the same sums; which is faster depends on T (BENCHMARKS.md). Partial sums over tp
(the down projection contracts the tp-sharded intermediate) are reduced with psum.

With `custom_all_reduce` (LLM(all_reduce_backend="auto" or "kernel") on Hopper GPUs of one
process: at ep = 2 on 2 H200s, Qwen3-30B-A3B took 5.84 ms a step at batch 1 against 6.41 with
XLA's collectives, 11.31 against 11.41 at batch 32; BENCHMARKS.md), the small collectives go
through jspec's workspace kernel
(jspec.pallas_kernels.workspace_all_reduce) where it takes them: the tp sum; the all-gather as
a sum of int32 words each shard writes into a slot of its own (exact: the other slots are
zeros); the reduce-scatter as an all-reduce of which each shard keeps its own rows.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec.pallas_kernels import workspace_all_reduce as wsar
from jspec.pallas_kernels.fp8_expert_products import Fp8Experts
from jspec.sharding.rules import ShardingRules, axis_size

EP_STRATEGIES = ("auto", "all_gather", "all_to_all")
# "auto" = all-gather + reduce-scatter: on 2 NVLink-connected H200s (ep = 2, Qwen3-30B-A3B
# shapes, Pallas experts) it tied all-to-all at 8 tokens per call and beat it at every size from
# 32 to 8192 tokens, by 1.2x to 2x (BENCHMARKS.md, "Expert parallelism"). Meshes with ep > 2,
# where all-to-all moves relatively less data, were not measured; pick `ep_strategy` explicitly
# there to compare.
AUTO_STRATEGY = "all_gather"


def _local_ids(ids_TK, experts_per_shard: int):
  """Global expert ids -> this ep shard's local ids; other shards' experts become -1."""
  first = jax.lax.axis_index("ep") * experts_per_shard
  local = ids_TK - first
  return jnp.where((local >= 0) & (local < experts_per_shard), local, -1)


class Collectives:
  """The expert shard_map's collectives: XLA's, or the workspace kernel's where `rows` holds
  the kernel's address rows ({axis: row}) and it takes the message."""

  def __init__(self, rows: dict):
    self.rows = rows

  def _sum(self, axis: str, x):
    """The sum of x over `axis` through the kernel (wsar.protocol_for its dtype), or None
    where it does not take x: its elements flattened and padded with zeros to the kernel's
    whole 2 KB tiles."""
    if axis not in self.rows:
      return None
    tile = wsar.TILE_BYTES // jnp.dtype(x.dtype).itemsize
    flat = x.reshape(-1)
    padded = jnp.pad(flat, (0, -flat.size % tile))
    if not wsar.fits(padded.shape, padded.dtype):
      return None
    return self._kernel_sum(axis, padded)[:flat.size].reshape(x.shape)

  def _kernel_sum(self, axis: str, flat):
    return wsar.workspace_all_reduce(flat, self.rows[axis], jax.lax.axis_size(axis))

  def reduce_tp(self, y, tp_sharded: bool):
    """Sum the partial products of a tp-sharded intermediate; a tp-replicated head has none."""
    if not tp_sharded or jax.lax.axis_size("tp") == 1:
      return y
    summed = self._sum("tp", y)
    return jax.lax.psum(y, "tp") if summed is None else summed

  def gather_words(self, words_TW):
    """uint32 words [T, W] of every ep shard, in shard order: [ep * T, W]. Through the kernel
    they take the flag protocol: the Lamport form would need a stand-in for all-ones words, and
    it measured no faster on Qwen3-30B-A3B at ep = 2 (10.946 against 10.921 ms a step at batch
    32, 5.210 against 5.205 at batch 1; BENCHMARKS.md, 2026-11-29)."""
    ep = jax.lax.axis_size("ep")
    total = None
    if "ep" in self.rows:
      mine = jax.lax.bitcast_convert_type(words_TW, jnp.int32)
      slots = jax.lax.dynamic_update_slice(jnp.zeros((ep, *mine.shape), jnp.int32), mine[None],
                                           (jax.lax.axis_index("ep"), 0, 0))
      total = self._sum("ep", slots)
    if total is None:
      return jax.lax.all_gather(words_TW, "ep", axis=0, tiled=True)
    return jax.lax.bitcast_convert_type(total.reshape(-1, words_TW.shape[1]), jnp.uint32)

  def scatter_sum(self, y_all):
    """The sum over ep of [ep * T, D], each shard keeping its own T rows."""
    total = self._sum("ep", y_all)
    if total is None:
      return jax.lax.psum_scatter(y_all, "ep", scatter_dimension=0, tiled=True)
    rows = y_all.shape[0] // jax.lax.axis_size("ep")
    return jax.lax.dynamic_slice_in_dim(total, jax.lax.axis_index("ep") * rows, rows)


def _as_words(a):
  """`a` [T, ...] as uint32 words [T, W], its bits unchanged (16-bit elements two to a word);
  None where its width cannot be so packed."""
  a = a.reshape(a.shape[0], -1)
  size = jnp.dtype(a.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(a, jnp.uint32)
  if size == 2 and a.shape[1] % 2 == 0:
    return jax.lax.bitcast_convert_type(a.reshape(a.shape[0], -1, 2), jnp.uint32)
  return None


def _from_words(words_TW, like):
  """`_as_words` undone: [T', W] uint32 words as `like`'s dtype and trailing shape."""
  if jnp.dtype(like.dtype).itemsize == 2:
    words_TW = words_TW[..., None]
  values = jax.lax.bitcast_convert_type(words_TW, like.dtype)
  return values.reshape(words_TW.shape[0], *like.shape[1:])


def _gather_tokens(x_TD, ids_TK, weights_TK, collectives: Collectives | None = None):
  """The ep group's tokens, routed ids and routing weights, gathered by one all-gather of
  their bits packed side by side (three were three collectives of a few KB each in every MoE
  layer of a decode step, each paying a collective's fixed cost); three all-gathers where an
  array's width cannot be packed into 32-bit words."""
  parts = (x_TD, ids_TK, weights_TK)
  words = [_as_words(a) for a in parts]
  if any(w is None for w in words):
    return tuple(jax.lax.all_gather(a, "ep", axis=0, tiled=True) for a in parts)
  widths = [w.shape[1] for w in words]
  gathered = (collectives or Collectives({})).gather_words(jnp.concatenate(words, axis=1))
  bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
  return tuple(_from_words(gathered[:, lo:hi], a)
               for a, lo, hi in zip(parts, bounds[:-1], bounds[1:]))


def _all_gather_body(experts_fn, tp_sharded, rows, x_TD, ids_TK, weights_TK, w_gate, w_up,
                     w_down):
  c = Collectives(rows)
  experts_per_shard = w_gate.shape[0]
  if jax.lax.axis_size("ep") == 1:  # a dp-only mesh: no collective of one shard
    y = experts_fn(x_TD, _local_ids(ids_TK, experts_per_shard), weights_TK, w_gate, w_up,
                   w_down).astype(jnp.float32)
    return c.reduce_tp(y, tp_sharded).astype(x_TD.dtype)
  x_all, ids_all, weights_all = _gather_tokens(x_TD, ids_TK, weights_TK, c)
  y_all = experts_fn(x_all, _local_ids(ids_all, experts_per_shard), weights_all,
                     w_gate, w_up, w_down).astype(jnp.float32)
  y_all = c.reduce_tp(y_all, tp_sharded)
  return c.scatter_sum(y_all).astype(x_TD.dtype)


def _all_to_all_body(experts_fn, tp_sharded, rows, x_TD, ids_TK, weights_TK, w_gate, w_up,
                     w_down):
  num_tokens, top_k = ids_TK.shape
  experts_per_shard = w_gate.shape[0]
  ep = jax.lax.axis_size("ep")
  copies = num_tokens * top_k
  # Dispatch: copy m = (token t, slot k) goes to shard ids // experts_per_shard, at row m of that
  # shard's block. Unused rows carry expert -1 and compute nothing.
  dest_M = (ids_TK // experts_per_shard).reshape(copies)
  rows_M = jnp.arange(copies)
  send_x_PMD = jnp.zeros((ep, copies, x_TD.shape[1]), x_TD.dtype)
  send_x_PMD = send_x_PMD.at[dest_M, rows_M].set(jnp.repeat(x_TD, top_k, axis=0))
  send_id_PM = jnp.full((ep, copies), -1, jnp.int32)
  send_id_PM = send_id_PM.at[dest_M, rows_M].set((ids_TK % experts_per_shard).reshape(copies))
  recv_x = jax.lax.all_to_all(send_x_PMD, "ep", split_axis=0, concat_axis=0, tiled=True)
  recv_id = jax.lax.all_to_all(send_id_PM, "ep", split_axis=0, concat_axis=0, tiled=True)
  # Each received row is one (token, expert) copy: top-1 with weight 1; weights apply on return.
  ones = jnp.ones((ep * copies, 1), x_TD.dtype)
  y_rows = experts_fn(recv_x.reshape(ep * copies, -1), recv_id.reshape(ep * copies, 1), ones,
                      w_gate, w_up, w_down).astype(jnp.float32)
  y_rows = Collectives(rows).reduce_tp(y_rows, tp_sharded).reshape(ep, copies, -1)
  back_PMD = jax.lax.all_to_all(y_rows, "ep", split_axis=0, concat_axis=0, tiled=True)
  y_MD = back_PMD[dest_M, rows_M]
  y_TD = jnp.einsum("tkd,tk->td", y_MD.reshape(num_tokens, top_k, -1),
                    weights_TK.astype(jnp.float32))
  return y_TD.astype(x_TD.dtype)


def sharded_experts(experts_fn: Callable, mesh: Mesh, rules: ShardingRules,
                    strategy: str = "all_gather", custom_all_reduce: bool = False) -> Callable:
  """Wraps an expert backend so it runs per shard; same signature, global arrays in and out.
  `custom_all_reduce`: the collectives through the workspace kernel where it takes them (the
  module docstring)."""
  if strategy not in EP_STRATEGIES:
    raise ValueError(f"ep strategy {strategy!r} is not supported; choose one of {EP_STRATEGIES}")
  tp_sharded = rules.spec(("moe_mlp",)) != rules.spec((None,))
  tokens = rules.spec(("batch", None))
  w_in = rules.spec(("experts", "embed", "moe_mlp"))
  w_out = rules.spec(("experts", "moe_mlp", "embed"))
  # FP8 experts as stored, [E, out, in] and their block scales (and the scales' kernel lanes,
  # where made) on the same axes.
  fp8_specs = {lanes: tuple(Fp8Experts(spec, spec, spec if lanes else None) for spec in (
      rules.spec(("experts", "moe_mlp", "embed")), w_in)) for lanes in (False, True)}

  tables = _workspace_rows(mesh, tp_sharded) if custom_all_reduce else {}

  def mapped(body, weight_specs):
    def per_shard(rows, *args):
      return body(experts_fn, tp_sharded, {a: r.reshape(-1) for a, r in rows.items()}, *args)
    fn = jax.shard_map(per_shard, mesh=mesh,
                       in_specs=({a: spec for a, (_, spec) in tables.items()}, tokens, tokens,
                                 tokens, *weight_specs),
                       out_specs=tokens, check_vma=False)
    return lambda *args: fn({a: table for a, (table, _) in tables.items()}, *args)

  def weight_specs(fp8):  # fp8: None (bf16 experts), or whether the scales' lanes come along
    if fp8 is None:
      return w_in, w_in, w_out
    fp8_in, fp8_out = fp8_specs[fp8]
    return fp8_in, fp8_in, fp8_out

  bodies = {(name, fp8): mapped(body, weight_specs(fp8))
            for name, body in (("all_gather", _all_gather_body), ("all_to_all", _all_to_all_body))
            for fp8 in (None, False, True)}

  def experts(x_TD, ids_TK, weights_TK, w_gate, w_up, w_down):
    chosen = AUTO_STRATEGY if strategy == "auto" else strategy
    fp8 = w_gate.lanes is not None if isinstance(w_gate, Fp8Experts) else None
    return bodies[chosen, fp8](x_TD, ids_TK, weights_TK, w_gate, w_up, w_down)

  return experts


def _workspace_rows(mesh: Mesh, tp_sharded: bool) -> dict:
  """{axis: (address table, its spec)} of the workspace kernel for the expert collectives, on
  Hopper GPUs (none elsewhere: XLA's collectives)."""
  from jspec.pallas_kernels import platform
  axes = ["ep"] + (["tp"] if tp_sharded else [])
  if not platform.on_hopper():
    return {}
  return {a: (ws.rows, ws.row_spec) for a in axes if mesh.shape[a] > 1
          for ws in [wsar.workspace_for(mesh, a)]}


def per_token_shard(mesh: Mesh, rules: ShardingRules) -> Callable | None:
  """A wrapper that runs fn(x_T..., replicated) on each shard's own tokens (tokens split as
  the expert shard_map splits them), or None where the rules keep the tokens whole.

  Why: XLA's partitioner does not split `lax.top_k` over its batch axis; the router's top-k
  all-gathered every MoE layer's scores over dp (and ep) in every step."""
  if axis_size(mesh, rules.batch) == 1:
    return None
  tokens = rules.spec(("batch", None))
  return lambda fn: jax.shard_map(fn, mesh=mesh, in_specs=(tokens, rules.spec(())),
                                  out_specs=(tokens, tokens), check_vma=False)


def needs_shard_map(mesh: Mesh) -> bool:
  """Any split mesh: XLA cannot partition an expert kernel's custom call, so without the
  shard_map a dp mesh gathered every MoE layer's tokens and routing over dp and ran all of
  them on every shard."""
  return mesh.shape["ep"] > 1 or mesh.shape["tp"] > 1 or mesh.shape["dp"] > 1

