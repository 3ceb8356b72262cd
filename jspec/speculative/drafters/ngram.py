"""Prompt lookup as a drafter: no model, no state (jspec.speculative.ngram has the matching)."""

from __future__ import annotations

from jspec.speculative.drafters.base import DraftState, Drafter
from jspec.speculative.ngram import ngram_propose


class NgramDrafter(Drafter):

  def __init__(self, target, module, plan, ctx):
    del target, module, ctx
    self.plan = plan

  def propose(self, draft: DraftState, tokens_BS, lengths_B, choose, live_B=None):
    """Deterministic drafts: their distribution is a point mass, given as None."""
    del choose, live_B
    plan = self.plan
    drafts_BK, draft_len_B = ngram_propose(tokens_BS, lengths_B, plan.k, plan.ngram_min,
                                           plan.ngram_max)
    return drafts_BK, draft_len_B, None, draft
