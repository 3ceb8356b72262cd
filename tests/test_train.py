"""Training: both objectives fall, the HF saver round-trips, and `train_mtp_head` learns."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx


import jspec  # noqa: E402
from jspec.config import ModelConfig, SamplingParams  # noqa: E402
from jspec.train import saver, trainer  # noqa: E402
from jspec.train.corpus import Document, split_documents  # noqa: E402
from jspec.train.mtp_head import train_mtp_head  # noqa: E402

TINY = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=96, hidden_size=32,
                   intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                   max_position_embeddings=256, eos_token_ids=(0,))


def _pattern_stream(seed=0, length=6000):
  """A learnable token stream: a few fixed phrases in random order."""
  rng = np.random.default_rng(seed)
  phrases = [rng.integers(1, TINY.vocab_size, size=rng.integers(4, 9)) for _ in range(12)]
  return np.concatenate([phrases[i] for i in rng.integers(0, len(phrases), size=length // 6)])


@pytest.fixture(scope="module")
def trained_tiny():
  tc = trainer.TrainConfig(seq_len=32, batch_size=8, steps=60, warmup_steps=5,
                           learning_rate=1e-2, log_every=1, compute_dtype="float32")
  return trainer.train_joint(TINY, {"a": _pattern_stream()}, tc)


def test_few_steps_reduce_both_losses(trained_tiny):
  _, _, info = trained_tiny
  first, last = info["history"][0], info["history"][-1]
  assert last["loss"] < first["loss"] - 1.0
  assert last["mtp_loss"] < first["mtp_loss"] - 1.0


def test_split_is_by_document_and_seeded():
  docs = [Document("bible", f"B{i}", "x") for i in range(20)] + [
      Document("python", f"p{i}.py", "y") for i in range(40)]
  train, held = split_documents(docs, 0.1, seed=3)
  again_train, again_held = split_documents(docs, 0.1, seed=3)
  assert [d.name for d in held] == [d.name for d in again_held]
  assert {d.name for d in train}.isdisjoint({d.name for d in held})
  assert sorted(d.source for d in held) == ["bible"] * 2 + ["python"] * 4


def test_the_saver_refuses_other_architectures_before_writing(tmp_path):
  """Another family's tensors would not map to Qwen3's names: refused up front, nothing written
  (a DeepSeek-V3 model's per-head kv_b parts failed in a reshape before)."""
  target, mtp = trainer.init_models(TINY, seed=1)
  other = dataclasses.replace(TINY, architecture="DeepseekV3ForCausalLM")
  with pytest.raises(ValueError, match="dense Qwen3 models .* DeepseekV3ForCausalLM"):
    saver.save_pretrained(str(tmp_path / "out"), other, target, mtp, dtype="float32")
  assert not (tmp_path / "out").exists()


def test_saved_checkpoint_gives_identical_logits(tmp_path):
  target, mtp = trainer.init_models(TINY, seed=1)
  saver.save_pretrained(str(tmp_path), TINY, target, mtp, dtype="float32")
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  assert config["architectures"] == ["Qwen3ForCausalLM"] and config["mtp_num_hidden_layers"] == 1
  llm = jspec.LLM(model=str(tmp_path), dtype="float32", max_model_len=64)
  assert llm.mtp_spec.layout == "qwen3_next"
  tokens = [3, 17, 42, 5, 88, 1, 60]
  from jspec.train.objective import target_forward
  expected = np.asarray(target.logits(target_forward(target, jnp.asarray([tokens]))))[0]
  np.testing.assert_allclose(llm.compute_logits([tokens])[0], expected, rtol=1e-5, atol=1e-5)
  # The LLM holds q, k and v as one matrix (jspec.models.qkv_fusion): compared apart.
  from jspec.models.qkv_fusion import unfused_flat_state
  ours = dict(nnx.to_flat_state(nnx.state(mtp)))
  loaded = dict(unfused_flat_state(llm.mtp))
  assert ours.keys() == loaded.keys()
  for path, variable in ours.items():
    np.testing.assert_array_equal(np.asarray(variable.get_value()),
                                  np.asarray(loaded[path].get_value()), err_msg=str(path))


def _greedy_acceptance(model_dir, prompts, k=2):
  llm = jspec.LLM(model=model_dir, dtype="float32", max_model_len=128,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k})
  outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
  return outs.metrics.mean_acceptance_length


def test_train_mtp_head_beats_untrained_head(tmp_path, trained_tiny):
  # The target: the tiny model trained above on a phrase stream; its head is replaced by an
  # untrained one, then trained on text the target itself generates (sampled, T=1).
  target, _, _ = trained_tiny
  _, untrained = trainer.init_models(TINY, seed=5)
  model_dir = str(tmp_path / "target")
  saver.save_pretrained(model_dir, TINY, target, untrained, dtype="float32")
  prompts = [list(_pattern_stream(seed=s, length=12)[:6]) for s in range(1, 9)]
  held_out = [list(_pattern_stream(seed=s, length=12)[:6]) for s in range(20, 24)]
  llm = jspec.LLM(model=model_dir, dtype="float32", max_model_len=128)
  own_text = [list(p) + list(o.token_ids) for p, o in zip(prompts, llm.generate(
      prompts, SamplingParams(temperature=1.0, max_tokens=100, seed=0, ignore_eos=True)))]
  before = _greedy_acceptance(model_dir, held_out)
  info = train_mtp_head(model_dir, own_text, steps=100, seq_len=32, batch_size=8,
                        learning_rate=1e-2)
  after = _greedy_acceptance(model_dir, held_out)
  assert info["history"][-1]["agree"] > info["history"][0]["agree"]
  assert after > before + 0.3, (before, after)
