"""vLLM's spellings where jspec keeps vLLM's meaning: the parallel sizes as a mesh, and
`stop_reason` naming the stop token id that ended a completion (None for EOS and length)."""

import jspec
from helpers import cached_llm, fixture_dir, greedy


def test_vllms_parallel_sizes_become_the_mesh():
  llm = jspec.LLM(model=fixture_dir("qwen3_dense"), dtype="float32", max_model_len=64,
                  max_num_seqs=4, tensor_parallel_size=2, data_parallel_size=2)
  assert llm.mesh_config == jspec.MeshConfig(dp=2, tp=2)


def test_stop_reason_names_the_stop_token_id_and_none_for_length():
  llm = cached_llm("qwen3_dense")
  prompt = [[5, 6, 7, 8, 9]]
  free = llm.generate(prompt, greedy(8, ignore_eos=True))[0]
  assert free.finish_reason == "length" and free.stop_reason is None
  # The first position where the greedy continuation holds a token not seen before it.
  ids = free.token_ids
  cut = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
  stopped = llm.generate(prompt, greedy(8, ignore_eos=True, stop_token_ids=[ids[cut]]))[0]
  assert stopped.token_ids == ids[:cut + 1]
  assert stopped.finish_reason == "stop"
  assert stopped.stop_reason == ids[cut] and stopped.outputs[0].stop_reason == ids[cut]
