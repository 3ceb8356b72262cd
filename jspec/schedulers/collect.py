"""Finished rows off the device become `RequestOutput`s: completions gathered as dispatches
return them, handed back in prompt order (the continuous scheduler's host side)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec.outputs import (CompletionOutput, RequestMetrics, RequestOutput, aggregate,
                           position_logprobs)
from jspec.loop.queue import QueuePlan


@dataclasses.dataclass
class FinishedCompletion:
  """One finished completion as it comes off the device (host arrays)."""
  group: int
  member: int            # index within its group
  token_ids: list[int]
  finish_reason: str
  num_steps: int
  drafted_at_K: np.ndarray
  accepted_at_K: np.ndarray
  logprobs: tuple | None  # (logprob_T, rank_T, top_ids_TX, top_logprobs_TX) or None
  emitted_at: np.ndarray | None = None  # each token's loop clock value (jspec.timing)


class OutputCollector:
  """Completions gathered as dispatches return them; `outputs()` in prompt order."""

  def __init__(self, plan: QueuePlan, k: int, decode=None):
    self.plan, self.k, self.decode = plan, k, decode
    self.completions: list[dict[int, CompletionOutput]] = [{} for _ in plan.prompts]
    self.num_finished = 0
    self.num_tokens = 0
    self._counts: dict[tuple[int, int], FinishedCompletion] = {}

  def add(self, done: FinishedCompletion):
    group = self.plan.groups[done.group]
    params = self.plan.params[group.request]
    logprobs = cumulative = None
    if params.logprobs is not None and done.logprobs is not None:
      logprob_T, rank_T, top_ids_TX, top_logprobs_TX = done.logprobs
      top = params.logprobs
      logprobs = position_logprobs(done.token_ids, logprob_T, rank_T, top_ids_TX[:, :top],
                                   top_logprobs_TX[:, :top], self.decode)
      cumulative = float(np.sum(np.asarray(logprob_T, np.float64)))
    index = group.first_sample + done.member
    self.completions[group.request][index] = CompletionOutput(
        index=index, token_ids=done.token_ids, text=None, finish_reason=done.finish_reason,
        logprobs=logprobs, cumulative_logprob=cumulative)
    self._counts[group.request, index] = done
    self.num_finished += 1
    self.num_tokens += len(done.token_ids)

  def outputs(self, wall_time_s: float, prompt_logprobs=None, clock=None) -> list[RequestOutput]:
    """In prompt order; `clock` (jspec.timing.Clock) times each completion's tokens, else
    each completion counts the call's wall time."""
    results = []
    for i, prompt in enumerate(self.plan.prompts):
      found = self.completions[i]
      n = self.plan.params[i].n
      assert len(found) == n, f"request {i}: {len(found)} of {n} completions came back"
      completions = [found[j] for j in range(n)]
      for j, c in enumerate(completions):
        done = self._counts[i, j]
        times = (None if clock is None or done.emitted_at is None
                 else clock.seconds(done.emitted_at))
        c.metrics = RequestMetrics.from_counts(
            done.drafted_at_K[:self.k], done.accepted_at_K[:self.k], done.num_steps,
            len(done.token_ids), None if times is not None else wall_time_s,
            token_times_s=times)
      metrics = (completions[0].metrics if n == 1 else
                 aggregate(completions, self.k, max(c.metrics.wall_time_s for c in completions)))
      results.append(RequestOutput(prompt_token_ids=list(prompt), outputs=completions,
                                   metrics=metrics,
                                   prompt_logprobs=None if prompt_logprobs is None
                                   else prompt_logprobs[i]))
    return results
