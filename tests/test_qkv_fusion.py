"""q, k and v as one matrix (jspec.models.qkv_fusion): the layers that take it, the same
tokens and logits as three products on every mesh, and checkpoints that still hold them apart.
8 simulated CPU devices, float32."""

import numpy as np
import pytest
from flax import nnx

import jspec
import jspec.build
from helpers import fixture_dir, greedy
from jspec.models.qkv_fusion import fuse_qkv, unfused_flat_state

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8]]


def _llm(name, tp=1, fused=True, monkeypatch=None, **kwargs):
  """The fixture's LLM; fused=False (with pytest's monkeypatch): its layers as loaded, q, k
  and v apart."""
  if not fused:
    monkeypatch.setattr(jspec.build, "fuse_qkv", lambda *modules: 0)
  llm = jspec.LLM(model=fixture_dir(name), mesh=jspec.MeshConfig(tp=tp, num_devices=tp),
                  dtype="float32", max_model_len=64, **kwargs)
  if not fused:
    monkeypatch.undo()
  return llm


def _attentions(module):
  return [node for _, node in nnx.iter_graph(module) if hasattr(node, "fused_qkv")]


@pytest.mark.parametrize("name,tp", [("qwen3_dense", 2), ("qwen2", 1)])
def test_fused_layers_give_the_tokens_and_logits_of_three_products(name, tp, monkeypatch):
  """Greedy tokens equal and logits within float32 rounding of the unfused layers: a GQA
  family with q / k norms (Qwen3) split over tp, one with q / k / v biases (Qwen2) on one
  device, through n-gram drafts' verify steps. (Every fixture family's parity tests run
  fused.)"""
  spec = {"method": "ngram", "num_speculative_tokens": 2}
  apart = _llm(name, tp, fused=False, monkeypatch=monkeypatch, speculative_config=spec)
  fused = _llm(name, tp, speculative_config=spec)
  assert all(not a.fused_qkv for a in _attentions(apart.target))
  assert all(a.fused_qkv for a in _attentions(fused.target))
  params = greedy(12, ignore_eos=True)
  assert ([o.token_ids for o in fused.generate(PROMPTS, params)]
          == [o.token_ids for o in apart.generate(PROMPTS, params)])
  np.testing.assert_allclose(fused.compute_logits(PROMPTS[:1])[0],
                             apart.compute_logits(PROMPTS[:1])[0], rtol=2e-5, atol=2e-5)


def test_fusion_splits_back_into_the_loaded_arrays_and_shards_by_kv_head(monkeypatch):
  """fuse_qkv then unfused_flat_state gives back every loaded array bit for bit, the MTP head
  included; on tp = 2 the fused matrix is split over its KV-head axis, each shard holding its
  KV heads' query heads, key and value."""
  llm = _llm("qwen3_dense", tp=2, fused=False, monkeypatch=monkeypatch,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2})
  before = {path: np.asarray(v.get_value())
            for module in (llm.target, llm.mtp) for path, v in nnx.to_flat_state(nnx.state(module))}
  q = np.asarray(llm.target.layers[0].attn.q_proj.get_value())
  k = np.asarray(llm.target.layers[0].attn.k_proj.get_value())
  v = np.asarray(llm.target.layers[0].attn.v_proj.get_value())
  assert fuse_qkv(llm.target, llm.mtp) == len(_attentions(llm.target)) + len(_attentions(llm.mtp))
  qkv = llm.target.layers[0].attn.qkv_proj.get_value()
  d, heads, c, h = qkv.shape
  assert (heads, c) == (k.shape[1], q.shape[1] // k.shape[1] + 2)
  assert tuple(qkv.sharding.spec)[:2] == (None, "tp")
  qkv = np.asarray(qkv)
  group = q.shape[1] // heads
  for j in range(heads):  # KV head j: query heads j*G .. j*G+G-1, then k, then v
    np.testing.assert_array_equal(qkv[:, j, :group], q[:, j * group:(j + 1) * group])
    np.testing.assert_array_equal(qkv[:, j, group], k[:, j])
    np.testing.assert_array_equal(qkv[:, j, group + 1], v[:, j])
  after = {path: np.asarray(v.get_value())
           for module in (llm.target, llm.mtp) for path, v in unfused_flat_state(module)}
  assert after.keys() == before.keys()
  for path, array in before.items():
    np.testing.assert_array_equal(after[path], array, err_msg=str(path))
  assert fuse_qkv(llm.target, llm.mtp) == 0  # fused once


def test_layers_that_keep_q_k_and_v_apart():
  """Gated attention (q_proj also emits the gate), FP8 weights and KV heads copied over more
  tp shards than there are heads keep three projections."""
  gated = _llm("qwen3_5_text")
  assert _attentions(gated.target) and all(not a.fused_qkv for a in _attentions(gated.target))
  fp8 = _llm("qwen3_dense_fp8")
  assert _attentions(fp8.target) and all(not a.fused_qkv for a in _attentions(fp8.target))
  replicated = _llm("qwen3_dense_tied_legacy", tp=4)  # 1 KV head over 4 shards
  assert replicated.target.cfg.kv_head_replicas > 1 and _attentions(replicated.target)
  assert all(not a.fused_qkv for a in _attentions(replicated.target))


def test_a_converted_checkpoint_holds_q_k_and_v_apart_and_restores_fused(tmp_path):
  """`jspec convert` of an LLM whose layers are fused writes the loaded layout (q_proj, k_proj,
  v_proj); restoring it fuses again and gives the same tokens, on another mesh too."""
  from jspec.checkpoint import save_converted
  llm = _llm("qwen3_dense")
  save_converted(llm, str(tmp_path / "converted"))
  restored = jspec.LLM(model=str(tmp_path / "converted"), dtype="float32", max_model_len=64,
                       mesh=jspec.MeshConfig(tp=2, num_devices=2))
  assert all(a.fused_qkv for a in _attentions(restored.target))
  params = greedy(10, ignore_eos=True)
  assert ([o.token_ids for o in restored.generate(PROMPTS, params)]
          == [o.token_ids for o in llm.generate(PROMPTS, params)])
