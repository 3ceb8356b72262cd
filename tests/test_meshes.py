"""Meshes as users write them, on 8 simulated CPU devices: a mesh takes the first dp*tp*ep
devices; a vocabulary that tp does not divide is padded (zero rows whose logits are -inf) and
never shows; the Pallas MoE kernels run any expert size (weights padded to their tile)."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from conftest import has_gpu
from helpers import fixture_dir, greedy, two_sample_chi2

# A mesh splits each contraction over its shards, so float32 sums run in another order: logits
# of magnitude ~6 move by up to ~2e-5 (seen with XLA's CPU backend at -O0).
# Padding rows that leaked, or a shard's wrong slice, are off by O(1).
LOGITS_TOL = dict(rtol=1e-5, atol=1e-4)

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [7, 8, 7, 8, 7, 8], [100, 3, 44, 9]]
MTP2 = {"method": "mtp", "num_speculative_tokens": 2}
_VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")


def _edited_fixture(out_dir, name, vocab_size=None, moe_intermediate_size=None,
                    own_mtp_head=False) -> str:
  """A copy of a fixture checkpoint cut to `vocab_size` tokens and `moe_intermediate_size`
  expert columns (the model those weights define); `own_mtp_head`: the DeepSeek-layout MTP
  layer's shared_head.head made unlike lm_head, so the head keeps its own."""
  os.makedirs(out_dir)
  src = fixture_dir(name)
  shutil.copy(os.path.join(src, "generation_config.json"), out_dir)
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  tensors = load_file(os.path.join(src, "model.safetensors"))
  for key, array in tensors.items():
    if vocab_size and key.endswith(_VOCAB_TENSORS):
      tensors[key] = array[:vocab_size]
    if moe_intermediate_size and ".experts." in key:
      f = moe_intermediate_size
      tensors[key] = array[:, :f] if key.endswith("down_proj.weight") else array[:f]
    if own_mtp_head and key.endswith("shared_head.head.weight"):
      tensors[key] = tensors[key] * 1.5
  config.update({k: v for k, v in (("vocab_size", vocab_size),
                                   ("moe_intermediate_size", moe_intermediate_size)) if v})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            os.path.join(out_dir, "model.safetensors"))
  return out_dir


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory):
  """qwen3_dense (untied, Qwen3-Next-layout MTP) with 445 tokens: tp = 2 and 4 pad it."""
  return _edited_fixture(str(tmp_path_factory.mktemp("odd") / "dense"), "qwen3_dense", 445)


_LLMS = {}


def _llm(model_dir, tp=1, spec=None, dp=1, ep=1, **kwargs) -> jspec.LLM:
  key = (model_dir, dp, tp, ep, json.dumps(spec), tuple(sorted(kwargs.items())))
  if key not in _LLMS:
    _LLMS[key] = jspec.LLM(model=model_dir, mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep),
                           dtype="float32", max_model_len=64, speculative_config=spec,
                           max_num_seqs=128, **kwargs)
  return _LLMS[key]


def _greedy_tokens(llm, max_tokens=10):
  return [o.token_ids for o in llm.generate(PROMPTS, greedy(max_tokens, ignore_eos=True))]


# ---- which devices a mesh uses ----------------------------------------------------------------

def test_a_mesh_uses_the_first_dp_tp_ep_devices():
  assert jax.device_count() == 8
  assert list(jspec.MeshConfig(tp=2).make_mesh().devices.flat) == jax.devices()[:2]
  mesh = jspec.MeshConfig(dp=2, tp=2).make_mesh()
  assert list(mesh.devices.flat) == jax.devices()[:4] and dict(mesh.shape) == {
      "dp": 2, "ep": 1, "tp": 2}
  assert list(jspec.MeshConfig().make_mesh().devices.flat) == jax.devices()[:1]
  assert jspec.MeshConfig(tp=2, ep=2, num_devices=4).make_mesh().devices.size == 4


def test_a_mesh_larger_than_the_host_or_than_num_devices_is_refused():
  with pytest.raises(ValueError, match=r"dp\*ep\*tp = 2\*1\*8 = 16 needs 16 devices, but only "
                                       r"8 are present"):
    jspec.MeshConfig(dp=2, tp=8).make_mesh()
  with pytest.raises(ValueError, match=r"num_devices=8 must equal dp\*ep\*tp = 1\*1\*2 = 2"):
    jspec.MeshConfig(tp=2, num_devices=8)


# ---- a vocabulary tp does not divide --------------------------------------------------------

