"""On 2 GPUs: a tp = 2 dispatch program never gathers the vocabulary. With the default rules
the embedding and lm_head are split over tp; XLA's GPU partitioner all-gathered the whole
embedding table for `jnp.take` in every decode step (2.26 ms of a 7.7 ms Qwen3-8B step,
BENCHMARKS.md, "Tensor parallelism at batch 1"), where the CPU compile had a masked lookup.
So only a GPU compile can guard `sharding.vocab.sharded_embedding_lookup` and
`sampling.vocab_argmax`."""

import re

import jax
import pytest

import jspec
from jspec.sharding.rules import ShardingRules
from helpers import fixture_dir, greedy

pytestmark = pytest.mark.gpu

GPUS = sum(d.platform == "gpu" for d in jax.devices())
ALL_GATHER = re.compile(r"=\s*(\S+)\s+all-gather(?:-start)?\(")


@pytest.mark.parametrize("method", [None, "mtp"])
def test_tp2_dispatch_program_gathers_nothing(method):
  if GPUS < 2:
    pytest.skip(f"tp = 2 needs 2 GPUs, this machine has {GPUS}")
  spec = None if method is None else {"method": method, "num_speculative_tokens": 2}
  # The table's rows split over tp too (whole by default: ShardingRules.embed_vocab).
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="bfloat16", max_model_len=128,
                  max_num_seqs=4, mesh=jspec.MeshConfig(tp=2, num_devices=2),
                  speculative_config=spec, sharding_rules=ShardingRules(embed_vocab="tp"))
  assert llm.target.embedding_lookup is not None
  outputs = llm.generate([[5, 6, 7, 8], [1, 2]], greedy(8, ignore_eos=True))
  assert [len(o.token_ids) for o in outputs] == [8, 8]
  # Six requests for four slots: a dispatch program that admits (and prefills) them too.
  llm.generate([[5, 6, 7, 8], [1, 2], [3], [4, 4], [9, 1], [2]], greedy(4, ignore_eos=True))
  programs = list(llm.scheduler.dispatch_programs.values())
  assert len(programs) == 2
  for program in programs:
    text = program.as_text()
    assert "all-reduce" in text
    gathers = [m.group(1) for m in ALL_GATHER.finditer(text)]
    assert gathers == [], f"{len(gathers)} all-gathers in the GPU dispatch program: {gathers}"
