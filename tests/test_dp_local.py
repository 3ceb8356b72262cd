"""Data parallelism keeps each shard's sequences on its own device: a dp = 2 dispatch program
moves no activations, keys, values, routing weights or probabilities between shards, only the
scheduler's integer and boolean bookkeeping (loop conditions, slot admission, harvest), and
never reshards the slots (no all-to-all, no collective-permute).

XLA's partitioner all-gathered, in every layer of every step, the new keys and values (a cache
write indexed by an iota over the batch), the router's scores (`lax.top_k` is not split over
its batch axis) and the tokens of an expert kernel (a custom call it cannot split); a 30B-A3B
step on 2 GPUs at dp = 2 was 0.83x one GPU's at the same batch (BENCHMARKS.md)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import fixture_dir, greedy
from jspec.models.caches import write_slots
from jspec.shapes.rows import row_items, set_row_items

COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|all-to-all|collective-permute|"
                        r"reduce-scatter)(?:-start)?\(")
FLOAT_TYPES = re.compile(r"\b(f16|bf16|f32|f64)\[")


def float_collectives(text: str) -> list[str]:
  """(kind, shape) of every collective in an HLO text that moves floating-point values."""
  return [f"{m.group(2)} {m.group(1)[:60]}" for m in COLLECTIVE.finditer(text)
          if FLOAT_TYPES.search(m.group(1))]


@pytest.mark.parametrize("seed", range(6))
def test_the_batched_row_ops_equal_numpys_indexing(seed):
  """write_slots, row_items and set_row_items against NumPy loops over the rows, on random
  shapes: positions past the cache drop their rows, negative read indices count from the end,
  "drop" writes past the row vanish."""
  rng = np.random.default_rng(seed)
  b, k, s, h, t = rng.integers(1, 5), rng.integers(1, 4), rng.integers(4, 12), 3, 2
  cache = rng.normal(size=(b, k, s, h)).astype(np.float32)
  new = rng.normal(size=(b, t, k, h)).astype(np.float32)
  # Distinct positions per row (a scatter's order among equal indices is unspecified), some
  # past the cache.
  distinct = lambda top: np.stack([rng.permutation(top)[:t] for _ in range(b)]).astype(np.int32)
  positions = distinct(s + 2)
  want = cache.copy()
  for i in range(b):
    for j in range(t):
      if positions[i, j] < s:
        want[i, :, positions[i, j]] = new[i, j]
  got = write_slots(jnp.asarray(cache), jnp.asarray(new), jnp.asarray(positions), slot_axis=2)
  np.testing.assert_array_equal(np.asarray(got), want)
  latent = rng.normal(size=(b, s, h)).astype(np.float32)
  rows = rng.normal(size=(b, t, h)).astype(np.float32)
  want = latent.copy()
  for i in range(b):
    for j in range(t):
      if positions[i, j] < s:
        want[i, positions[i, j]] = rows[i, j]
  got = write_slots(jnp.asarray(latent), jnp.asarray(rows), jnp.asarray(positions), slot_axis=1)
  np.testing.assert_array_equal(np.asarray(got), want)

  tokens = rng.integers(0, 100, size=(b, s)).astype(np.int32)
  index = rng.integers(-s, s, size=(b,)).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(row_items(jnp.asarray(tokens), jnp.asarray(index))),
                                tokens[np.arange(b), index])
  write_at = distinct(s + 3)
  values = rng.integers(0, 100, size=(b, t)).astype(np.int32)
  want = tokens.copy()
  for i in range(b):
    for j in range(t):
      if write_at[i, j] < s:
        want[i, write_at[i, j]] = values[i, j]
  got = set_row_items(jnp.asarray(tokens), jnp.asarray(write_at), jnp.asarray(values), "drop")
  np.testing.assert_array_equal(np.asarray(got), want)


def test_float_collectives_are_found():
  """The detector itself: a dp-split top-k (what the router did) is found."""
  mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp", None))
  x = jax.device_put(jax.numpy.ones((8, 16)), split)
  text = jax.jit(lambda x: jax.lax.top_k(x, 2)[0]).lower(x).compile().as_text()
  assert float_collectives(text)


@pytest.mark.parametrize("name, method", [("qwen3_dense", None), ("qwen3_dense", "mtp"),
                                          ("qwen3_moe", None), ("deepseek_v3", "mtp")])
def test_a_dp_dispatch_program_moves_no_float_values_between_shards(name, method):
  spec = None if method is None else {"method": method, "num_speculative_tokens": 2}
  llm = jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=64, max_num_seqs=4,
                  mesh=jspec.MeshConfig(dp=2, num_devices=2), speculative_config=spec)
  # Two requests more than the slots: the dispatch program admits them (its walk over the
  # queue and its prefill chunk are checked too); with every request in the wave its own.
  prompts = [[5, 6, 7], [1, 2], [3, 4, 5, 6], [9], [8, 8], [2, 7, 1]]
  llm.generate(prompts, greedy(4, ignore_eos=True))
  llm.generate(prompts[:4], greedy(4, ignore_eos=True))
  assert sorted(admits for *_, admits in llm.scheduler.dispatch_programs) == [False, True]
  programs = list(llm.scheduler.dispatch_programs.values())
  for program in programs:
    text = program.as_text()
    assert COLLECTIVE.search(text)  # the loop conditions still agree across shards
    moved = float_collectives(text)
    assert moved == [], f"{len(moved)} float collectives between dp shards: {moved[:4]}"
    # Nor any resharding of the slots: the admission's walk over the queue runs on every shard
    # from replicated inputs (it exchanged all-to-alls and collective-permutes of its pieces).
    reshards = [m.group(2) for m in COLLECTIVE.finditer(text)
                if m.group(2) in ("all-to-all", "collective-permute")]
    assert reshards == [], f"{len(reshards)} resharding collectives: {reshards[:4]}"
