"""Routing metadata for the grouped GEMMs, computed in XLA.

The T*K token copies are sorted by expert (stable, so ties keep token order) and each
expert's group is padded up to a whole number of row tiles. In that padded layout tile i
starts at row i * block_rows and belongs to exactly one expert, so a kernel never masks
rows inside a tile and never stores a partial tile. Pad rows point at token 0 with routing
weight 0: they are computed (cheaply, on data already on chip) and never read back.

Shape letters: T tokens, K experts per token, E experts, P padded rows, N tiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoutingPlan:
  """Where every token copy lives in the padded expert-sorted layout.

  Attributes:
    row_token_P: token whose activations fill each padded row (0 on pad rows).
    row_weight_P: routing weight of each padded row, float32 (0 on pad rows).
    pos_TK: padded row of each (token, k) pair; -1 where the expert id is out of range.
    tile_expert_N: expert of each tile; -1 for tiles past the last used one.
    tile_rows_N: rows of each tile that hold real token copies (0 past the last tile).
    num_tiles: number of tiles in use (the rest of the static table is padding).
  """

  row_token_P: jax.Array
  row_weight_P: jax.Array
  pos_TK: jax.Array
  tile_expert_N: jax.Array
  tile_rows_N: jax.Array
  num_tiles: jax.Array

  @property
  def num_rows(self) -> int:
    return self.row_token_P.shape[0]

  @property
  def block_rows(self) -> int:
    return self.num_rows // self.tile_expert_N.shape[0]


def max_tiles(num_copies: int, num_experts: int, block_rows: int) -> int:
  """Worst case of sum_e ceil(g_e / block_rows) over groups g_e summing to num_copies.

  Every nonempty group wastes less than one tile, and at most min(E, copies) are nonempty.
  """
  return max(1, num_copies // block_rows + min(num_experts, num_copies))


def plan_routing(topk_ids_TK: jax.Array, topk_weights_TK: jax.Array, num_experts: int,
                 block_rows: int) -> RoutingPlan:
  """Top-k ids -> stable sort by expert -> group sizes -> padded layout and tile table."""
  num_tokens, top_k = topk_ids_TK.shape
  num_copies = num_tokens * top_k
  num_tiles_max = max_tiles(num_copies, num_experts, block_rows)
  num_rows = num_tiles_max * block_rows

  ids_M = topk_ids_TK.reshape(-1).astype(jnp.int32)
  valid_M = (ids_M >= 0) & (ids_M < num_experts)
  # Out-of-range ids (other shards' experts) sort last into a group no expert owns.
  key_M = jnp.where(valid_M, ids_M, num_experts)
  order_M = jnp.argsort(key_M, stable=True)
  sizes_E = jnp.bincount(key_M, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  tiles_E = (sizes_E + block_rows - 1) // block_rows
  tile_ends_E = jnp.cumsum(tiles_E)
  tile_starts_E = tile_ends_E - tiles_E
  num_tiles = tile_ends_E[-1]

  sorted_key_M = key_M[order_M]
  sorted_valid_M = sorted_key_M < num_experts
  safe_e_M = jnp.minimum(sorted_key_M, num_experts - 1)
  rank_M = jnp.arange(num_copies, dtype=jnp.int32) - starts_E[safe_e_M]
  padded_row_M = tile_starts_E[safe_e_M] * block_rows + rank_M
  # Invalid copies scatter to row num_rows, which mode="drop" discards.
  dest_M = jnp.where(sorted_valid_M, padded_row_M, num_rows)
  token_M = (order_M // top_k).astype(jnp.int32)
  weight_M = topk_weights_TK.reshape(-1).astype(jnp.float32)[order_M]
  row_token_P = jnp.zeros((num_rows,), jnp.int32).at[dest_M].set(token_M, mode="drop")
  row_weight_P = jnp.zeros((num_rows,), jnp.float32).at[dest_M].set(weight_M, mode="drop")
  pos_M = jnp.zeros((num_copies,), jnp.int32).at[order_M].set(
      jnp.where(sorted_valid_M, padded_row_M, -1))

  tile_N = jnp.arange(num_tiles_max, dtype=jnp.int32)
  # A compare-and-count is one fused kernel; searchsorted lowers to a loop of launches.
  tile_expert_N = jnp.sum(tile_ends_E[None, :] <= tile_N[:, None], axis=1, dtype=jnp.int32)
  in_use_N = tile_N < num_tiles
  safe_tile_e_N = jnp.minimum(tile_expert_N, num_experts - 1)
  rows_N = jnp.clip(sizes_E[safe_tile_e_N] - (tile_N - tile_starts_E[safe_tile_e_N]) * block_rows,
                    0, block_rows)
  return RoutingPlan(
      row_token_P=row_token_P,
      row_weight_P=row_weight_P,
      pos_TK=pos_M.reshape(num_tokens, top_k),
      tile_expert_N=jnp.where(in_use_N, tile_expert_N, -1),
      tile_rows_N=jnp.where(in_use_N, rows_N, 0).astype(jnp.int32),
      num_tiles=num_tiles.astype(jnp.int32),
  )
