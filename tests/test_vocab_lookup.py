"""Specification of the embedding lookup of a vocabulary split over the mesh
(jspec.sharding.vocab): the rows `jnp.take(embed, tokens, axis=0, mode="clip")` gives, on every
mesh layout, out-of-range ids included, reduced by one all-reduce and no all-gather; and the
LLM puts it in exactly where its mesh splits the vocabulary."""

import jax
import numpy as np
import pytest

import jspec
from jspec.sharding.rules import MeshConfig, ShardingRules
from jspec.sharding.vocab import sharded_embedding_lookup

from helpers import fixture_dir

MESHES = [  # (dp, tp, ep), the vocabulary's mesh axes
    ((1, 2, 1), "tp"), ((1, 4, 1), "tp"), ((2, 2, 1), "tp"), ((1, 2, 2), "tp"),
    ((2, 2, 2), "tp"),
]


@pytest.mark.parametrize("mesh_axes,vocab", MESHES)
def test_lookup_equals_take_with_clipping_on_every_layout(mesh_axes, vocab):
  dp, tp, ep = mesh_axes
  mesh = MeshConfig(dp=dp, tp=tp, ep=ep).make_mesh()
  rules = ShardingRules(vocab=vocab)
  lookup = jax.jit(sharded_embedding_lookup(mesh, rules))
  rng = np.random.default_rng(dp * 100 + tp * 10 + ep)
  for vocab_size in (8 * 4, 8 * 13):
    embed = rng.normal(size=(vocab_size, 16)).astype(np.float32)
    # Batch a multiple of dp x ep; ids below 0 and past the table (placeholders, padding).
    tokens = rng.integers(-3, vocab_size + 3, (dp * ep * 2, 5)).astype(np.int32)
    embed_d = jax.device_put(embed, rules.sharding(mesh, ("vocab", "embed")))
    tokens_d = jax.device_put(tokens, rules.sharding(mesh, ("batch", "seq")))
    got = np.asarray(lookup(embed_d, tokens_d))
    np.testing.assert_array_equal(got, np.take(embed, np.clip(tokens, 0, vocab_size - 1), 0))
    hlo = lookup.lower(embed_d, tokens_d).compile().as_text()
    assert "all-reduce" in hlo and "all-gather" not in hlo


def test_no_lookup_where_the_mesh_keeps_the_vocabulary_whole_or_splits_it_with_the_batch():
  assert sharded_embedding_lookup(MeshConfig(dp=2).make_mesh(), ShardingRules()) is None
  assert sharded_embedding_lookup(MeshConfig(tp=2).make_mesh(), ShardingRules(vocab=None)) \
      is None
  # Split over an axis that also splits the batch: XLA's take (a shard's rows cannot serve
  # another shard's sequences).
  for vocab in ("ep", ("ep", "tp")):
    mesh = MeshConfig(tp=2, ep=2).make_mesh()
    assert sharded_embedding_lookup(mesh, ShardingRules(vocab=vocab)) is None


@pytest.mark.parametrize("tp,embed_vocab,expected", [(2, "tp", True), (2, None, False),
                                                     (1, "tp", False)])
def test_the_llm_looks_up_shard_by_shard_only_where_its_mesh_splits_the_tables_rows(
    tp, embed_vocab, expected):
  """The fixture's table is untied: its rows follow ShardingRules.embed_vocab (whole by
  default), and only split rows are looked up shard by shard."""
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                  mesh=jspec.MeshConfig(tp=tp),
                  sharding_rules=ShardingRules(embed_vocab=embed_vocab))
  assert not llm.config.tie_word_embeddings
  assert (llm.target.embedding_lookup is not None) == expected
  assert llm.target.embed.get_metadata()["logical_axes"] == ("embed_vocab", "embed")


def test_by_default_an_untied_table_is_whole_and_its_tokens_are_one_devices():
  one = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64)
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                  mesh=jspec.MeshConfig(tp=2))
  assert llm.target.embedding_lookup is None
  assert llm.target.embed.get_value().sharding.is_fully_replicated
  prompts, params = [[5, 6, 7], [1, 2, 3, 4]], jspec.SamplingParams(temperature=0.0,
                                                                     max_tokens=6)
  assert ([o.token_ids for o in llm.generate(prompts, params)]
          == [o.token_ids for o in one.generate(prompts, params)])


def test_a_tp_decode_program_of_a_dense_model_holds_all_reduces_only():
  """With the default rules the vocabulary is split over tp: the compiled dispatch program
  (prefill, decode loop, sampler) reduces it by all-reduces, never by an all-gather (the
  argmax's (value, index) pairs were all-gathered before `vocab_argmax`)."""
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                  mesh=jspec.MeshConfig(tp=2))
  llm.generate([[5, 6, 7], [1, 2]], jspec.SamplingParams(temperature=0.0, max_tokens=4))
  # The start program prefills the first wave; dispatch decodes (and admits, if needed).
  programs = [*llm.scheduler.start_programs.values(), *llm.scheduler.dispatch_programs.values()]
  assert len(programs) == 2
  for program in programs:
    text = program.as_text()
    assert "all-reduce" in text and "all-gather" not in text


def test_with_the_workspace_kernel_on_hopper_the_sum_is_the_kernel_not_an_all_reduce(
    monkeypatch):
  """Where the tp layers reduce through the workspace kernel ("auto" on Hopper GPUs of one
  process), the lookup's sum goes through it too: lowered for CUDA (no GPU needed), the
  program holds the kernel's custom call and no all-reduce."""
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import utils as mosaic_utils
  from jspec.pallas_kernels import platform
  monkeypatch.setattr(platform, "on_hopper", lambda: True)
  monkeypatch.setattr(mosaic_utils, "_infer_arch", lambda: (9, 0))
  mesh = MeshConfig(tp=2).make_mesh()
  rules = ShardingRules(vocab="tp")
  lookup = sharded_embedding_lookup(mesh, rules, custom_all_reduce=True)
  embed = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16,
                               sharding=rules.sharding(mesh, ("vocab", "embed")))
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32, sharding=rules.sharding(mesh, ("batch", "seq")))
  text = jax.jit(lookup).trace(embed, tokens).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "stablehlo.all_reduce" not in text
  # a prefill chunk's rows (past the kernel's 256 KB) keep psum
  chunk = jax.ShapeDtypeStruct((1, 256), jnp.int32, sharding=rules.sharding(mesh, ("batch", "seq")))
  text = jax.jit(lookup).trace(embed, chunk).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.all_reduce" in text