def test_odd_vocabulary_is_padded_with_zero_rows_whose_logits_are_minus_inf(odd_vocab):
  llm = _llm(odd_vocab, tp=4, spec=MTP2)
  assert llm.config.vocab_size == 445
  embed = np.asarray(llm.target.embed[...])
  assert embed.shape == (448, 64) and not embed[445:].any()
  assert llm.target.lm_head[...].shape == (64, 448)
  hidden = jnp.ones((1, 2, 64), jnp.float32)
  for logits in (llm.target.logits(hidden), llm.mtp.layers[0].logits(llm.target, hidden)):
    logits = np.asarray(logits)
    assert np.all(logits[..., 445:] == -np.inf) and np.all(np.isfinite(logits[..., :445]))


@pytest.mark.parametrize("tp, spec", [(2, MTP2), (4, None), (4, MTP2),
                                      (2, {**MTP2, "draft_tp": 1})],
                         ids=["tp2-mtp", "tp4", "tp4-mtp", "tp2-mtp-replicated"])
def test_odd_vocabulary_gives_one_device_outputs_and_true_size_logits(odd_vocab, tp, spec):
  one = _llm(odd_vocab)
  llm = _llm(odd_vocab, tp=tp, spec=spec)
  assert _greedy_tokens(llm) == _greedy_tokens(one)
  want = one.compute_logits(PROMPTS[2:])
  got = llm.compute_logits(PROMPTS[2:])
  for g, w, p in zip(got, want, PROMPTS[2:]):
    assert g.shape == w.shape == (len(p), 445)
    np.testing.assert_allclose(g, w, **LOGITS_TOL)


def test_tied_odd_vocabulary_matches_one_device(tmp_path):
  model = _edited_fixture(str(tmp_path / "tied"), "qwen3_dense_tied_legacy", 383)
  one, two = _llm(model), _llm(model, tp=2)
  assert two.target.embed[...].shape == (384, 64) and not hasattr(two.target, "lm_head")
  assert _greedy_tokens(two) == _greedy_tokens(one)
  np.testing.assert_allclose(two.compute_logits(PROMPTS[:1])[0],
                             one.compute_logits(PROMPTS[:1])[0], **LOGITS_TOL)


def test_sampled_tokens_never_land_in_the_padding(odd_vocab):
  """Seeded draws of a prompt's first token on tp = 4 (3 padding rows). At temperature 50 the
  distribution is near uniform: were the padding rows' logits not -inf (a zero row scores 0),
  about 3/448 of the 2048 draws would be padding. At temperature 1 the draws follow the
  one-device distribution; and sampling with MTP drafts (rejection sampling) emits only true
  tokens."""
  def first_tokens(llm, *draws):
    """The first tokens of seeded draws, made in one call: for each (temperature, count) of
    `draws`, the tokens of seeds 0 .. count - 1 at that temperature."""
    params = [jspec.SamplingParams(temperature=temperature, max_tokens=1, seed=s)
              for temperature, count in draws for s in range(count)]
    outs = llm.generate([PROMPTS[1]] * len(params), params)
    tokens = np.array([o.token_ids[0] for o in outs])
    return np.split(tokens, np.cumsum([count for _, count in draws])[:-1])

  # Both temperatures in one call on tp = 4: a call of another size (its queue's shape) would
  # compile its programs anew, and each seeded draw is the same in any call.
  hot, tempered = first_tokens(_llm(odd_vocab, tp=4), (50.0, 2048), (1.0, 1024))
  assert hot.max() < 445
  (one_device,) = first_tokens(_llm(odd_vocab), (1.0, 1024))
  stat, critical, _ = two_sample_chi2(tempered, one_device)
  assert stat < critical
  sampled = jspec.SamplingParams(temperature=50.0, max_tokens=24, ignore_eos=True, seed=1)
  outs = _llm(odd_vocab, tp=4, spec=MTP2).generate(PROMPTS * 8, sampled)
  assert max(max(o.token_ids) for o in outs) < 445


