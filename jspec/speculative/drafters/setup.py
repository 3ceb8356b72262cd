"""Each speculative method's checks and loading, beside its drafter.

The build (jspec.build) asks a method's `DrafterSetup` two things and never names a method:
`check`, before any weight of the target is read, refuses a drafter that cannot work with the
target (so a wrong draft directory costs no loading); `module`, once the target is on the
mesh, returns the NNX module the drafter runs (an MTP head, an EAGLE-3 head, a draft model)
or None (n-gram lookup, plain decoding).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jspec.config import ModelConfig, SpecConfig
from jspec.models.hf_config import config_from_dir
from jspec.models.drafts import check_draft_caches, check_draft_vocabulary
from jspec.models.loading import load_checkpoint, load_eagle3
from jspec.models.moe_backends import expert_tile
from jspec.progress import stage
from jspec.sharding.plan import validate_mesh
from jspec.sharding.rules import MeshConfig, axis_size, global_array
from jspec.tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class TargetContext:
  """What a method's setup may read of the target being built."""
  config: ModelConfig
  model_dir: str | None      # None: random weights (LLM.from_random)
  tokenizer: object | None
  mesh_config: MeshConfig
  mesh: object
  draft_rules: object        # the drafter's sharding rules (jspec.sharding.rules)
  dtype: object
  moe_backend: str


class DrafterSetup:
  """Defaults (n-gram lookup, plain decoding): nothing to check, no module to run."""

  def check(self, spec: SpecConfig, target: TargetContext) -> None:
    """Refuses a drafter that cannot draft for this target, before any weight is read."""

  def module(self, spec: SpecConfig | None, target: TargetContext, target_module, mtp,
             random_draft=None):
    """The module the drafter runs, on the draft's sharding rules, or None.
    `random_draft`: a module LLM.from_random built instead of loading one."""
    return None


class MTPSetup(DrafterSetup):
  """The target checkpoint's own MTP head, restricted to `draft_vocab` where asked."""

  def module(self, spec, target, target_module, mtp, random_draft=None):
    if mtp is None:
      raise ValueError("speculative method 'mtp' needs MTP weights, and this checkpoint has "
                       "none; use {'method': 'ngram', ...} or a checkpoint with an MTP head")
    if spec.draft_vocab is not None:
      restrict_draft_vocab(mtp, target_module, spec.draft_vocab, target)
    return mtp


def restrict_draft_vocab(mtp, target_module, ids, target: TargetContext):
  """The MTP head drafts over the token ids `ids` only (a slice of the target's lm_head)."""
  vocab = target.config.vocab_size
  if max(ids) >= vocab:
    raise ValueError(f"draft_vocab has token id {max(ids)} outside the vocabulary [0, {vocab})")
  # The head's [D, N] slice is split over the vocab shards: repeat the last id up to a
  # multiple of them (its copies hold equal logits, so drafts are unchanged).
  rules, mesh = target.draft_rules, target.mesh
  ids = tuple(ids) + (ids[-1],) * (-len(ids) % axis_size(mesh, rules.vocab))
  ids_N = global_array(np.asarray(ids, np.int32), rules.sharding(mesh, (None,)))
  head_sharding = rules.sharding(mesh, ("embed", "vocab"))
  for layer in mtp.layers:
    layer.restrict_vocab(target_module, ids_N, head_sharding)


class Eagle3Setup(DrafterSetup):
  """An EAGLE-3 head from its own directory; its config is checked against the target's
  while loading (jspec.models.eagle3)."""

  def check(self, spec, target):
    if not os.path.isdir(spec.model):
      raise FileNotFoundError(f"EAGLE-3 head directory {spec.model!r} does not exist")

  def module(self, spec, target, target_module, mtp, random_draft=None):
    if random_draft is not None:
      return random_draft
    with stage(f"loading EAGLE-3 head {spec.model}"):
      return load_eagle3(spec.model, target.config, target.dtype, target.mesh,
                         target.draft_rules)


class DraftModelSetup(DrafterSetup):
  """A smaller model of the target's vocabulary from its own directory. It must share the
  target's vocabulary and tokenizer and keep caches that roll back by length."""

  def check(self, spec, target):
    draft_cfg = self._config(spec, target)
    check_draft_vocabulary(target.config, draft_cfg, target.tokenizer,
                           load_tokenizer(spec.model), target.model_dir, spec.model)
    check_draft_caches(draft_cfg)
    mesh = target.mesh_config
    validate_mesh(draft_cfg, mesh if spec.draft_tp != 1
                  else dataclasses.replace(mesh, tp=1, num_devices=None))

  def module(self, spec, target, target_module, mtp, random_draft=None):
    if random_draft is not None:
      return random_draft
    draft_cfg = self._config(spec, target)
    with stage(f"loading draft model {spec.model}"):
      draft, _, _ = load_checkpoint(spec.model, draft_cfg, target.dtype, target.mesh,
                                    target.draft_rules, target.draft_rules, load_mtp=False)
    return draft

  @staticmethod
  def _config(spec, target) -> ModelConfig:
    if not os.path.isdir(spec.model):
      raise FileNotFoundError(f"draft model directory {spec.model!r} does not exist")
    return dataclasses.replace(config_from_dir(spec.model),
                               expert_tile=expert_tile(target.moe_backend))
