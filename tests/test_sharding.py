"""Sharding: identical greedy outputs on every mesh, parameters placed by the rules table,
clear errors for meshes that do not divide the model. 8 simulated CPU devices."""

import functools
import json
import os
import socket
import subprocess
import sys

import jax
import pytest
from flax import nnx

import jspec
from helpers import fixture_dir, greedy, wide_moe_llm
from jspec.models.hf_config import config_from_dir

MESHES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 2, 4), (8, 1, 1)]
PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8], [100, 3, 44, 9]]
SPECS = {"none": None, "mtp": {"method": "mtp", "num_speculative_tokens": 2},
         "ngram": {"method": "ngram", "num_speculative_tokens": 2}}


def _mesh(dp, tp, ep):
  return jspec.MeshConfig(dp=dp, tp=tp, ep=ep, num_devices=dp * tp * ep)


@functools.lru_cache(maxsize=None)  # tests on one configuration share its compiled programs
def _llm(name, mesh, spec, **kwargs):
  return jspec.LLM(model=fixture_dir(name), mesh=mesh, dtype="float32", max_model_len=64,
                   speculative_config=SPECS[spec], **kwargs)


_BASELINE = {}


def _outputs(llm):
  """A batch of 3 (not divisible by dp = 2 or 8): every mesh runs it in a bucket of 4 or 8
  rows, with a padding row or idle shards (dp = 8: five), which must not show up in the
  outputs or in the aggregate metrics. (One batch bucket per mesh: a single request as well
  would compile each mesh's programs again, at its narrowest bucket, for the same claim.)"""
  prompts = PROMPTS[1:]
  outs = llm.generate(prompts, greedy(10, ignore_eos=True))
  assert len(outs) == len(prompts)
  assert outs.metrics.num_generated_tokens == 10 * len(prompts)
  assert outs.metrics.num_steps == sum(o.metrics.num_steps for o in outs)
  return [o.token_ids for o in outs]


def _baseline(name):
  if name not in _BASELINE:
    _BASELINE[name] = _outputs(_llm(name, _mesh(1, 1, 1), "none"))
  return _BASELINE[name]


# The MoE model's plain decoding on the meshes that combine axes or stretch one: the mixed
# (2, 2, 2), ep = 4 with tp, and dp = 8 (idle shards). On each single-axis mesh the MoE
# target runs its whole forward (prefill and verify, experts over ep) with the MTP head, and
# the dense model decodes plainly on dp = 2; plain decoding over tp alone: tp = 8 in
# test_tp_of_eight_over_two_kv_heads, tp = 4 in test_meshes; the hybrid MoE decodes plainly
# on dp = 8 and (2, 2, 2) (test_hybrid_moe_greedy_outputs_identical_on_every_mesh).
MOE_PLAIN_MESHES = ((2, 2, 2), (1, 2, 4), (8, 1, 1))


def _mesh_cases():
  """The MoE model (where ep shards experts) on every mesh with its MTP head (the drafter with
  sharded state), plain on MOE_PLAIN_MESHES, with n-gram drafts on the mixed and the
  widest-dp meshes; the dense model on every mesh with the drafters in turn."""
  ids = lambda m: "dp%d-tp%d-ep%d" % m
  wanted = {"none": MOE_PLAIN_MESHES, "mtp": MESHES[1:], "ngram": ((2, 2, 2), (8, 1, 1))}
  moe = [pytest.param("qwen3_moe", m, s, id=f"{s}-{ids(m)}-qwen3_moe")
         for m in MESHES[1:] for s in SPECS if m in wanted[s]]
  dense = [pytest.param("qwen3_dense", m, s, id=f"{s}-{ids(m)}-qwen3_dense")
           for m, s in zip(MESHES[1:], list(SPECS) * 2)]
  return moe + dense


@pytest.mark.parametrize("name, mesh, spec", _mesh_cases())
def test_greedy_outputs_identical_on_every_mesh(name, mesh, spec):
  llm = _llm(name, _mesh(*mesh), spec)
  assert _outputs(llm) == _baseline(name)


