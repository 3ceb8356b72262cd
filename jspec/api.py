"""`jspec.LLM`: load a checkpoint once, then generate in fixed-shape batches on device."""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from jspec import engine
from jspec.checkpoint import is_converted, restore_converted
from jspec.config import (SEPARATE_DRAFT_METHODS, ModelConfig, SamplingParams, SpecConfig,
                          checkpoint_dtype, resolve_dtype)
from jspec.models.caches import RECURRENT_COMMIT_MODES
from jspec.models.decode_attention import (ATTENTION_BACKENDS, resolve_attention_backend,
                                           sharded_mla_decode, sharded_window_attention)
from jspec.models.gated_deltanet import GatedDeltaNet
from jspec.models.hf_config import config_from_dir
from jspec.models.layers import MLP, Attention
from jspec.models.mla import MLAttention
from jspec.models.moe import MoE
from jspec.models.drafts import check_draft_caches, check_draft_vocabulary, init_random_drafter
from jspec.models.loading import init_random, load_checkpoint, load_eagle3
from jspec.models.projections import (PROJECTION_BACKENDS, sharded_fp8_projection,
                                      sharded_projection, weights_replicated)
from jspec.models.moe_backends import expert_tile, get_experts_fn, resolve_moe_backend
from jspec.models.mtp import MTPSpec
from jspec.outputs import GenerateOutputs, aggregate
from jspec.pallas_kernels import platform
from jspec.progress import notice, stage
from jspec.stop_strings import apply_stop_strings
from jspec.sharding.moe import EP_STRATEGIES, needs_shard_map, sharded_experts
from jspec.sharding.plan import device_capacity, plan_memory, validate_mesh
from jspec.sharding.rules import MeshConfig, ShardingRules, axis_size, global_array

