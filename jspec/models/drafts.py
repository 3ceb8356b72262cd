"""Checks and random weights for drafters loaded apart from the target: a draft model (any
supported family with the target's vocabulary) and an EAGLE-3 head (jspec.models.eagle3)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jspec.config import ModelConfig
from jspec.models import caches as cache_lib
from jspec.models.eagle3 import Eagle3Config, Eagle3Head
from jspec.models.registry import family_of
from jspec.sharding.plan import sharded_configs


def check_draft_vocabulary(target_cfg: ModelConfig, draft_cfg: ModelConfig, target_tokenizer,
                           draft_tokenizer, target_dir, draft_dir):
  """A draft model proposes target token ids: the same vocabulary, and where both
  checkpoints ship a tokenizer, the same token -> id map."""
  if draft_cfg.vocab_size != target_cfg.vocab_size:
    raise ValueError(f"the draft model's vocab_size {draft_cfg.vocab_size} ({draft_dir}) differs "
                     f"from the target's {target_cfg.vocab_size} ({target_dir}): a draft model "
                     "must share the target's vocabulary")
  if target_tokenizer is None or draft_tokenizer is None:
    return
  target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
  if target_vocab != draft_vocab:
    differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))[:3]
    raise ValueError(f"the draft model's tokenizer ({len(draft_vocab)} tokens, {draft_dir}) "
                     f"differs from the target's ({len(target_vocab)} tokens, {target_dir}), "
                     f"e.g. {differing}: a draft model must share the target's tokenizer")


def check_draft_caches(draft_cfg: ModelConfig):
  """A draft model's rejected drafts are dropped by rolling its caches back by length, which
  recurrent (linear-attention) layers cannot do."""
  module = nnx.eval_shape(lambda: family_of(draft_cfg).model(draft_cfg, np.float32,
                                                             nnx.Rngs(0)))
  shapes = jax.eval_shape(lambda: module.init_caches(1, 1, np.float32))
  kinds = {type(c).__name__ for c in shapes}
  if not kinds <= {cache_lib.KVCache.__name__, cache_lib.MLACache.__name__}:
    raise ValueError(f"a {draft_cfg.architecture} draft model keeps {sorted(kinds)} caches; "
                     "draft models must keep caches that roll back by length (attention KV or "
                     "MLA latent), not recurrent state")


def init_random_drafter(draft_config, target_cfg: ModelConfig, dtype, mesh, draft_rules,
                        seed: int):
  """Random weights for a benchmark drafter: a draft model (ModelConfig) or an EAGLE-3 head
  (Eagle3Config, its draft vocabulary mapped onto the first target ids)."""
  from jspec.models.loading import init_random, init_random_module
  if isinstance(draft_config, Eagle3Config):
    layer = sharded_configs(draft_config.layer, mesh, draft_rules, draft_rules)[0]
    ecfg = dataclasses.replace(draft_config, layer=layer)
    head = init_random_module(lambda: Eagle3Head(ecfg, dtype, nnx.Rngs(seed)), mesh,
                              draft_rules, seed, stream=2)
    head.set_target_ids(np.arange(ecfg.draft_vocab_size, dtype=np.int32),
                        draft_rules.sharding(mesh, (None,)))
    return head
  draft, _ = init_random(draft_config, None, dtype, mesh, draft_rules, draft_rules, seed + 1)
  return draft
