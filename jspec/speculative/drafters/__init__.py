"""Drafters behind one surface (base.py): the loop builds one with `make_drafter` and calls
only prefill / propose / extend."""

from __future__ import annotations

from jspec.speculative.drafters.base import DraftState, Drafter, TargetOut
from jspec.speculative.drafters.draft_model import DraftModelDrafter
from jspec.speculative.drafters.hidden_state import HiddenStateDrafter
from jspec.speculative.drafters.ngram import NgramDrafter

# speculative_config "method" -> the drafter that runs it. MTP and EAGLE heads differ only in
# their module (what `target_features` and each layer compute), not in how they draft.
DRAFTERS = {
    "mtp": HiddenStateDrafter,
    "eagle3": HiddenStateDrafter,
    "draft_model": DraftModelDrafter,
    "ngram": NgramDrafter,
}


class _NoDrafter(Drafter):
  """k = 0: vanilla decoding through the same loop."""

  def __init__(self, *args):
    del args

  def propose(self, draft, tokens_BS, lengths_B, choose):
    raise AssertionError("no drafter: the loop does not propose with k = 0")


def make_drafter(method: str | None, target, module, plan, ctx) -> Drafter:
  """The drafter for `method` over `module` (the draft's NNX module, or None)."""
  return (DRAFTERS[method] if method else _NoDrafter)(target, module, plan, ctx)


__all__ = ["DRAFTERS", "DraftState", "Drafter", "TargetOut", "make_drafter"]
