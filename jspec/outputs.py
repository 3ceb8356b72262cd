"""What `LLM.generate` returns: vLLM-shaped request outputs with speculative metrics.

Token accounting: prefill emits each request's first token; every verify step then emits
1 .. k+1 tokens (the accepted drafts plus the target's own token), so
    len(token_ids) == 1 + num_accepted_tokens + num_steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class RequestMetrics:
  num_draft_tokens: int
  num_accepted_tokens: int
  acceptance_rate_per_position: list[float]  # positions 1..k: accepted / proposed there
  mean_acceptance_length: float              # tokens emitted per verify step, bonus included
  num_steps: int
  num_generated_tokens: int
  wall_time_s: float
  tokens_per_second: float
  num_drafts_per_position: list[int]         # the counts behind the rates
  num_accepted_per_position: list[int]

  @classmethod
  def from_counts(cls, drafted_at_K, accepted_at_K, num_steps, num_generated, wall_time_s):
    drafted_at_K = np.asarray(drafted_at_K)
    accepted_at_K = np.asarray(accepted_at_K)
    rates = [float(a / d) if d else 0.0 for a, d in zip(accepted_at_K, drafted_at_K)]
    num_accepted = int(accepted_at_K.sum())
    return cls(num_draft_tokens=int(drafted_at_K.sum()), num_accepted_tokens=num_accepted,
               acceptance_rate_per_position=rates,
               mean_acceptance_length=float((num_accepted + num_steps) / num_steps)
               if num_steps else 0.0,
               num_steps=int(num_steps), num_generated_tokens=int(num_generated),
               wall_time_s=float(wall_time_s),
               tokens_per_second=float(num_generated / wall_time_s) if wall_time_s > 0 else 0.0,
               num_drafts_per_position=[int(x) for x in drafted_at_K],
               num_accepted_per_position=[int(x) for x in accepted_at_K])

  def summary(self) -> str:
    rates = " ".join(f"{r:.2f}" for r in self.acceptance_rate_per_position)
    return (f"{self.num_generated_tokens} tokens in {self.wall_time_s:.2f} s "
            f"({self.tokens_per_second:.1f} tok/s), {self.num_steps} steps, "
            f"mean acceptance length {self.mean_acceptance_length:.2f}"
            + (f", acceptance per position [{rates}]" if rates else ""))


@dataclasses.dataclass
class RequestOutput:
  prompt_token_ids: list[int]
  token_ids: list[int]
  text: str | None
  finish_reason: str  # 'stop' (EOS or a stop id, included in token_ids) or 'length'
  metrics: RequestMetrics


class GenerateOutputs(list):
  """A list of RequestOutput, in prompt order, with the aggregate `metrics` of the call."""

  def __init__(self, outputs, metrics: RequestMetrics):
    super().__init__(outputs)
    self.metrics = metrics


def aggregate(outputs: list[RequestOutput], k: int, wall_time_s: float) -> RequestMetrics:
  """Totals over requests; rates are pooled counts (not a mean of per-request rates)."""
  drafted = np.zeros(k, np.int64)
  accepted = np.zeros(k, np.int64)
  for out in outputs:
    drafted += np.asarray(out.metrics.num_drafts_per_position, np.int64)
    accepted += np.asarray(out.metrics.num_accepted_per_position, np.int64)
  steps = sum(out.metrics.num_steps for out in outputs)
  generated = sum(out.metrics.num_generated_tokens for out in outputs)
  return RequestMetrics.from_counts(drafted, accepted, steps, generated, wall_time_s)
