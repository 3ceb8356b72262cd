"""How attention layers multiply a few rows by their projection weights (LLM(projection_backend)).

  "xla"     XLA's dot everywhere.
  "pallas"  jspec.pallas_kernels.skinny_gemm wherever it takes the shapes (<= 64 rows: decode,
            verify and draft steps; interpreted off GPU), XLA's dot for prefill.
  "auto"    on Hopper, the kernel for the products XLA's GPU compiler would rewrite into a
            multiply and a reduction (one row, operands under 10 M elements: e.g. a 2048 x 4096
            projection in a batch-1 decode step); XLA's dot elsewhere and on other devices.

The kernel needs the weights whole on every shard: with tensor parallelism over heads or the
hidden size, "auto" keeps XLA's dot and "pallas" is refused.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, PartitionSpec

from jspec.sharding.rules import ShardingRules, axis_size

PROJECTION_BACKENDS = ("auto", "xla", "pallas")


def weights_replicated(mesh: Mesh, rules: ShardingRules) -> bool:
  return all(axis_size(mesh, getattr(rules, name)) == 1
             for name in ("embed", "q_heads", "kv_heads", "head_dim", "mtp_concat"))


def sharded_projection(mesh: Mesh, rules: ShardingRules, always: bool):
  """(x [B, T, K], w [K, N]) -> [B, T, N] per batch shard, w replicated: no collective."""
  from jspec.pallas_kernels.skinny_gemm import project
  x = rules.spec(("batch", "seq", None))
  return jax.shard_map(functools.partial(project, always=always), mesh=mesh,
                       in_specs=(x, PartitionSpec()), out_specs=x, check_vma=False)
