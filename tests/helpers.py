"""Shared test utilities: fixture paths, cached LLMs (compiles are the slow part on CPU)."""

import dataclasses
import functools
import json
import os
import shutil

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

import jspec
from jspec.bench.presets import PRESETS

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FIXTURE_NAMES = ("qwen3_dense", "qwen3_dense_tied_legacy", "qwen3_moe", "qwen3_moe_legacy")


def fixture_dir(name: str) -> str:
  return os.path.join(FIXTURES, name)


def reference(name: str):
  return np.load(os.path.join(fixture_dir(name), "reference.npz"))


@functools.lru_cache(maxsize=None)
def cached_llm(name: str, method: str | None = None, k: int = 0, max_model_len: int = 128,
               max_num_seqs: int | str = "auto", **kwargs) -> jspec.LLM:
  """One LLM per configuration for the whole test session (float32, exact on CPU); `kwargs`
  complete the speculative config."""
  spec = None if method is None else {"method": method, "num_speculative_tokens": k, **kwargs}
  return jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=max_model_len,
                   max_num_seqs=max_num_seqs, speculative_config=spec)


def assert_mtp_layer_matches_reference(llm: jspec.LLM, ref, atol: float):
  """The LLM's first MTP layer on the reference's post-norm hidden states h_0 .. h_{n-1} and
  next tokens t_1 .. t_n (sequences 1 and 2): its logits and its feedback hidden states within
  `atol` of the torch-built reference's. Jitted: one program per window length, where running
  the layer op by op compiles ~170-180 programs."""
  import jax.numpy as jnp
  from flax import nnx
  from jspec.models.moe_backends import experts_reference

  @nnx.jit
  def run(mtp, target, next_T, hidden_TD):
    n = next_T.shape[1]
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    layer = mtp.layers[0]
    normed, feedback, _ = layer(target, next_T, hidden_TD, positions,
                                mtp.init_caches(1, n, jnp.float32)[0], n, experts_reference)
    return layer.logits(target, normed), feedback

  for i in (1, 2):
    hidden_TD = jnp.asarray(ref[f"hidden_{i}"][:-1])[None]
    next_T = jnp.asarray(ref[f"seq_{i}"][1:], jnp.int32)[None]
    logits, feedback = run(llm.mtp, llm.target, next_T, hidden_TD)
    np.testing.assert_allclose(np.asarray(logits)[0], ref[f"mtp_logits_{i}"], atol=atol, rtol=0)
    np.testing.assert_allclose(np.asarray(feedback)[0], ref[f"mtp_hidden_{i}"], atol=atol,
                               rtol=0)


def greedy(max_tokens: int, **kwargs) -> jspec.SamplingParams:
  return jspec.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def greedy_token_ids(llm: jspec.LLM, prompts, max_tokens: int) -> list[list[int]]:
  """Each prompt's greedy continuation of exactly max_tokens tokens (EOS ignored)."""
  params = greedy(max_tokens, ignore_eos=True)
  return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def two_sample_chi2(a: np.ndarray, b: np.ndarray, min_count: int = 20):
  """Chi-square statistic that samples a and b share one distribution, over the tokens seen at
  least `min_count` times (the rest pooled), with its upper 1e-4 critical value and the
  degrees of freedom: (stat, critical, dof)."""
  tokens = [t for t, c in zip(*np.unique(np.concatenate([a, b]), return_counts=True))
            if c >= min_count]
  ca = np.array([np.sum(a == t) for t in tokens] + [np.sum(~np.isin(a, tokens))], float)
  cb = np.array([np.sum(b == t) for t in tokens] + [np.sum(~np.isin(b, tokens))], float)
  expected_a = (ca + cb) * ca.sum() / (ca.sum() + cb.sum())
  expected_b = (ca + cb) * cb.sum() / (ca.sum() + cb.sum())
  keep = expected_a > 0
  stat = np.sum((ca - expected_a)[keep] ** 2 / expected_a[keep]
                + (cb - expected_b)[keep] ** 2 / expected_b[keep])
  dof = int(keep.sum() - 1)
  z = 3.719  # Wilson-Hilferty upper 1e-4 quantile of chi-square(dof).
  critical = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
  return stat, critical, dof


