"""Drafters behind one surface (base.py), and the one registry of speculative methods: for
each speculative_config "method", the drafter the loop runs (`make_drafter`: prefill /
propose / extend) and the setup the build runs (`setup_for`: checks before any weight is
read, then the drafter's module; setup.py)."""

from __future__ import annotations

import dataclasses

from jspec.config import SpecConfig
from jspec.speculative.drafters.base import DraftState, Drafter, TargetOut
from jspec.speculative.drafters.draft_model import DraftModelDrafter
from jspec.speculative.drafters.hidden_state import HiddenStateDrafter
from jspec.speculative.drafters.ngram import NgramDrafter
from jspec.speculative.drafters.setup import (DraftModelSetup, DrafterSetup, Eagle3Setup,
                                              MTPSetup)


@dataclasses.dataclass(frozen=True)
class Method:
  """One speculative method: how it drafts, and how its drafter is checked and loaded."""
  drafter: type[Drafter]
  setup: DrafterSetup


# MTP and EAGLE heads differ only in their module (what `target_features` and each layer
# compute), not in how they draft. jspec.config.SPEC_METHODS holds the names SpecConfig
# accepts (the config floor reads no drafter); they are this table's keys (test_options).
METHODS = {
    "mtp": Method(HiddenStateDrafter, MTPSetup()),
    "eagle3": Method(HiddenStateDrafter, Eagle3Setup()),
    "draft_model": Method(DraftModelDrafter, DraftModelSetup()),
    "ngram": Method(NgramDrafter, DrafterSetup()),
}


class _NoDrafter(Drafter):
  """k = 0: vanilla decoding through the same loop."""

  def __init__(self, *args):
    del args

  def propose(self, draft, tokens_BS, lengths_B, choose, live_B=None):
    raise AssertionError("no drafter: the loop does not propose with k = 0")


def make_drafter(method: str | None, target, module, plan, ctx) -> Drafter:
  """The drafter for `method` over `module` (the draft's NNX module, or None)."""
  return (METHODS[method].drafter if method else _NoDrafter)(target, module, plan, ctx)


def setup_for(spec: SpecConfig | None) -> DrafterSetup:
  """The setup of `spec`'s method; plain decoding (no spec) has the default one."""
  return METHODS[spec.method].setup if spec else DrafterSetup()


__all__ = ["METHODS", "DraftState", "Drafter", "Method", "TargetOut", "make_drafter",
           "setup_for"]
