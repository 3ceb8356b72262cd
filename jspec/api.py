"""`jspec.LLM`: load a checkpoint once, then generate in fixed-shape batches on device.

The face vLLM users know (generate, chat, compute_logits); building the model, its drafter,
memory plan, backends and scheduler is jspec.build's.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jspec.build import LLMParts, build, enable_compilation_cache, random_modules
from jspec.config import ModelConfig, SamplingParams, is_int
from jspec.models.mtp import MTPSpec
from jspec import interrupt
from jspec.options import OPTION_NAMES, EngineOptions, signature_with_options
from jspec.outputs import GenerateOutputs, aggregate
from jspec.schedulers.base import draft_positions
from jspec.sharding.rules import MeshConfig
from jspec.stop_strings import apply_stop_strings
from jspec.vllm_names import mesh_from_vllm

# enable_compilation_cache: also reachable here, where the CLI's tests call it.
__all__ = ["LLM", "enable_compilation_cache"]
Prompt = str | Sequence[int]


class LLM(LLMParts):
  """A target model (and its drafter, if any) on a mesh, ready to generate.

  Args mirror vLLM's offline `LLM`: `model` is a local Hugging Face directory (config.json +
  safetensors, tokenizer files optional); the keywords are jspec.options.EngineOptions' fields
  (e.g. `speculative_config`, a dict such as {"method": "mtp", "num_speculative_tokens": 3},
  or None for plain decoding), and vLLM's spellings of them (jspec.vllm_names). The built
  parts (jspec.build.LLMParts: config, target, mtp, draft_module, memory_plan, max_num_seqs,
  scheduler, ...) are the LLM's own attributes.
  """

  # An LLM is one object, not a record of values: identity, not the dataclass's field-wise
  # equality (which would also make it unhashable).
  __eq__ = object.__eq__
  __hash__ = object.__hash__

  def __init__(self, model: str | None = None, *, _modules=None, _draft=None, **options):
    # _modules, _draft: random weights instead of a checkpoint (from_random, benchmarks).
    vllm_options = {name: options.pop(name) for name in list(options)
                    if name not in OPTION_NAMES}
    mesh = mesh_from_vllm(options.get("mesh"), vllm_options, list(OPTION_NAMES))
    if mesh is not None:
      options["mesh"] = mesh
    parts = build(model, EngineOptions(**options), random_modules=_modules,
                  random_draft=_draft)
    self.__dict__.update({field.name: getattr(parts, field.name)
                          for field in dataclasses.fields(LLMParts)})
    self._request_counter = 0

  def __repr__(self):
    return (f"LLM({self.model_dir or self.config.architecture!r}, mesh={self.mesh_config}, "
            f"spec={self.spec})")

  @property
  def _runner(self):
    """The device state (jspec.device.DeviceModel); jspec.bench.steps reads its cache layout."""
    return self.device

  @classmethod
  def from_random(cls, config: ModelConfig, mtp_spec: MTPSpec | None = None, *,
                  draft_config=None, **options):
    """Random weights of the given shapes, born sharded on the mesh (benchmarks, tests);
    `options` as `LLM`'s (dtype "auto": bfloat16). `draft_config`: the drafter of a
    "draft_model" (a ModelConfig) or "eagle3" (an Eagle3Config) speculative_config, also
    random."""
    declared = EngineOptions(**options)
    options.update(mesh=declared.mesh or MeshConfig(),
                   dtype="bfloat16" if declared.dtype == "auto" else declared.dtype)
    modules, draft = random_modules(config, mtp_spec, EngineOptions(**options), draft_config)
    return cls(_modules=modules, _draft=draft, **options)

  # ---- requests -------------------------------------------------------------------------

  def _encode(self, prompts) -> list[list[int]]:
    if prompts is None:
      raise ValueError("prompts is None: pass a list of prompts (strings or token-id lists)")
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
        not_ints = [t for t in prompt if not is_int(t)]
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
    if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, (str, bytes)):
      raise ValueError(f"sampling_params must be a SamplingParams or a list of them, one per "
                       f"prompt; got {type(sampling_params).__name__} (write "
                       "jspec.SamplingParams(**your_dict) for a dict)")
    params = list(sampling_params)
    if len(params) != n:
      raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    for p in params:
      if not isinstance(p, SamplingParams):
        raise ValueError(f"expected SamplingParams, got {type(p).__name__}")
    return params

  def _check_lengths(self, prompt_ids, params):
    """Every request fits max_model_len with all its max_tokens, and stops only on ids the
    vocabulary has: a request would otherwise end early without a word of why."""
    vocab = self.config.vocab_size
    for i, (ids, p) in enumerate(zip(prompt_ids, params)):
      if len(ids) + p.max_tokens > self.max_model_len:
        raise ValueError(f"prompt {i} has {len(ids)} tokens and max_tokens={p.max_tokens}: "
                         f"{len(ids) + p.max_tokens} tokens exceed max_model_len="
                         f"{self.max_model_len}; lower max_tokens to at most "
                         f"{self.max_model_len - len(ids)} or raise max_model_len")
      bad = [t for t in p.stop_token_ids or () if t >= vocab]
      if bad:
        raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")

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
    self._check_lengths(prompt_ids, params)
    self.scheduler.check(params)
    if self.tokenizer is None and any(p.stop for p in params):
      raise ValueError(f"stop strings need a tokenizer, and {self.model_dir!r} has no tokenizer "
                       "files; stop on token ids instead (stop_token_ids)")
    seeds = [self._seed_for(p) for p in params]
    decode = None
    if self.tokenizer is not None:  # each token's own text, for Logprob.decoded_token
      decode = lambda ids: self.tokenizer.batch_decode([[i] for i in ids])
    # Wall time counts running only: compiling a new bucket is reported by its own progress line.
    with interrupt.watch():  # a Ctrl-C Python dropped between the call's waits is not lost
      result = self.scheduler.generate(prompt_ids, params, seeds, use_tqdm=use_tqdm,
                                       decode=decode)
    outputs = result.outputs
    eos = set(self.config.eos_token_ids)
    for out, p in zip(outputs, params):
      for completion in out.outputs:
        last = completion.token_ids[-1] if completion.token_ids else None
        # An EOS ends a completion first (vLLM's order): its stop_reason stays None.
        if (completion.finish_reason == "stop" and p.stop_token_ids
            and last in p.stop_token_ids and (p.ignore_eos or last not in eos)):
          completion.stop_reason = last
    if self.tokenizer is not None:
      text = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
      for out, p in zip(outputs, params):
        for completion in out.outputs:
          completion.text = text(completion.token_ids)
          if p.stop:
            apply_stop_strings(completion, p.stop, p.include_stop_str_in_output, text)
    k = draft_positions(self.spec)
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
    return self.scorer.logits(ids)


LLM.__init__.__signature__ = signature_with_options(LLM.__init__, after="model")
