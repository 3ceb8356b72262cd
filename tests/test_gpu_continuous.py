"""On a GPU: the continuous-batching dispatch program updates its KV caches in place. XLA's GPU
compiler copied the whole target cache twice per iteration when the prefill chunk ran under
`lax.cond` and its write-back scatter read the cache again (BENCHMARKS.md, "Continuous
batching"); the CPU compiler never showed those copies, so only a GPU test can guard them."""

import math

import jax
import numpy as np
import pytest

import jspec
from helpers import fixture_dir, greedy
from jspec.bench.profile import large_moves

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", [None, "mtp"])
def test_dispatch_program_copies_no_cache_buffer(method):
  spec = None if method is None else {"method": method, "num_speculative_tokens": 2}
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="bfloat16", max_model_len=256,
                  max_num_seqs=8, prefill_chunk_size=64, speculative_config=spec)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, 288, size=n).tolist() for n in rng.integers(5, 120, size=12)]
  outputs = llm.generate(prompts, [greedy(int(m), ignore_eos=True)
                                   for m in rng.integers(1, 40, size=12)])
  assert len(outputs) == 12

  scheduler = llm.scheduler
  (plan, _, admits), = scheduler.dispatch_programs.keys()
  assert admits  # 12 requests, 8 slots
  dispatch_c, = scheduler.dispatch_programs.values()
  caches = jax.eval_shape(lambda: llm.target.init_caches(plan.loop.batch, plan.loop.cache_len,
                                                         llm.dtype))
  leaf_bytes = min(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(caches))
  copies = [m.line for m in large_moves(dispatch_c.as_text(), leaf_bytes)
            if m.op == "copy" or "copy" in m.name]
  assert copies == [], f"{len(copies)} cache-sized copies, e.g. {copies[:2]}"
