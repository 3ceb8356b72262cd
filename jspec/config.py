"""Frozen configuration dataclasses, validated once at the public boundary.

Configuration is data that knows no model family: a checkpoint's `ModelConfig` is built by
its family (jspec.models.hf_config.config_from_dir, through the registry), which imports
this module and never the other way round.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np


SUPPORTED_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def checkpoint_dtype(model_dir: str | None) -> str:
  """What dtype="auto" means (vLLM's spelling): the checkpoint's own `dtype` (`torch_dtype`
  before transformers 5) from config.json; bfloat16 for an FP8 checkpoint (its activations and
  unquantized weights), for a model without config.json, or where the config names none.
  Unlike vLLM, a float32 checkpoint stays float32 (vLLM's "auto" runs it in float16)."""
  path = None if model_dir is None else os.path.join(model_dir, "config.json")
  if path is None or not os.path.isfile(path):
    return "bfloat16"
  try:
    with open(path) as f:
      raw = json.load(f)
  except (OSError, json.JSONDecodeError) as err:
    raise ValueError(f"cannot read {path}: {err}") from err
  text = raw.get("text_config", {}) if isinstance(raw.get("text_config"), dict) else {}
  name = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
  quantized = (raw.get("quantization_config") or {}).get("quant_method") == "fp8"
  return "bfloat16" if quantized or name is None else str(name)


def resolve_dtype(dtype: Any):
  """Accepts 'bfloat16' / jnp.bfloat16 / 'bf16'-free canonical names; refuses the rest."""
  name = getattr(dtype, "__name__", None) or getattr(dtype, "name", None) or str(dtype)
  name = {"float": "float32", "half": "float16"}.get(name, name)
  if name not in SUPPORTED_DTYPES:
    raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(SUPPORTED_DTYPES)}")
  return SUPPORTED_DTYPES[name]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Mixture of experts. Qwen3-MoE's layout: every `decoder_sparse_step`-th layer sparse unless
  listed in `mlp_only_layers`, a softmax router, top-k weights renormalised where
  `norm_topk_prob`, an optional gated shared expert of `shared_expert_intermediate_size`.
  DeepSeek-V3 / GLM-4.5's (jspec.models.moe): "sigmoid" scores with an optional per-expert
  correction bias used only to choose experts, top-k within the best `topk_group` of `n_group`
  expert groups, weights times `routed_scaling_factor`, `num_shared_experts` ungated SwiGLU
  experts of width intermediate_size each (one MLP of their total width), and dense MLPs in
  the first `first_k_dense_replace` layers."""
  num_experts: int
  num_experts_per_tok: int
  intermediate_size: int
  norm_topk_prob: bool = False
  mlp_only_layers: tuple[int, ...] = ()
  decoder_sparse_step: int = 1
  shared_expert_intermediate_size: int = 0  # 0: no gated shared expert
  router_scoring: str = "softmax"
  router_correction_bias: bool = False
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  num_shared_experts: int = 0
  first_k_dense_replace: int = 0


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash; jspec.models.mla). q_lora_rank
  0: queries through one q_proj instead of q_a_proj -> norm -> q_b_proj."""
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
  """Gated DeltaNet, the token mixer of hybrid models' "linear_attention" layers (Qwen3-Next,
  Qwen3.5; jspec.models.gated_deltanet)."""
  num_key_heads: int
  num_value_heads: int
  key_head_dim: int
  value_head_dim: int
  conv_kernel: int


@dataclasses.dataclass(frozen=True)
class MTPConfig:
  """Multi-token prediction heads the config declares (their layout is found from weights)."""
  num_layers: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder's shape: the fields every family has, then one group per kind of part that only
  some families have (None where the model has none), each declared by its family alone."""
  architecture: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float
  rope_theta: float
  tie_word_embeddings: bool
  max_position_embeddings: int
  eos_token_ids: tuple[int, ...] = ()
  moe: MoEConfig | None = None
  mla: MLAConfig | None = None
  linear: LinearAttentionConfig | None = None
  mtp: MTPConfig | None = None
  # Hybrid models (Qwen3-Next / Qwen3.5): each layer's token mixer, "full_attention" or
  # "linear_attention" (`linear`); empty means every layer is full attention.
  layer_types: tuple[str, ...] = ()
  partial_rotary_factor: float = 1.0
  # Attention: biases on the q/k/v projections (GLM-4.5); q/k RMSNorms over head_dim (Qwen3
  # always, GLM-4.5 optionally).
  attention_bias: bool = False
  use_qk_norm: bool = True
  # A bias on o_proj too (Llama's `attention_bias` covers all four projections).
  o_proj_bias: bool = False
  # The smallest sliding attention window of any layer (Mistral v0.1, Qwen2 with
  # use_sliding_window; 0: none). jspec attends over the whole context, which is exact while
  # every position is inside the window: jspec.LLM refuses a longer max_model_len.
  sliding_window: int = 0
  # RoPE beyond rope_theta (jspec.models.rope): YaRN's or Llama-3's ("llama3") parameters as
  # sorted (key, value) items, empty for plain RoPE; `rope_interleave`: rotary dims in
  # interleaved pairs (DeepSeek-V3).
  rope_scaling: tuple[tuple[str, Any], ...] = ()
  rope_interleave: bool = False
  # Where the text model's tensors live: "model." or, in multimodal layouts, "model.language_model.".
  weight_prefix: str = "model."
  # Token ids that stand for image / video content: refused in prompts (text-only).
  multimodal_token_ids: tuple[int, ...] = ()
  # Fine-grained FP8 checkpoints (jspec.models.quantization): the (out, in) block size of the
  # projections' float8_e4m3fn weights and their scales; None: unquantized.
  fp8_block: tuple[int, int] | None = None
  # Projection kinds the FP8 checkpoint keeps unquantized (its modules_to_not_convert, read
  # by jspec.models.quantization.unconverted_kinds), built unquantized.
  fp8_unconverted: tuple[str, ...] = ()
  # Not read from the checkpoint: how many copies of each KV head the cache holds. 1 unless
  # tensor parallelism is wider than num_kv_heads; then every tp shard keeps the one KV head
  # its query heads read (vLLM's rule), and this is tp / num_kv_heads (`for_kv_shards`).
  kv_head_replicas: int = 1
  # Not read from the checkpoint either: zero padding at the end of an axis that the mesh and
  # the kernels need (`padded_for`). The embedding and lm_head hold `padded_vocab_size` rows,
  # whose logits past vocab_size are -inf (jspec.models.params.mask_padded_vocab); expert
  # weights are [E, moe_padded_hidden_size, moe_padded_intermediate_size] (a zero gate/up
  # column and a zero down row add nothing). `expert_tile`: the multiple that expert D and each
  # shard's F are padded to, from the MoE backend (the Pallas kernels' tile; 1: none).
  expert_tile: int = 1
  vocab_padding: int = 0
  moe_hidden_padding: int = 0
  moe_intermediate_padding: int = 0

  def __post_init__(self):
    # A width of 0 or a negative layer count would build an empty or broken model silently.
    at_least = dict(vocab_size=1, hidden_size=1, num_heads=1, num_kv_heads=1, head_dim=1,
                    num_layers=0, intermediate_size=0)  # 0: layers / dense MLPs it has none of
    bad = [f"{name}={getattr(self, name)!r} (at least {least})" for name, least in at_least.items()
           if type(getattr(self, name)) is not int or getattr(self, name) < least]
    if bad:
      raise ValueError(f"{self.architecture} config: {', '.join(bad)} must be integers")

  def replace(self, **changes) -> "ModelConfig":
    """dataclasses.replace, where a group's name may also take a dict: the changes to that
    group's fields (`config.replace(moe=dict(num_experts=16))`)."""
    for name in ("moe", "mla", "linear", "mtp"):
      if isinstance(changes.get(name), dict):
        group = getattr(self, name)
        if group is None:
          raise ValueError(f"{self.architecture} has no {name} group to change")
        changes[name] = dataclasses.replace(group, **changes[name])
    return dataclasses.replace(self, **changes)

  @property
  def is_moe(self) -> bool:
    return self.moe is not None

  @property
  def is_mla(self) -> bool:
    return self.mla is not None

  def layer_type(self, layer_index: int) -> str:
    return self.layer_types[layer_index] if self.layer_types else "full_attention"

  @property
  def rotary_dim(self) -> int:
    """RoPE covers the first head_dim * partial_rotary_factor dims of each head."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def cache_kv_heads(self) -> int:
    """KV heads in the cache (and in attention): num_kv_heads, times the replicas."""
    return self.num_kv_heads * self.kv_head_replicas

  def for_kv_shards(self, shards: int) -> "ModelConfig":
    """This config with the KV-head copies that splitting heads over `shards` needs:
    none while shards divides num_kv_heads, shards / num_kv_heads when it is a multiple."""
    k = self.num_kv_heads
    if k % shards == 0 or self.is_mla:  # MLA has no KV heads: its latent serves every head
      return dataclasses.replace(self, kv_head_replicas=1)
    if shards % k:
      raise ValueError(f"tp={shards} must divide num_key_value_heads={k} or be a multiple of it")
    return dataclasses.replace(self, kv_head_replicas=shards // k)

  @property
  def padded_vocab_size(self) -> int:
    return self.vocab_size + self.vocab_padding

  @property
  def moe_padded_hidden_size(self) -> int:
    return self.hidden_size + self.moe_hidden_padding

  @property
  def moe_padded_intermediate_size(self) -> int:
    return self.moe.intermediate_size + self.moe_intermediate_padding

  def padded_for(self, vocab_shards: int, expert_shards: int) -> "ModelConfig":
    """This config with the padding that splitting the vocabulary into `vocab_shards` and each
    expert's intermediate into `expert_shards` needs, expert D and per-shard F at multiples of
    `expert_tile`."""
    up = lambda n, multiple: -(-n // multiple) * multiple
    fields = dict(vocab_padding=up(self.vocab_size, vocab_shards) - self.vocab_size)
    if self.is_moe:
      f, tile = self.moe.intermediate_size, self.expert_tile
      fields.update(moe_hidden_padding=up(self.hidden_size, tile) - self.hidden_size,
                    moe_intermediate_padding=up(f, tile * expert_shards) - f)
    return dataclasses.replace(self, **fields)

  def layer_is_moe(self, layer_index: int) -> bool:
    """Qwen3-MoE's rule (transformers `Qwen3MoeDecoderLayer`): sparse unless listed as dense;
    and DeepSeek-V3 / GLM-4.5's: the first `first_k_dense_replace` layers are dense."""
    moe = self.moe
    if (moe is None or layer_index in moe.mlp_only_layers
        or layer_index < moe.first_k_dense_replace):
      return False
    return (layer_index + 1) % moe.decoder_sparse_step == 0


from jspec.spec_config import (MAX_SPECULATIVE_TOKENS, SEPARATE_DRAFT_METHODS,  # noqa: E402,F401
                                SPEC_METHODS, TREE_METHODS, SpecConfig)


# The most alternatives per position `logprobs` / `prompt_logprobs` may ask for (vLLM's
# default max_logprobs).
MAX_LOGPROBS = 20


def is_int(value) -> bool:
  """An integer, and not a bool (True is an int to Python, never a count or an id here)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value) -> bool:
  """A real number, not a bool or a string that reads as one."""
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
      value, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling settings; names follow vLLM's offline API."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_tokens: int = 16
  stop_token_ids: Sequence[int] | None = None
  seed: int | None = None
  ignore_eos: bool = False
  # n completions of the prompt, sharing its prefill (sample i > 0 draws from its own random
  # stream, so a seeded request's first completion is the one n = 1 gives).
  n: int = 1
  # Per generated (prompt) token: its log-probability and the top-N alternatives, as
  # {token_id: Logprob} per position (jspec.outputs); the target's raw log-softmax, before
  # temperature, top-k and top-p, as vLLM's default. None: not computed.
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  # Strings that end a completion where its text first holds one (jspec.stop_strings); the
  # text ends before it unless include_stop_str_in_output. Needs the model's tokenizer.
  stop: str | Sequence[str] | None = None
  include_stop_str_in_output: bool = False

  def __post_init__(self):
    if not (is_int(self.max_tokens) and self.max_tokens >= 1):
      raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
    if not (is_number(self.temperature) and self.temperature >= 0):
      raise ValueError(f"temperature={self.temperature!r} must be a number >= 0 (0 means "
                       "greedy)")
    if not (is_number(self.top_p) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1]")
    if self.top_k == -1 and is_int(self.top_k):  # vLLM's spelling of "off"
      object.__setattr__(self, "top_k", 0)
    if not (is_int(self.top_k) and self.top_k >= 0):
      raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0, or 0 / -1 (vLLM's "
                       "spelling) to disable top-k")
    if self.stop_token_ids is not None:
      ids = self.stop_token_ids
      if (isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence)
          or not all(is_int(t) and t >= 0 for t in ids)):
        hint = f"; for one id write stop_token_ids=[{ids}]" if isinstance(ids, int) else ""
        raise ValueError(f"stop_token_ids={ids!r} must be a list of token ids (integers >= 0)"
                         + hint)
      object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
    if self.stop is not None:
      stops = (self.stop,) if isinstance(self.stop, str) else self.stop
      if (not isinstance(stops, Sequence)
          or not all(isinstance(t, str) and t for t in stops)):
        raise ValueError(f"stop={self.stop!r} must be a string or a list of non-empty strings")
      object.__setattr__(self, "stop", tuple(stops) or None)
    # Any integer, negative ones too (vLLM takes them; a seed is used modulo 2**32).
    if self.seed is not None and not is_int(self.seed):
      raise ValueError(f"seed={self.seed!r} must be an integer or None")
    if not (is_int(self.n) and self.n >= 1):
      raise ValueError(f"n={self.n!r} must be an integer >= 1")
    for name in ("ignore_eos", "include_stop_str_in_output"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
    for name in ("logprobs", "prompt_logprobs"):
      value = getattr(self, name)
      if value is not None and not (is_int(value) and 0 <= value <= MAX_LOGPROBS):
        raise ValueError(f"{name}={value!r} must be None or an integer in [0, {MAX_LOGPROBS}] "
                         "(the number of alternatives per position)")