@pytest.mark.parametrize("spec", ["mtp"])
def test_replicated_draft_head_matches(spec):
  llm = jspec.LLM(model=fixture_dir("qwen3_moe"), mesh=_mesh(1, 2, 2), dtype="float32",
                  max_model_len=64, speculative_config={**SPECS[spec], "draft_tp": 1})
  assert _outputs(llm) == _baseline("qwen3_moe")
  for array in jax.tree.leaves(nnx.state(llm.mtp)):
    assert "tp" not in str(array.sharding.spec)


@pytest.mark.parametrize("name, mesh, spec", [("qwen3_moe", (1, 4, 2), "mtp"),
                                               ("qwen3_dense_tied_legacy", (2, 4, 1), "ngram")])
def test_tp_wider_than_kv_heads_gives_each_shard_its_head(name, mesh, spec):
  """tp = 4 over 2 KV heads (and over 1): each KV head is stored on the tp/K shards whose query
  heads read it. The k/v projections are replicated; each shard's cache holds one head."""
  llm = _llm(name, _mesh(*mesh), spec)
  assert _outputs(llm) == _baseline(name)
  kv_heads = llm.config.num_kv_heads
  assert llm.target.cfg.kv_head_replicas == 4 // kv_heads
  assert llm.target.cfg.cache_kv_heads // 4 == 1
  k_proj = llm.target.layers[0].attn.k_proj.get_value()
  assert k_proj.shape[1] == kv_heads and "tp" not in str(k_proj.sharding.spec)
  untouched = _llm(name, _mesh(mesh[0], 1, mesh[2]), spec)
  assert llm.memory_plan.target_cache_bytes * kv_heads == untouched.memory_plan.target_cache_bytes


def test_tp_of_eight_over_two_kv_heads():
  """tp = 8 on a model with 8 query heads and 2 KV heads (each KV head on 4 shards), MoE with
  an MTP draft: the same greedy tokens as on one device, plain and speculative."""
  want = [o.token_ids for o in wide_moe_llm(1, 1, 1).generate(PROMPTS, greedy(10, ignore_eos=True))]
  # (tp = 4 over 2 KV heads with ep: test_tp_wider_than_kv_heads_gives_each_shard_its_head.)
  for mesh, spec in (((1, 8, 1), None), ((1, 8, 1), SPECS["mtp"])):
    llm = wide_moe_llm(*mesh, spec)
    assert llm.target.cfg.kv_head_replicas == mesh[1] // 2
    got = [o.token_ids for o in llm.generate(PROMPTS, greedy(10, ignore_eos=True))]
    assert got == want, (mesh, spec)


def test_all_to_all_expert_parallelism_gives_the_one_device_outputs():
  """The all-to-all strategy; all-gather is what "auto" picks on this mesh, run by
  test_greedy_outputs_identical_on_every_mesh[mtp-dp1-tp2-ep4-qwen3_moe]."""
  llm = _llm("qwen3_moe", _mesh(1, 2, 4), "mtp", ep_strategy="all_to_all")
  assert _outputs(llm) == _baseline("qwen3_moe")


def test_every_parameter_is_sharded_by_its_rule():
  llm = _llm("qwen3_moe", _mesh(2, 2, 2), "mtp")
  for module in (llm.target, llm.mtp):
    for path, variable in nnx.to_flat_state(nnx.state(module)):
      want = llm.rules.spec(variable.get_metadata()["logical_axes"])
      got = variable.get_value().sharding.spec
      assert tuple(got) + (None,) * (len(want) - len(got)) == tuple(want), path


