"""Building an LLM: options checked, then config -> target -> drafter -> memory plan ->
backends -> scheduler, in that order (each step needs the ones before it).

`build` returns an `LLMParts`: everything `jspec.LLM` serves from. Every refusal that can be
made before weights are read is made before (options here, a drafter's by its method's
setup, jspec.speculative.drafters.setup), so a wrong argument costs no loading or compiling.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from jspec.backends import (set_recurrent_commit, use_experts, use_fused_prefill_attention,
                            use_pallas_attention, use_projections, use_row_kernels,
                            use_vocab_lookup)
from jspec.checkpoint import is_converted, restore_converted
from jspec.config import ModelConfig, SpecConfig, checkpoint_dtype, resolve_dtype
from jspec.models.hf_config import config_from_dir
from jspec.device import DeviceModel
from jspec.models.decode_attention import resolve_attention_backend
from jspec.models.drafts import init_random_drafter
from jspec.models.loading import init_random, load_checkpoint
from jspec.models.moe_backends import expert_tile, resolve_moe_backend
from jspec.models.qkv_fusion import fuse_qkv
from jspec.options import EngineOptions
from jspec.progress import notice, stage
from jspec.schedulers.continuous import ContinuousScheduler
from jspec.schedulers.waves import WavesScheduler
from jspec.scoring import Scorer
from jspec.memory_plan import device_capacity, plan_memory
from jspec.sharding.plan import validate_mesh
from jspec.sharding.rules import MeshConfig, ShardingRules
from jspec.sharding.tensor_parallel import resolve_all_reduce_backend
from jspec.sharding.vocab import sharded_vocab_argmax
from jspec.speculative.drafters import setup_for
from jspec.speculative.drafters.setup import TargetContext
from jspec.tokenizer import load_tokenizer

# batching= -> the scheduler that runs every generate call (jspec.schedulers; the modes'
# meanings: jspec.options.BATCHING_MODES, whose names these keys are).
SCHEDULERS = {"continuous": ContinuousScheduler, "waves": WavesScheduler}
DEFAULT_MAX_MODEL_LEN = 4096


@dataclasses.dataclass
class LLMParts:
  """A target model (and its drafter) on a mesh, with the programs that run it."""
  model_dir: str | None
  tokenizer: object | None
  config: ModelConfig
  dtype: object
  spec: SpecConfig | None
  mesh_config: MeshConfig
  mesh: object
  rules: ShardingRules
  draft_rules: ShardingRules
  target: object
  mtp: object | None
  mtp_spec: object | None
  draft_module: object | None  # the module the drafter runs (jspec.speculative.drafters)
  max_model_len: int
  max_num_seqs: int
  prefill_chunk_size: int
  memory_plan: object
  batching: str
  seed: int
  moe_backend: str
  attention_backend: str
  projection_backend: str
  norm_backend: str
  recurrent_commit: str
  all_reduce_backend: str
  experts_fn: object
  draft_experts_fn: object
  options: EngineOptions  # as given (the fields above hold resolved values)
  # The target's and the draft's greedy argmax where the mesh splits their vocabulary
  # (jspec.sharding.vocab.sharded_vocab_argmax), None elsewhere.
  vocab_argmax: tuple = (None, None)
  device: DeviceModel | None = None
  scheduler: object = None
  scorer: Scorer | None = None


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


def check_model_dir(model):
  """`model` names a local checkpoint directory; refused with what to pass instead where it
  names a file in one, or what looks like a Hugging Face hub id (jspec downloads nothing)."""
  if not isinstance(model, (str, os.PathLike)):
    raise ValueError(f"model={model!r} must be a checkpoint directory (a path)")
  model = os.fspath(model)
  if os.path.isdir(model):
    return
  if os.path.isfile(model):
    raise ValueError(f"model={model!r} is a file; pass the checkpoint's directory: "
                     f"{os.path.dirname(os.path.abspath(model))!r}")
  hub_like = (model.count("/") == 1 and not model.startswith((".", "/", "~"))
              and all(model.split("/")))
  hint = (f"; jspec loads local directories only, so download it first, e.g. "
          f"`huggingface-cli download {model} --local-dir DIR`, and pass DIR"
          if hub_like else "")
  raise FileNotFoundError(f"model directory {model!r} does not exist{hint}")


def resolve_max_model_len(config: ModelConfig, max_model_len: int | None) -> int:
  """The requested max_model_len checked against the config, or its default (the model's
  context, capped to keep caches modest, and to a sliding window: inside it, attending to
  the whole context is exact)."""
  window = config.sliding_window
  if max_model_len is None:
    return min(DEFAULT_MAX_MODEL_LEN, config.max_position_embeddings,
               window or DEFAULT_MAX_MODEL_LEN)
  if max_model_len > config.max_position_embeddings:
    raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                     f"max_position_embeddings={config.max_position_embeddings}")
  if window and max_model_len > window:
    raise ValueError(f"max_model_len={max_model_len} exceeds the sliding attention window of "
                     f"{window} tokens in this {config.architecture} config; jspec "
                     "attends over the whole context, which equals sliding-window attention "
                     f"only while every sequence fits in the window: lower max_model_len to "
                     f"at most {window}")
  return max_model_len


def draft_rules_for(spec: SpecConfig | None, rules: ShardingRules) -> ShardingRules:
  """The drafter's sharding rules: draft_tp=1 replicates it over tp."""
  return rules.without_tp() if spec and spec.draft_tp == 1 else rules


