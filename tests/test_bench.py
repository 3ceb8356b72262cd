"""`jspec bench` on a CPU smoke scale: the roofline byte count and the report's structure.
(Timings on a CPU mean nothing; the GPU figures live in BENCHMARKS.md.)"""

import dataclasses
import json

import jax
import numpy as np
from flax import nnx

import jspec
from jspec import cli
from jspec.bench.presets import PRESETS
from jspec.bench.roofline import expected_experts_used, step_bytes
from jspec.bench.report import row_line
from jspec.models.hf_config import config_from_hf


def _param_count(module):
  return sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(module)))


def test_step_bytes_counts_every_weight_a_step_reads():
  """Dense: all parameters but the embedding table (only B rows of it are read), plus KV."""
  cfg = PRESETS["tiny-moe"].replace(architecture="Qwen3ForCausalLM", moe=None)
  llm = jspec.LLM.from_random(cfg, dtype="float32", max_model_len=64)
  weights = _param_count(llm.target) - cfg.vocab_size * cfg.hidden_size
  kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
  for batch, context in ((1, 0), (3, 40)):
    assert step_bytes(cfg, batch, 1, context, itemsize=4) == 4 * (
        weights + batch * (context + 1) * kv_per_token)


def test_moe_step_reads_only_the_experts_that_get_tokens():
  cfg = PRESETS["tiny-moe"]
  one, many = step_bytes(cfg, 1, 1, 0), step_bytes(cfg, 1024, 1, 0)
  expert_bytes = 2 * 3 * cfg.hidden_size * cfg.moe.intermediate_size * cfg.num_layers
  kv = 2 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
  assert expected_experts_used(8, 2, 1) == 2.0
  assert abs(expected_experts_used(8, 2, 1024) - 8) < 1e-6
  assert abs((many - 1024 * kv) - (one - kv) - 6 * expert_bytes) <= 2


def test_bench_cli_writes_json_plot_and_table(tmp_path, capsys):
  code = cli.main(["bench", "--models", "tiny-moe", "--batch", "1", "2", "--context", "32",
                   "--bandwidth-bytes", str(1 << 22), "--out", str(tmp_path), "--allow-cpu"])
  assert code == 0
  report = json.loads((tmp_path / "bench.json").read_text())
  assert report["partial"] is None  # the run finished: no half-measured model is left
  assert report["results"][0]["draft_vocab_size"] == PRESETS["tiny-moe"].vocab_size
  rows = report["results"][0]["rows"]
  assert [(r["batch"], r["context"]) for r in rows] == [(1, 32), (2, 32)]
  for r in rows:
    assert r["decode_ms"] > 0 and 0 < r["roofline_fraction"]
    assert set(r["verify_relative"]) == {"2", "4", "6"} and r["draft_per_token_relative"] > 0
  assert (tmp_path / "bench.png").stat().st_size > 0
  out = capsys.readouterr().out
  assert "derived speedup" in out
  # Warm-up is measured first, so a run stopped during the grid still reports it.
  result = report["results"][0]
  assert result["warmup_seconds_generate"] > 0 and result["weights_seconds"] > 0
  assert 0 <= out.index("warm-up (compile + first generate)") < out.index(row_line("tiny-moe", rows[0]))


def test_bench_times_a_reduced_draft_vocabulary(tmp_path):
  code = cli.main(["bench", "--models", "tiny-moe", "--batch", "1", "--context", "32",
                   "--draft-vocab-size", "64", "--bandwidth-bytes", str(1 << 22),
                   "--out", str(tmp_path), "--allow-cpu"])
  assert code == 0
  result = json.loads((tmp_path / "bench.json").read_text())["results"][0]
  assert result["draft_vocab_size"] == 64 and result["rows"][0]["draft_per_token_relative"] > 0


def test_bench_without_a_gpu_says_so_before_building_anything(tmp_path, capsys, monkeypatch):
  def build(*args, **kwargs):
    raise AssertionError("a model was built")

  monkeypatch.setattr(jspec.LLM, "from_random", build)
  cpus = jax.devices("cpu")
  monkeypatch.setattr(jax, "devices", lambda *args: cpus)  # a machine without a GPU
  out = tmp_path / "results"
  assert cli.main(["bench", "--models", "qwen3-8b", "--out", str(out)]) == 2
  assert capsys.readouterr().err.strip() == (
      "jspec: error: jspec bench measures a GPU (step times against its HBM roofline), and "
      "this machine has none (JAX's devices are 'cpu'); run it on a GPU, or pass --allow-cpu "
      "for a smoke run whose timings mean nothing")
  assert not out.exists()


def test_peer_benchmark_builds_transformers_configs_of_the_same_shapes():
  """benchmarks/peers_transformers.py gives transformers exactly the preset's shapes."""
  import importlib.util
  import os
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "peers_transformers.py")
  spec = importlib.util.spec_from_file_location("peers_transformers", path)
  peers = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(peers)
  for name in ("qwen3-8b", "qwen3-30b-a3b"):
    preset = PRESETS[name]
    hf = peers.hf_config(preset)
    hf.architectures = [preset.architecture]
    assert dataclasses.replace(config_from_hf(hf), eos_token_ids=()) == preset


def test_step_bytes_counts_mla_weights_and_the_latent_cache():
  """MLA: every attention parameter once, and per token one latent row per layer (C + R
  values shared by all heads), not per-head keys and values."""
  cfg = PRESETS["tiny-mla"].replace(moe=None)
  llm = jspec.LLM.from_random(cfg, dtype="float32", max_model_len=64)
  weights = _param_count(llm.target) - cfg.vocab_size * cfg.hidden_size
  latent_per_token = cfg.num_layers * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
  for batch, context in ((1, 0), (3, 40)):
    assert step_bytes(cfg, batch, 1, context, itemsize=4) == 4 * (
        weights + batch * (context + 1) * latent_per_token)


def test_bench_times_mla_attention_over_the_latent():
  from jspec.bench.roofline import mla_attention_bytes
  from jspec.bench.steps import StepTimer
  cfg = PRESETS["tiny-mla"]
  llm = jspec.LLM.from_random(cfg, dtype="float32", max_model_len=64)
  assert StepTimer(llm).mla_attention(batch=2, context=40, width=4) > 0
  assert mla_attention_bytes(cfg, 2, 40, 4) == 2 * 40 * (cfg.mla.kv_lora_rank
                                                         + cfg.mla.qk_rope_head_dim) * 4