@pytest.mark.parametrize("mesh, match", [
    (jspec.MeshConfig(dp=2, tp=8, ep=1), r"dp\*ep\*tp = 2\*1\*8 = 16 needs 16 devices, but "
                                         r"only 8 are present"),
    (jspec.MeshConfig(tp=3, num_devices=3),
     "tp=3 must divide num_key_value_heads=2 or be a multiple of it"),
    (jspec.MeshConfig(dp=1, tp=8, ep=1), "tp=8 must divide num_attention_heads=4"),
    (jspec.MeshConfig(dp=1, tp=1, ep=8), None),  # dense: ep only splits the batch
])
def test_invalid_meshes_name_the_constraint(mesh, match):
  if match is None:
    _llm("qwen3_dense", mesh, "none")
    return
  with pytest.raises(ValueError, match=match):
    _llm("qwen3_dense", mesh, "none")


def test_ep_must_divide_experts():
  import dataclasses
  config = config_from_dir(fixture_dir("qwen3_moe")).replace(moe=dict(num_experts=6))
  with pytest.raises(ValueError, match="ep=4 must divide num_experts=6"):
    jspec.LLM.from_random(config, mesh=jspec.MeshConfig(ep=4, num_devices=4), dtype="float32")


def test_memory_plan_refuses_what_does_not_fit():
  with pytest.raises(ValueError, match=r"max_num_seqs=64 x max_model_len=64 does not fit.*"
                                       r"draft KV"):
    _llm("qwen3_dense", _mesh(1, 1, 1), "mtp", device_memory_bytes=2**19, max_num_seqs=64)
  plan = _llm("qwen3_dense", _mesh(1, 1, 1), "mtp", device_memory_bytes=2**30,
              max_num_seqs=64).memory_plan
  assert plan.draft_cache_bytes > 0 and plan.target_cache_bytes == 3 * plan.draft_cache_bytes
  # 33 sequences are padded to a 64-row bucket: the plan counts the rows really allocated.
  plan = _llm("qwen3_dense", _mesh(1, 1, 1), "none", max_num_seqs=33).memory_plan
  cfg = config_from_dir(fixture_dir("qwen3_dense"))
  slots = 128  # max_model_len + k + 1 = 65, rounded up to a multiple of 128 (buckets)
  assert plan.target_cache_bytes == (cfg.num_layers * 2 * 64 * slots * cfg.num_kv_heads
                                     * cfg.head_dim * 4)


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_form_one_mesh_and_match_a_single_process():
  port = _free_port()
  worker = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
  # The suite's other XLA flags kept (--xla_backend_optimization_level=0 halves the compiles).
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count=")]
  env = {**os.environ, "XLA_FLAGS": " ".join(flags + ["--xla_force_host_platform_device_count=4"]),
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
             [os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")])}
  procs = [subprocess.Popen([sys.executable, worker, str(port), str(i)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  results = [p.communicate(timeout=600) for p in procs]
  for p, (out, err) in zip(procs, results):
    assert p.returncode == 0, err[-3000:]
  outputs = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
  assert outputs[0] == outputs[1]
  llm = _llm("qwen3_moe", _mesh(2, 2, 2), "mtp")
  want = [o.token_ids for o in llm.generate(PROMPTS, greedy(10, ignore_eos=True))]
  assert outputs[0] == want


@pytest.mark.parametrize("spec, mesh", [
    ("none", (8, 1, 1)), ("none", (2, 2, 2)),
    ("mtp", (1, 2, 1)), ("mtp", (1, 1, 2)), ("mtp", (2, 2, 2))],
    ids=lambda v: "dp%d-tp%d-ep%d" % v if isinstance(v, tuple) else v)
def test_hybrid_moe_greedy_outputs_identical_on_every_mesh(spec, mesh):
  """Qwen3.5-MoE (published multimodal layout): linear-attention key heads and their value
  heads, conv channels and recurrent state over tp, experts over ep, sequences over dp x ep.
  dp = 8 with 3 requests leaves dp shards idle (padding rows)."""
  name = "qwen3_5_moe"
  llm = _llm(name, _mesh(*mesh), spec)
  assert _outputs(llm) == _baseline(name)
  if mesh[1] > 1:
    in_proj = llm.target.layers[0].linear_attn.in_proj.get_value()
    assert "tp" in str(in_proj.sharding.spec)