def test_padded_parameters_save_and_convert_across_meshes(odd_vocab, tmp_path):
  """A converted checkpoint holds the padding of the mesh it was converted on; restored on
  another mesh it is re-padded (zeros at the ends of axes). The Hugging Face saver writes the
  true shapes."""
  from jspec.checkpoint import save_converted
  from jspec.train.saver import save_pretrained
  padded = _llm(odd_vocab, tp=4, spec=MTP2)
  save_converted(padded, str(tmp_path / "converted"))
  save_pretrained(str(tmp_path / "saved"), padded.config, padded.target, padded.mtp,
                  dtype="float32")
  assert load_file(str(tmp_path / "saved" / "model.safetensors"))["lm_head.weight"].shape == (
      445, 64)
  want = _llm(odd_vocab).compute_logits(PROMPTS[2:3])[0]
  for model, tp in ((tmp_path / "converted", 1), (tmp_path / "converted", 2),
                    (tmp_path / "saved", 2)):
    llm = jspec.LLM(model=str(model), mesh=jspec.MeshConfig(tp=tp), dtype="float32",
                    max_model_len=64, speculative_config=MTP2)
    assert llm.target.embed[...].shape == ({1: 445, 2: 446}[tp], 64)
    np.testing.assert_allclose(llm.compute_logits(PROMPTS[2:3])[0], want, **LOGITS_TOL)


# ---- the Pallas MoE kernels at any expert size ----------------------------------------------

@pytest.fixture(scope="module")
def moe_f48(tmp_path_factory):
  """qwen3_moe (DeepSeek-layout MoE MTP layer) with moe_intermediate_size 48: a tp = 2 shard
  holds 24 expert columns, which the kernels' tile (64) does not divide."""
  return _edited_fixture(str(tmp_path_factory.mktemp("f48") / "moe"), "qwen3_moe",
                         moe_intermediate_size=48)


@pytest.mark.skipif(has_gpu(), reason="fp32 on GPU falls back to ragged_dot")
def test_pallas_moe_pads_expert_weights_to_its_tile_and_equals_reference(
    moe_f48, interpreted_on_every_device):
  mesh = dict(dp=2, tp=2, ep=2)
  pallas = _llm(moe_f48, moe_backend="pallas", **mesh)
  reference = _llm(moe_f48, moe_backend="reference", **mesh)
  w_gate, w_down = (v.get_value() for v in (pallas.target.layers[1].mlp.w_gate,
                                            pallas.target.layers[1].mlp.w_down))
  assert w_gate.shape == (8, 64, 128) and w_down.shape == (8, 128, 64)  # 24 -> 64 per shard
  assert not np.asarray(w_gate)[:, :, 48:].any() and not np.asarray(w_down)[:, 48:].any()
  assert reference.target.layers[1].mlp.w_gate.get_value().shape == (8, 64, 48)
  seq = PROMPTS[2:3]
  np.testing.assert_allclose(pallas.compute_logits(seq)[0], reference.compute_logits(seq)[0],
                             **LOGITS_TOL)
  assert _greedy_tokens(pallas, 6) == _greedy_tokens(reference, 6)


@pytest.mark.skipif(has_gpu(), reason="fp32 on GPU falls back to ragged_dot")
def test_pallas_moe_pads_the_hidden_size_too(interpreted_on_every_device):
  """Hidden size 96 and expert intermediate 40 (20 per tp shard): weights padded to 128 and
  64 per shard, activations to 128 on the way in; random weights drawn at the true shapes,
  so both backends hold the same model."""
  import dataclasses
  from jspec.bench.presets import PRESETS
  config = PRESETS["tiny-moe"].replace(hidden_size=96, moe=dict(intermediate_size=40))
  llms = {backend: jspec.LLM.from_random(config, dtype="float32", max_model_len=64,
                                         mesh=jspec.MeshConfig(tp=2, ep=2), moe_backend=backend)
          for backend in ("pallas", "reference")}
  assert llms["pallas"].target.layers[0].mlp.w_down.get_value().shape == (8, 128, 128)
  seq = PROMPTS[:2]
  for got, want in zip(llms["pallas"].compute_logits(seq), llms["reference"].compute_logits(seq)):
    np.testing.assert_allclose(got, want, **LOGITS_TOL)


# ---- a vocabulary kept whole on every tp shard ------------------------------------------------

def test_replicated_vocabulary_gives_one_device_outputs():
  """ShardingRules(vocab=None): embedding and lm_head whole on each tp shard (no vocabulary
  collectives in the step); greedy tokens with MTP and logits equal one device's."""
  model_dir = fixture_dir("qwen3_moe")
  one = _llm(model_dir, spec=MTP2)
  llm = _llm(model_dir, tp=2, spec=MTP2, sharding_rules=jspec.ShardingRules(vocab=None))
  assert llm.target.embed[...].sharding.spec == jax.sharding.PartitionSpec(None, None)
  assert _greedy_tokens(llm) == _greedy_tokens(one)
  for got, want in zip(llm.compute_logits(PROMPTS[2:]), one.compute_logits(PROMPTS[2:])):
    np.testing.assert_allclose(got, want, **LOGITS_TOL)
