"""What each step exchanges between devices, counted in its compiled program
(jspec.bench.collectives), held to a budget per mesh: a step that gains a collective fails here.

  tp = 2, dense or MoE layers split over tp: two all-reduces a layer (after the attention's
           o_proj and after the MLP), plus one a step: the greedy argmax over the split
           vocabulary, each shard's best in a slot of its own (jspec.sharding.vocab). An
           untied embedding table is whole on every device (ShardingRules.embed_vocab); a
           tied one is the lm_head too, split, and its lookup adds one all-reduce.
  ep = 2:  one all-gather (tokens, ids and routing weights packed together) and one
           reduce-scatter per MoE layer; nothing else.
  dp = 2:  nothing.

The counts are the same in every step kind: decode, verify, MTP draft, prefill chunk.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jspec
from helpers import fixture_dir
from jspec.bench.collectives import collectives, counts, step_programs
from jspec.models.moe import MoE
from jspec.sharding import moe as ep_lib

MTP3 = {"method": "mtp", "num_speculative_tokens": 3}


def _programs(name, mesh, **kwargs):
  batch = max(4, mesh.batch_width)
  llm = jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=128,
                  max_num_seqs=batch, mesh=mesh, speculative_config=MTP3, **kwargs)
  programs = {kind: counts(collectives(text)) for kind, text in step_programs(llm, batch).items()}
  assert set(programs) == {"decode", "verify", "draft", "prefill"}
  return llm, programs


def _moe_layers(module) -> int:
  return sum(isinstance(node, MoE) for _, node in nnx.iter_graph(module))


def test_the_detector_finds_each_collective_with_its_bytes():
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("x",))

  def body(a, b):
    s = jax.lax.psum(a, "x")                                 # f32[8, 16]: 512 bytes
    g = jax.lax.all_gather(b, "x", axis=0, tiled=True)       # f32[4, 16]: 256 bytes
    return s, jax.lax.ppermute(g, "x", [(0, 1), (1, 0)])     # f32[4, 16]
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()),
                             check_vma=False))
  # (float32: the CPU backend widens 16-bit collectives to float32.)
  text = fn.lower(jnp.zeros((8, 16), jnp.float32), jnp.zeros((4, 16), jnp.float32)).compile()
  found = collectives(text.as_text())
  assert sorted((c.kind, c.bytes) for c in found) == [
      ("all-gather", 256), ("all-reduce", 512), ("collective-permute", 256)]
  assert counts(found) == {"all-reduce": 1, "all-gather": 1, "collective-permute": 1}


@pytest.mark.parametrize("name, extra", [("qwen3_dense", {}), ("qwen3_moe", {}),
                                         ("qwen3_dense", {"all_reduce_backend": "xla"})])
def test_a_tp2_step_makes_two_all_reduces_a_layer_and_one_more(name, extra):
  """XLA's partitioner (the default) and jspec's written-out products alike."""
  llm, programs = _programs(name, jspec.MeshConfig(tp=2), **extra)
  assert not llm.config.tie_word_embeddings
  layers = len(llm.target.layers)
  mtp_layers = len(llm.mtp.layers)
  for kind, found in programs.items():
    runs = mtp_layers if kind == "draft" else layers
    assert found == {"all-reduce": 2 * runs + 1}, (kind, found)


def test_a_tied_embedding_table_adds_its_lookups_all_reduce():
  """A tied table stays split with the lm_head: its lookup sums over tp, one all-reduce more."""
  import dataclasses
  config = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=128,
                     max_num_seqs=4).config
  llm = jspec.LLM.from_random(dataclasses.replace(config, tie_word_embeddings=True),
                              mesh=jspec.MeshConfig(tp=2), dtype="float32", max_model_len=128,
                              max_num_seqs=4)
  assert llm.target.embed.get_metadata()["logical_axes"][0] == "vocab"
  found = counts(collectives(step_programs(llm, 4, kinds=("decode",))["decode"]))
  assert found == {"all-reduce": 2 * len(llm.target.layers) + 2}, found


@pytest.mark.parametrize("mesh", [jspec.MeshConfig(ep=2), jspec.MeshConfig(dp=2, ep=4)])
def test_an_ep_step_makes_one_all_gather_and_one_reduce_scatter_per_moe_layer(mesh):
  llm, programs = _programs("qwen3_moe", mesh)
  for kind, found in programs.items():
    moe = _moe_layers(llm.mtp if kind == "draft" else llm.target)
    want = {"all-gather": moe, "reduce-scatter": moe} if moe else {}
    assert found == want, (kind, found)


def test_a_dp_step_makes_no_collective():
  _, programs = _programs("qwen3_moe", jspec.MeshConfig(dp=2))
  assert all(found == {} for found in programs.values()), programs


@pytest.mark.parametrize("dtype, width", [(jnp.bfloat16, 64), (jnp.float32, 48),
                                         (jnp.bfloat16, 7)])
def test_packed_token_gather_returns_each_array_bit_for_bit(dtype, width):
  """Tokens, ids and weights gathered as one array of words come back exactly, NaN payloads
  and -0.0 included; a width that does not pack (odd bf16) takes three all-gathers."""
  mesh = Mesh(np.asarray(jax.devices()[:4]), ("ep",))
  rng = np.random.default_rng(width)
  x = rng.standard_normal((8, width)).astype(np.float32)
  x[0, 0], x[1, 1] = -0.0, np.nan
  x = jnp.asarray(x, dtype)
  ids = jnp.asarray(rng.integers(-1, 128, (8, 3)), jnp.int32)
  weights = jnp.asarray(rng.random((8, 3)), jnp.float32)
  fn = jax.jit(jax.shard_map(ep_lib._gather_tokens, mesh=mesh, in_specs=(P("ep"),) * 3,
                             out_specs=(P(),) * 3, check_vma=False))
  got = fn(*(jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids, weights)))
  for g, want in zip(got, (x, ids, weights)):
    assert g.dtype == want.dtype and g.shape == want.shape
    np.testing.assert_array_equal(jax.lax.bitcast_convert_type(g, jnp.uint16 if g.dtype ==
                                                               jnp.bfloat16 else jnp.uint32),
                                  jax.lax.bitcast_convert_type(want, jnp.uint16 if want.dtype ==
                                                               jnp.bfloat16 else jnp.uint32))
  gathers = counts(collectives(fn.lower(x, ids, weights).compile().as_text()))["all-gather"]
  assert gathers == (3 if width % 2 and dtype == jnp.bfloat16 else 1)
