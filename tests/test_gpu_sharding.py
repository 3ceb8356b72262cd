"""On real GPUs: greedy outputs identical on every mesh the machine's GPUs allow, for each
drafter (an MTP token tree included), dense and MoE (the MoE through the Pallas kernels where
bf16 makes them run)."""

import functools

import jax
import pytest

import jspec
from helpers import fixture_dir, greedy, wide_moe_llm

GPUS = sum(d.platform == "gpu" for d in jax.devices())
MESHES = [(2, 1, 1), (1, 2, 1), (1, 1, 2),                                 # 2 GPUs
          (2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 4, 1), (4, 1, 1),           # 4 GPUs
          (2, 2, 2), (1, 4, 2), (8, 1, 1), (1, 8, 1)]                      # 8 GPUs
SPECS = {"none": None, "mtp": {"method": "mtp", "num_speculative_tokens": 3},
         "ngram": {"method": "ngram", "num_speculative_tokens": 3},
         # a 7-node token tree of depth 3: ancestor masks, tree acceptance, cache compaction
         "tree": {"method": "mtp", "num_speculative_tokens": 7, "speculative_token_tree":
                  "[(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]"}}
PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8]]
# The fixtures have 4 query heads; "wide_moe" (random weights, 8 heads) also covers tp = 8.
MODELS = ["qwen3_dense", "qwen3_moe", "wide_moe"]


def _llm(name, mesh, spec):
  if name == "wide_moe":
    return wide_moe_llm(*mesh, SPECS[spec])
  dp, tp, ep = mesh
  return jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=64,
                   mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep, num_devices=dp * tp * ep),
                   speculative_config=SPECS[spec])


@functools.lru_cache(maxsize=None)
def _outputs(name, mesh, spec):
  outputs = _llm(name, mesh, spec).generate(PROMPTS, greedy(16, ignore_eos=True))
  return [o.token_ids for o in outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "dp%d-tp%d-ep%d" % m)
def test_gpu_meshes_give_identical_greedy_outputs(name, spec, mesh):
  if mesh[0] * mesh[1] * mesh[2] > GPUS:
    pytest.skip(f"mesh needs {mesh[0] * mesh[1] * mesh[2]} gpu devices, this machine has {GPUS}")
  if name != "wide_moe" and mesh[1] == 8:  # 4 query heads cannot split 8 ways: said plainly
    with pytest.raises(ValueError, match="tp=8 must divide num_attention_heads=4"):
      _llm(name, mesh, spec)
    return
  assert _outputs(name, mesh, spec) == _outputs(name, (1, 1, 1), "none")