def build(model: str | None, options: EngineOptions, random_modules=None,
          random_draft=None) -> LLMParts:
  """The parts of `jspec.LLM(model, **options)`; `random_modules`, `random_draft`: what
  `random_modules` built instead of loading."""
  spec = options.check()
  dtype = options.dtype
  dtype = resolve_dtype(checkpoint_dtype(model) if dtype == "auto" else dtype)
  attention_backend, projection_backend = options.attention_backend, options.projection_backend
  norm_backend, all_reduce_backend = options.norm_backend, options.all_reduce_backend
  max_model_len, max_num_seqs = options.max_model_len, options.max_num_seqs
  # "auto": the Pallas decode kernels on a Hopper GPU, XLA's attention elsewhere.
  resolved_attention = resolve_attention_backend(attention_backend)
  mesh_config = options.mesh or MeshConfig()
  moe_backend = resolve_moe_backend(options.moe_backend)
  enable_compilation_cache(options.compilation_cache_dir)
  device_mesh = mesh_config.make_mesh()
  # The logical-axis -> mesh-axis table (jspec.sharding.rules); e.g. ShardingRules(vocab=None)
  # keeps the embedding and lm_head whole on every tp shard.
  rules = options.sharding_rules or ShardingRules()
  draft_rules = draft_rules_for(spec, rules)
  drafter_setup = setup_for(spec)

  # ---- config and target ----
  if random_modules is not None:
    model_dir, config, target, mtp, mtp_spec = random_modules
    max_model_len = resolve_max_model_len(config, max_model_len)
    tokenizer = None
  else:
    if model is None:
      raise ValueError("LLM needs `model`, a local Hugging Face checkpoint directory")
    check_model_dir(model)
    model_dir = model
    # Expert weights at the backend's tile, where it has one (ModelConfig.padded_for).
    config = dataclasses.replace(config_from_dir(model),
                                 expert_tile=expert_tile(moe_backend))
    validate_mesh(config, mesh_config)
    max_model_len = resolve_max_model_len(config, max_model_len)
    tokenizer = load_tokenizer(model)
  if spec is not None and spec.speculative_token_tree is not None and (
      "linear_attention" in config.layer_types):
    raise ValueError("speculative_token_tree needs caches by position; this model's linear-"
                     "attention layers keep one recurrent state per sequence, which a tree's "
                     "branches would share. Use a chain (no speculative_token_tree)")
  target_context = TargetContext(config, model_dir, tokenizer, mesh_config, device_mesh,
                                 draft_rules, dtype, moe_backend)
  if random_modules is None:
    drafter_setup.check(spec, target_context)  # before any weight is read
    load = restore_converted if is_converted(model) else load_checkpoint
    with stage(f"loading {model}"):
      target, mtp, mtp_spec = load(model, config, dtype, device_mesh, rules, draft_rules)

  # ---- drafter ----
  draft_module = drafter_setup.module(spec, target_context, target, mtp, random_draft)
  set_recurrent_commit(target, options.recurrent_commit)
  # q, k and v as one product wherever a layer takes it (jspec.models.qkv_fusion).
  fuse_qkv(target, mtp, draft_module)

  # ---- memory plan ----
  k = spec.num_speculative_tokens if spec else 0
  memory_plan = plan_memory(mesh_config, device_mesh, target, draft_module, rules, draft_rules,
                            dtype, max_num_seqs, max_model_len, k,
                            capacity_bytes=options.device_memory_bytes or device_capacity())
  if max_num_seqs == "auto":
    notice(f"max_num_seqs='auto': {memory_plan.max_num_seqs} sequences at max_model_len="
           f"{max_model_len} ({memory_plan.describe()})")

  # ---- backends ----
  target_pair, draft_pair = (target, rules), (draft_module, draft_rules)
  custom_all_reduce = resolve_all_reduce_backend(all_reduce_backend, projection_backend,
                                                 device_mesh) == "kernel"
  use_vocab_lookup(device_mesh, (target_pair, draft_pair, (mtp, draft_rules)), custom_all_reduce)
  vocab_argmax = tuple(sharded_vocab_argmax(device_mesh, r, custom_all_reduce)
                       for r in (rules, draft_rules))
  # The MoE layers' collectives go through the kernel wherever it runs, "auto" included: on 2
  # H200s (Qwen3-30B-A3B, ep = 2, one lease) a step took 5.84 against 6.41 ms at batch 1 and
  # 11.31 against 11.41 ms at batch 32 with XLA's (BENCHMARKS.md; jspec.sharding.moe).
  experts_fn, draft_experts_fn = use_experts(moe_backend, device_mesh, options.ep_strategy,
                                             target_pair, draft_pair, custom_all_reduce)
  if resolved_attention == "pallas":
    # "auto" takes the MLA kernel (measured faster than XLA's latent attention) and cuDNN's
    # prefill attention; GQA layers' decode and verify steps keep XLA's attention unless
    # "pallas" is asked for: the split-S kernel has not been measured to beat XLA on the
    # default path at short contexts. The MTP head is set up even where another drafter runs
    # (a benchmark may time it).
    use_pallas_attention(device_mesh, (target_pair, (mtp, draft_rules)),
                         explicit=attention_backend == "pallas")
    # A separate drafter (a draft model, an EAGLE-3 head) prefills the prompt in the same
    # chunks: its windows of more than 64 query rows per KV head go through cuDNN too; its
    # narrower ones (draft steps) keep XLA's attention. (The MTP drafter is the head above.)
    if draft_module is not mtp:
      use_fused_prefill_attention(device_mesh, (draft_pair,))
  projection_backend = use_projections(projection_backend, config.fp8_block, device_mesh,
                                       (target_pair, draft_pair), all_reduce_backend)
  norm_backend = use_row_kernels(norm_backend, device_mesh,
                                 (target_pair, draft_pair, (mtp, draft_rules)))

  # ---- scheduler ----
  parts = LLMParts(
      model_dir=model_dir, tokenizer=tokenizer, config=config, dtype=dtype, spec=spec,
      mesh_config=mesh_config, mesh=device_mesh, rules=rules, draft_rules=draft_rules,
      target=target, mtp=mtp, mtp_spec=mtp_spec, draft_module=draft_module,
      max_model_len=max_model_len, max_num_seqs=memory_plan.max_num_seqs,
      prefill_chunk_size=options.prefill_chunk_size, memory_plan=memory_plan,
      batching=options.batching, seed=options.seed, moe_backend=moe_backend,
      attention_backend=resolved_attention, projection_backend=projection_backend,
      norm_backend=norm_backend, recurrent_commit=options.recurrent_commit,
      all_reduce_backend=all_reduce_backend, options=options,
      experts_fn=experts_fn, draft_experts_fn=draft_experts_fn, vocab_argmax=vocab_argmax)
  parts.device = DeviceModel(parts)
  parts.scorer = Scorer(parts.device, parts)
  parts.scheduler = SCHEDULERS[options.batching](parts.device, parts)
  return parts


def random_modules(config: ModelConfig, mtp_spec, options: EngineOptions, draft_config=None):
  """((None, config, target, mtp, mtp_spec), draft or None): random weights of the given
  shapes, born sharded on `options.mesh` (benchmarks, tests), for `build`'s `random_modules`
  and `random_draft`. `draft_config`: the drafter of a "draft_model" (a ModelConfig) or
  "eagle3" (an Eagle3Config) speculative_config, also random."""
  mesh_config, dtype, seed = options.mesh, options.dtype, options.seed
  rules = options.sharding_rules or ShardingRules()
  draft_rules = draft_rules_for(SpecConfig.parse(options.speculative_config), rules)
  config = dataclasses.replace(config, expert_tile=expert_tile(options.moe_backend))
  validate_mesh(config, mesh_config)
  with stage("initialising random weights"):
    target, mtp = init_random(config, mtp_spec, resolve_dtype(dtype), mesh_config.make_mesh(),
                              rules, draft_rules, seed)
    draft = None
    if draft_config is not None:
      draft = init_random_drafter(draft_config, config, resolve_dtype(dtype),
                                  mesh_config.make_mesh(), draft_rules, seed)
  return (None, config, target, mtp, mtp_spec), draft