Prompt = str | Sequence[int]
BATCHING_MODES = ("continuous", "waves")
DEFAULT_MAX_MODEL_LEN = 4096
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def enable_compilation_cache(directory: str | None):
  """JAX's persistent cache: a program compiled once is reused by later processes.
  JSPEC_COMPILATION_CACHE=off leaves it disabled (the CPU test suite does: a fresh clone has
  nothing to reuse, and serialising every program it compiles would only add work)."""
  directory = directory or os.environ.get("JSPEC_COMPILATION_CACHE",
                                          os.path.expanduser("~/.cache/jspec/xla"))
  from jax.experimental.compilation_cache import compilation_cache
  if directory == "off":
    # JAX decides once per process whether its cache is used; an earlier LLM with a cache
    # directory leaves it on until the cache is reset.
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    return
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_enable_compilation_cache", True)
  if jax.config.jax_compilation_cache_dir != directory:
    # JAX opens its cache once per process; a new directory needs the old one closed first.
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", directory)
  # jspec's programs are few and reused across processes: cache every one, however quick.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class LLM:
  """A target model (and its MTP head, if any) on a mesh, ready to generate.

  Args mirror vLLM's offline `LLM`: `model` is a local Hugging Face directory (config.json +
  safetensors, tokenizer files optional); `speculative_config` a dict such as
  {"method": "mtp", "num_speculative_tokens": 3} or None for plain decoding.
  """

  def __init__(self, model: str | None = None, *, mesh: MeshConfig | None = None,
               speculative_config: SpecConfig | dict | None = None,
               max_model_len: int | None = None,
               dtype="bfloat16", moe_backend: str = "auto", seed: int = 0,
               max_num_seqs: int | str = "auto", compilation_cache_dir: str | None = None,
               ep_strategy: str = "auto", device_memory_bytes: int | None = None,
               prefill_chunk_size: int = 256, attention_backend: str = "auto",
               recurrent_commit: str = "store", sharding_rules: ShardingRules | None = None,
               batching: str = "continuous", projection_backend: str = "auto",
               _modules=None, _draft=None):
    self.dtype = resolve_dtype(checkpoint_dtype(model) if dtype == "auto" else dtype)
    if attention_backend not in ATTENTION_BACKENDS:
      raise ValueError(f"attention_backend={attention_backend!r} is not supported; choose one "
                       f"of {ATTENTION_BACKENDS}")
    # "auto": the Pallas decode kernels on a Hopper GPU, XLA's attention elsewhere.
    self.attention_backend = resolve_attention_backend(attention_backend)
    if projection_backend not in PROJECTION_BACKENDS:
      raise ValueError(f"projection_backend={projection_backend!r} is not supported; choose "
                       f"one of {PROJECTION_BACKENDS}")
    if ep_strategy not in EP_STRATEGIES:  # checked on every mesh, not only where ep > 1
      raise ValueError(f"ep_strategy={ep_strategy!r} is not supported; choose one of "
                       f"{EP_STRATEGIES}")
    if recurrent_commit not in RECURRENT_COMMIT_MODES:
      raise ValueError(f"recurrent_commit={recurrent_commit!r} is not supported; choose one of "
                       f"{RECURRENT_COMMIT_MODES}")
    self.spec = SpecConfig.parse(speculative_config)
    self.mesh_config = mesh or MeshConfig()
    if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
      raise ValueError(f"max_model_len={max_model_len!r} must be an integer >= 2")
    if max_num_seqs != "auto" and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
      raise ValueError(f"max_num_seqs={max_num_seqs!r} must be an integer >= 1 or 'auto'")
    if not (isinstance(prefill_chunk_size, int) and prefill_chunk_size >= 16
            and prefill_chunk_size & (prefill_chunk_size - 1) == 0):
      raise ValueError(f"prefill_chunk_size={prefill_chunk_size!r} must be a power of two >= 16")
    self.prefill_chunk_size = prefill_chunk_size
    if batching not in BATCHING_MODES:
      raise ValueError(f"batching={batching!r} is not supported; choose one of {BATCHING_MODES}")
    # "continuous": a finished sequence's slot takes the next request inside the loop;
    # "waves": the former scheduler, batches that end with their longest request (jspec.engine).
    self.batching = batching
    self.moe_backend = resolve_moe_backend(moe_backend)
    self.seed = seed
    self.max_num_seqs = max_num_seqs
    self._request_counter = 0
    enable_compilation_cache(compilation_cache_dir)
    self.mesh = self.mesh_config.make_mesh()
    # The logical-axis -> mesh-axis table (jspec.sharding.rules); e.g. ShardingRules(vocab=None)
    # keeps the embedding and lm_head whole on every tp shard.
    self.rules = sharding_rules or ShardingRules()
    if self.spec and self.spec.draft_tp not in (None, 1, self.mesh_config.tp):
      raise ValueError(f"draft_tp={self.spec.draft_tp} must be 1 (the draft replicated over tp) "
                       f"or the target's tp={self.mesh_config.tp}")
    self.draft_rules = (self.rules.without_tp() if self.spec and self.spec.draft_tp == 1
                        else self.rules)

    if _modules is not None:  # LLM.from_random: benchmark models built on device.
      self.model_dir, self.config, self.target, self.mtp, self.mtp_spec = _modules
      self.max_model_len = max_model_len = self._resolve_max_model_len(max_model_len)
      self.tokenizer = None
    else:
      if model is None:
        raise ValueError("LLM needs `model`, a local Hugging Face checkpoint directory")
      if not os.path.isdir(model):
        raise FileNotFoundError(f"model directory {model!r} does not exist")
      self.model_dir = model
      # Expert weights at the backend's tile, where it has one (ModelConfig.padded_for).
      self.config = dataclasses.replace(config_from_dir(model),
                                        expert_tile=expert_tile(self.moe_backend))
      validate_mesh(self.config, self.mesh_config)
      self.max_model_len = max_model_len = self._resolve_max_model_len(max_model_len)
      self.tokenizer = _load_tokenizer(model)
      if self.spec and self.spec.method in SEPARATE_DRAFT_METHODS:
        self._check_drafter(self.spec)  # before any weight is read
      load = restore_converted if is_converted(model) else load_checkpoint
      with stage(f"loading {model}"):
        self.target, self.mtp, self.mtp_spec = load(
            model, self.config, self.dtype, self.mesh, self.rules, self.draft_rules)
    if self.spec and self.spec.method == "mtp" and self.mtp is None:
      raise ValueError("speculative method 'mtp' needs MTP weights, and this checkpoint has "
                       "none; use {'method': 'ngram', ...} or a checkpoint with an MTP head")
    k = self.spec.num_speculative_tokens if self.spec else 0
    use_mtp = self.spec is not None and self.spec.method == "mtp"
    if use_mtp and self.spec.draft_vocab is not None:
      self._restrict_draft_vocab(self.spec.draft_vocab)
    self._set_recurrent_commit(recurrent_commit)
    # The module the drafter runs (jspec.speculative.drafters), or None; the memory plan counts
    # its weights and caches.
    self.draft_module = self.mtp if use_mtp else None
    if self.spec and self.spec.method in SEPARATE_DRAFT_METHODS:
      self.draft_module = (_draft if _draft is not None
                           else self._load_drafter(self.spec, self.mesh_config))
    self.memory_plan = plan_memory(
        self.mesh_config, self.mesh, self.target, self.draft_module, self.rules,
        self.draft_rules, self.dtype, max_num_seqs, max_model_len, k,
        capacity_bytes=device_memory_bytes or device_capacity())
    # "auto": the most sequences the plan fits for max_model_len (jspec.sharding.plan).
    self.max_num_seqs = self.memory_plan.max_num_seqs
    if max_num_seqs == "auto":
      notice(f"max_num_seqs='auto': {self.max_num_seqs} sequences at max_model_len="
             f"{max_model_len} ({self.memory_plan.describe()})")
    base_experts = get_experts_fn(self.moe_backend)
    self.experts_fn = self.draft_experts_fn = base_experts
    for module, rules in ((self.target, self.rules), (self.draft_module, self.draft_rules)):
      for _, node in ([] if module is None else nnx.iter_graph(module)):
        if isinstance(node, MoE):
          node.expert_shards = axis_size(self.mesh, rules.experts)
    if needs_shard_map(self.mesh):
      self.experts_fn = sharded_experts(base_experts, self.mesh, self.rules, ep_strategy)
      self.draft_experts_fn = sharded_experts(base_experts, self.mesh, self.draft_rules,
                                              ep_strategy)
    if self.attention_backend == "pallas":
      # "auto" takes the MLA kernel (measured faster than XLA's latent attention); GQA layers
      # keep XLA's attention unless "pallas" is asked for: the split-S kernel has not been
      # measured to beat XLA on the default path at short contexts.
      self._use_pallas_attention(explicit=attention_backend == "pallas")
    self.projection_backend = self._use_projections(projection_backend)
    self._runner = engine.Runner(self)

  def _set_recurrent_commit(self, mode: str):
    """How linear-attention layers keep a verify window until commit (jspec.models.caches):
    "replay" reruns the emitted positions from the state before the window, "store" keeps
    the state after every position and picks one."""
    self.recurrent_commit = mode
    for _, node in nnx.iter_graph(self.target):
      if isinstance(node, GatedDeltaNet):
        node.commit_mode = mode

  def _use_pallas_attention(self, explicit: bool = True):
    """Decode, verify and draft steps of the target and the draft attend through the split-S
    kernels, laid out like their caches (interpreted off GPU, where Triton cannot compile
    them): GQA layers through `window_attention`, MLA layers through `mla_decode` where the
    compiled kernel takes their latent width (jspec.pallas_kernels.mla_decode.fits_kernel)."""
    from jspec.pallas_kernels.mla_decode import fits_kernel
    interpret = jax.devices()[0].platform != "gpu"
    for module, rules in ((self.target, self.rules), (self.mtp, self.draft_rules)):
      if module is None:
        continue
      kernel = sharded_window_attention(self.mesh, rules, interpret)
      for _, node in nnx.iter_graph(module):
        if isinstance(node, Attention) and explicit:
          node.window_attention = kernel
        elif isinstance(node, MLAttention) and (interpret or fits_kernel(node.latent_dim,
                                                                         node.rope_dim)):
          node.latent_kernel = sharded_mla_decode(self.mesh, rules, node.latent_dim,
                                                  node.scale, interpret)
          if not explicit:
            # "auto": the kernel where it was measured faster than XLA's path on an H200
            # (BENCHMARKS.md, "MLA decode attention"): windows of up to 128 query rows per
            # shard (a decode step of 128 heads, a verify window of 16 heads x 4 positions);
            # wider ones (128 heads x 4 positions: 0.76-0.80x at batch 8 and 32) keep XLA's.
            node.latent_kernel_max_rows = MLA_KERNEL_MAX_ROWS * axis_size(self.mesh,
                                                                           rules.q_heads)

  def _use_projections(self, backend: str) -> str:
    """Sets the attention layers' projection product (jspec.models.projections); returns the
    backend in effect: "auto" becomes "pallas" on Hopper where the weights are whole on every
    shard (the kernel then takes only the products XLA would strength-reduce), else "xla"."""
    forced = backend == "pallas"
    if self.config.fp8_block is not None and backend != "xla":
      self._use_fp8_projections()
    if backend == "auto":
      replicated = all(weights_replicated(self.mesh, r) for r in (self.rules, self.draft_rules))
      backend = "pallas" if platform.on_hopper() and replicated else "xla"
    if backend == "xla":
      return backend
    for module, rules in ((self.target, self.rules), (self.draft_module, self.draft_rules)):
      if module is None:
        continue
      if not weights_replicated(self.mesh, rules):
        raise ValueError("projection_backend='pallas' needs the attention weights whole on "
                         "every shard, and this mesh splits them over tp; use 'auto' or 'xla'")
      kernel = sharded_projection(self.mesh, rules, always=forced)
      for _, node in nnx.iter_graph(module):
        if isinstance(node, Attention):
          node.projection = kernel
    return backend

  def _resolve_max_model_len(self, max_model_len: int | None) -> int:
    """The requested max_model_len checked against the config, or its default (the model's
    context, capped to keep caches modest, and to a sliding window: inside it, attending to
    the whole context is exact)."""
    window = self.config.sliding_window
    if max_model_len is None:
      return min(DEFAULT_MAX_MODEL_LEN, self.config.max_position_embeddings,
                 window or DEFAULT_MAX_MODEL_LEN)
    if max_model_len > self.config.max_position_embeddings:
      raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                       f"max_position_embeddings={self.config.max_position_embeddings}")
    if window and max_model_len > window:
      raise ValueError(f"max_model_len={max_model_len} exceeds the sliding attention window of "
                       f"{window} tokens in this {self.config.architecture} config; jspec "
                       "attends over the whole context, which equals sliding-window attention "
                       f"only while every sequence fits in the window: lower max_model_len to "
                       f"at most {window}")
    return max_model_len

  def _use_fp8_projections(self):
    """On a GPU, FP8 projections of steps with few rows go to the FP8 kernel where the mesh
    keeps the weights whole on every shard; elsewhere they are scaled before XLA's dot."""
    if not platform.on_hopper():
      return
    for module, rules in ((self.target, self.rules), (self.draft_module, self.draft_rules)):
      if module is None or not weights_replicated(self.mesh, rules):
        continue
      kernel = sharded_fp8_projection(self.mesh, rules, self.config.fp8_block)
      mlp_whole = axis_size(self.mesh, rules.mlp) == 1
      for _, node in nnx.iter_graph(module):
        if isinstance(node, (Attention, MLAttention)) or (isinstance(node, MLP) and mlp_whole):
          node.fp8_projection = kernel

  def _restrict_draft_vocab(self, ids):
    vocab = self.config.vocab_size
    if max(ids) >= vocab:
      raise ValueError(f"draft_vocab has token id {max(ids)} outside the vocabulary [0, {vocab})")
    # The head's [D, N] slice is split over the vocab shards: repeat the last id up to a
    # multiple of them (its copies hold equal logits, so drafts are unchanged).
    ids = tuple(ids) + (ids[-1],) * (-len(ids) % axis_size(self.mesh, self.draft_rules.vocab))
    ids_N = global_array(np.asarray(ids, np.int32), self.draft_rules.sharding(self.mesh, (None,)))
    head_sharding = self.draft_rules.sharding(self.mesh, ("embed", "vocab"))
    for layer in self.mtp.layers:
      layer.restrict_vocab(self.target, ids_N, head_sharding)

  def _draft_config(self, spec: SpecConfig) -> ModelConfig:
    path = spec.model
    if not os.path.isdir(path):
      raise FileNotFoundError(f"draft model directory {path!r} does not exist")
    return dataclasses.replace(config_from_dir(path),
                               expert_tile=expert_tile(self.moe_backend))

  def _check_drafter(self, spec: SpecConfig):
    """A draft model must share the target's vocabulary and tokenizer, and keep caches that
    roll back by length; refused here, before any weight is read."""
    if spec.method == "eagle3":
      if not os.path.isdir(spec.model):
        raise FileNotFoundError(f"EAGLE-3 head directory {spec.model!r} does not exist")
      return  # its config is checked against the target's while loading (eagle3.py)
    draft_cfg = self._draft_config(spec)
    check_draft_vocabulary(self.config, draft_cfg, self.tokenizer, _load_tokenizer(spec.model),
                           self.model_dir, spec.model)
    check_draft_caches(draft_cfg)
    mesh = self.mesh_config
    validate_mesh(draft_cfg, mesh if spec.draft_tp != 1
                  else dataclasses.replace(mesh, tp=1, num_devices=None))

  def _load_drafter(self, spec: SpecConfig, mesh_config: MeshConfig):
    """A draft model or an EAGLE-3 head from `spec.model`, on the draft's sharding rules."""
    del mesh_config
    path = spec.model
    if spec.method == "eagle3":
      with stage(f"loading EAGLE-3 head {path}"):
        return load_eagle3(path, self.config, self.dtype, self.mesh, self.draft_rules)
    draft_cfg = self._draft_config(spec)
    with stage(f"loading draft model {path}"):
      draft, _, _ = load_checkpoint(path, draft_cfg, self.dtype, self.mesh, self.draft_rules,
                                    self.draft_rules, load_mtp=False)
    return draft

  @classmethod
  def from_random(cls, config: ModelConfig, mtp_spec: MTPSpec | None = None, *,
                  mesh: MeshConfig | None = None, dtype="bfloat16", seed: int = 0,
                  draft_config=None, **kwargs):
    """Random weights of the given shapes, born sharded on the mesh (benchmarks, tests).
    `draft_config`: the drafter of a "draft_model" (a ModelConfig) or "eagle3" (an
    Eagle3Config) speculative_config, also random."""
    mesh_config = mesh or MeshConfig()
    rules = kwargs.get("sharding_rules") or ShardingRules()
    spec = SpecConfig.parse(kwargs.get("speculative_config"))
    draft_rules = rules.without_tp() if spec and spec.draft_tp == 1 else rules
    config = dataclasses.replace(config,
                                 expert_tile=expert_tile(kwargs.get("moe_backend", "auto")))
    validate_mesh(config, mesh_config)
    with stage("initialising random weights"):
      dtype = "bfloat16" if dtype == "auto" else dtype
      target, mtp = init_random(config, mtp_spec, resolve_dtype(dtype),
                                mesh_config.make_mesh(), rules, draft_rules, seed)
      draft = None
      if draft_config is not None:
        draft = init_random_drafter(draft_config, config, resolve_dtype(dtype),
                                    mesh_config.make_mesh(), draft_rules, seed)
    return cls(mesh=mesh_config, dtype=dtype, seed=seed,
               _modules=(None, config, target, mtp, mtp_spec), _draft=draft, **kwargs)

  # ---- requests -------------------------------------------------------------------------

  def _encode(self, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (int, np.integer))):
      raise ValueError("prompts must be a list of prompts (strings or token-id lists); "
                       "wrap a single prompt in a list")
    prompts = list(prompts)
    if not prompts:
      raise ValueError("prompts is empty: pass at least one prompt")
    encoded = []
    media = set(self.config.multimodal_token_ids)
    for i, prompt in enumerate(prompts):
      if isinstance(prompt, dict):
        kinds = sorted(set(prompt) & {"multi_modal_data", "images", "image", "videos", "video"})
        raise ValueError(f"prompt {i} is a dict{' with ' + ', '.join(kinds) if kinds else ''}: "
                         "jspec generates from text only (no image or video inputs); pass a "
                         "string or a list of token ids")
      if isinstance(prompt, str):
        if self.tokenizer is None:
          raise ValueError(f"prompt {i} is text but {self.model_dir!r} has no tokenizer files; "
                           "pass token ids instead")
        ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
      else:
        not_ints = [t for t in prompt if not isinstance(t, (int, np.integer))]
        if not_ints:
          raise ValueError(f"prompt {i} has token ids that are not integers: {not_ints[:5]}")
        ids = [int(t) for t in prompt]
      if not ids:
        raise ValueError(f"prompt {i} is empty")
      placeholders = sorted(media.intersection(ids))
      if placeholders:
        raise ValueError(f"prompt {i} holds image/video placeholder token ids {placeholders}: "
                         "jspec generates from text only (no image or video inputs)")
      bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
      if bad:
        raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary "
                         f"[0, {self.config.vocab_size})")
      if len(ids) >= self.max_model_len:
        raise ValueError(f"prompt {i} has {len(ids)} tokens; max_model_len={self.max_model_len} "
                         f"leaves room for prompts of at most {self.max_model_len - 1}")
      encoded.append(ids)
    return encoded

  def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
      return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
      return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
      raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    for p in params:
      if not isinstance(p, SamplingParams):
        raise ValueError(f"expected SamplingParams, got {type(p).__name__}")
    return params

  def _seed_for(self, params: SamplingParams) -> int:
    if params.seed is not None:
      return int(params.seed)
    self._request_counter += 1
    return hash((self.seed, self._request_counter)) & 0x7FFFFFFF

  def generate(self, prompts, sampling_params=None, use_tqdm=True) -> GenerateOutputs:
    """Generates for every prompt; outputs come back in prompt order.

    `use_tqdm`: a progress bar over finished requests (tokens/s in its postfix) for calls
    that last more than a moment; False hides it, as does JSPEC_PROGRESS=0; a tqdm-like class
    draws it instead of tqdm.
    """
    prompt_ids = self._encode(prompts)
    params = self._params_list(sampling_params, len(prompt_ids))
    if self.batching == "waves" and any(
        p.n > 1 or p.logprobs is not None or p.prompt_logprobs is not None for p in params):
      raise ValueError("batching='waves' generates one completion per prompt without "
                       "logprobs; use batching='continuous' for n, logprobs and prompt_logprobs")
    if self.tokenizer is None and any(p.stop for p in params):
      raise ValueError(f"stop strings need a tokenizer, and {self.model_dir!r} has no tokenizer "
                       "files; stop on token ids instead (stop_token_ids)")
    seeds = [self._seed_for(p) for p in params]
    decode = None
    if self.tokenizer is not None:  # each token's own text, for Logprob.decoded_token
      decode = lambda ids: self.tokenizer.batch_decode([[i] for i in ids])
    # Wall time counts running only: compiling a new bucket is reported by its own progress line.
    result = self._runner.generate(prompt_ids, params, seeds, use_tqdm=use_tqdm, decode=decode)
    outputs = result.outputs
    if self.tokenizer is not None:
      text = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
      for out, p in zip(outputs, params):
        for completion in out.outputs:
          completion.text = text(completion.token_ids)
          if p.stop:
            apply_stop_strings(completion, p.stop, p.include_stop_str_in_output, text)
    k = self.spec.num_speculative_tokens if self.spec else 0
    return GenerateOutputs(outputs, aggregate(outputs, k, result.wall_time_s),
                           host_seconds_per_dispatch=result.host_seconds_per_dispatch,
                           dispatches=result.dispatches)

  def chat(self, messages, sampling_params=None, use_tqdm=True, chat_template: str | None = None,
           add_generation_prompt: bool = True) -> GenerateOutputs:
    """Generates replies to conversations, as vLLM's `LLM.chat`: `messages` is one
    conversation (a list of {"role", "content"} dicts) or a list of them; each is rendered by
    the tokenizer's chat template (or `chat_template`, a Jinja string) and generated as a text
    prompt."""
    if self.tokenizer is None:
      raise ValueError(f"chat needs a tokenizer, and {self.model_dir!r} has no tokenizer files")
    if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
      raise ValueError(f"the tokenizer of {self.model_dir!r} has no chat template; pass "
                       "chat_template= (a Jinja string) or generate from text prompts")
    single = (isinstance(messages, Sequence) and bool(messages)
              and isinstance(messages[0], dict))
    conversations = [messages] if single else list(messages)
    for i, conversation in enumerate(conversations):
      if not conversation or not all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                     for m in conversation):
        raise ValueError(f"conversation {i} must be a non-empty list of {{'role', 'content'}} "
                         "dicts")
    prompts = [self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  chat_template=chat_template,
                                                  add_generation_prompt=add_generation_prompt)
               for conversation in conversations]
    return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

  def compute_logits(self, token_id_lists) -> list[np.ndarray]:
    """The target's float32 logits [len, vocab] for each sequence (one forward, no sampling)."""
    ids = self._encode(token_id_lists)
    return self._runner.compute_logits(ids)


# "auto"'s limit on an MLA window's query rows per shard for the latent kernel.
MLA_KERNEL_MAX_ROWS = 128


def _load_tokenizer(model_dir: str):
  if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
    return None
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

