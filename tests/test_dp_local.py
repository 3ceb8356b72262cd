"""Data parallelism keeps each shard's sequences on its own device: a dp = 2 dispatch program
moves no activations, keys, values, routing weights or probabilities between shards, only the
scheduler's integer and boolean bookkeeping (loop conditions, slot admission, harvest).

XLA's partitioner all-gathered, in every layer of every step, the new keys and values (a cache
write indexed by an iota over the batch), the router's scores (`lax.top_k` is not split over
its batch axis) and the tokens of an expert kernel (a custom call it cannot split); a 30B-A3B
step on 2 GPUs at dp = 2 was 0.83x one GPU's at the same batch (BENCHMARKS.md)."""

import re

import jax
import pytest

import jspec
from helpers import fixture_dir, greedy

COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|all-to-all|collective-permute|"
                        r"reduce-scatter)(?:-start)?\(")
FLOAT_TYPES = re.compile(r"\b(f16|bf16|f32|f64)\[")


def float_collectives(text: str) -> list[str]:
  """(kind, shape) of every collective in an HLO text that moves floating-point values."""
  return [f"{m.group(2)} {m.group(1)[:60]}" for m in COLLECTIVE.finditer(text)
          if FLOAT_TYPES.search(m.group(1))]


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
  prompts = [[5, 6, 7], [1, 2], [3, 4, 5, 6], [9]]
  llm.generate(prompts, greedy(4, ignore_eos=True))
  programs = list(llm.scheduler.dispatch_programs.values())
  assert programs
  for program in programs:
    text = program.as_text()
    assert COLLECTIVE.search(text)  # the loop conditions still agree across shards
    moved = float_collectives(text)
    assert moved == [], f"{len(moved)} float collectives between dp shards: {moved[:4]}"