# 8 query heads over 2 KV heads, 8 experts: divides over tp = 8 (the fixtures' 4 heads do not).
WIDE_MOE = dataclasses.replace(PRESETS["tiny-moe"], num_heads=8)


def wide_moe_llm(dp: int, tp: int, ep: int, spec=None) -> jspec.LLM:
  """A random-weight MoE with an MTP layer on the (dp, tp, ep) mesh; the same weights on every
  mesh (each parameter is drawn from its own key, whatever its sharding)."""
  return jspec.LLM.from_random(
      WIDE_MOE, jspec.MTPSpec("qwen3_next", 1, is_moe=True), dtype="float32", max_model_len=64,
      mesh=jspec.MeshConfig(dp=dp, tp=tp, ep=ep, num_devices=dp * tp * ep),
      speculative_config=spec)


def unquantize(fp8_dir, out, block: int, which=lambda name: True) -> str:
  """A copy of the FP8 checkpoint `fp8_dir` (one safetensors file, jspec convert's) at `out`
  with each e4m3 weight whose name `which` accepts multiplied by its block scale into float32
  (exact) and its scale dropped. Every weight: the model the FP8 one stands for, with no
  quantization_config. Some: those modules appended to modules_to_not_convert, as a checkpoint
  that keeps them unquantized lists them."""
  from jspec.models.safetensors_index import SafetensorsIndex  # noqa: PLC0415
  out = str(out)
  shutil.copytree(str(fp8_dir), out)
  index = SafetensorsIndex(str(fp8_dir))
  tensors, kept, still_fp8 = {}, [], False
  for name in sorted(index.names):
    if name.endswith("_scale_inv"):
      continue
    value = index.read(name)
    if value.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
      if not which(name):
        tensors[name], tensors[name + "_scale_inv"] = value, index.read(name + "_scale_inv")
        still_fp8 = True
        continue
      scale = index.read(name + "_scale_inv")
      full = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)
      value = value.astype(np.float32) * full[:value.shape[0], :value.shape[1]]
      kept.append(name.removesuffix(".weight"))
    tensors[name] = np.asarray(value, np.float32)
  for file in os.listdir(out):
    if file.startswith("model") and ".safetensors" in file:
      os.remove(os.path.join(out, file))
  save_file(tensors, os.path.join(out, "model.safetensors"))
  config_path = os.path.join(out, "config.json")
  with open(config_path) as f:
    config = json.load(f)
  if still_fp8:
    quantization = config["quantization_config"]
    quantization["modules_to_not_convert"] = (
        quantization.get("modules_to_not_convert") or []) + kept
  else:
    del config["quantization_config"]
  with open(config_path, "w") as f:
    json.dump(config, f)
  return out


def small_llm(model_dir, **kwargs) -> jspec.LLM:
  """A fixture-sized LLM: float32 (exact on CPU), 64 positions, 4 sequences."""
  return jspec.LLM(model=str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=4,
                   **kwargs)


def assert_fp8_greedy_is_the_dequantized_models(fp8_dir, plain_dir, prompts,
                                                max_tokens: int) -> jspec.LLM:
  """The FP8 checkpoint's greedy tokens are its dequantized twin's, and MTP speculation over
  the FP8 checkpoint gives them too; returns that speculating LLM."""
  want = greedy_token_ids(small_llm(plain_dir), prompts, max_tokens)
  assert greedy_token_ids(small_llm(fp8_dir), prompts, max_tokens) == want
  mtp = small_llm(fp8_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
  assert greedy_token_ids(mtp, prompts, max_tokens) == want
  return mtp
