"""What `LLM.generate` returns: vLLM-shaped request outputs with speculative metrics.

A `RequestOutput` holds `n` `CompletionOutput`s (SamplingParams.n); its `token_ids`, `text`,
`finish_reason`, `logprobs` and `cumulative_logprob` are the first completion's, as before `n`.

Token accounting: prefill emits each completion's first token; every verify step then emits
1 .. k+1 tokens (the accepted drafts plus the target's own token), so for each completion
    len(token_ids) == 1 + num_accepted_tokens + num_steps.

Log-probabilities are vLLM's: per position a dict {token_id: Logprob(logprob, rank,
decoded_token)} holding the chosen token (first) and the top-N alternatives, ranks from 1
(the most likely token); a prompt's first position has none (None in `prompt_logprobs`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec import timing


@dataclasses.dataclass
class RequestMetrics:
  """A completion's (or, pooled, a request's or a call's) speculative counts and timing.

  Times count from the start of the `generate` call that ran it (compilation excluded), when
  every request of the call arrived; token times come from the loop's clock (jspec.timing).
  For one completion `wall_time_s` is the time of its last token and `tokens_per_second` its
  own rate over that time; pooled over a call they are the call's wall time and rate, TTFT and
  TPOT the medians over completions and ITL percentiles over all their chunk gaps."""
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
  ttft_s: float | None = None                # time to first token
  tpot_s: float | None = None                # mean time per token after the first
  itl_p50_s: float | None = None             # inter-token latency between chunks: median
  itl_p99_s: float | None = None             # and 99th percentile
  token_times_s: list[float] | None = None   # one completion: when each token was available

  @classmethod
  def from_counts(cls, drafted_at_K, accepted_at_K, num_steps, num_generated, wall_time_s,
                  latency=None, token_times_s=None):
    """`latency`: a jspec.timing.Latency; `token_times_s`: one completion's token times
    (its latency and, unless given, its wall time follow from them)."""
    if token_times_s is not None:
      token_times_s = [float(t) for t in token_times_s]
      latency = latency or timing.latency(token_times_s)
      if wall_time_s is None:
        wall_time_s = token_times_s[-1] if token_times_s else 0.0
    drafted_at_K = np.asarray(drafted_at_K)
    accepted_at_K = np.asarray(accepted_at_K)
    rates = [float(a / d) if d else 0.0 for a, d in zip(accepted_at_K, drafted_at_K)]
    num_accepted = int(accepted_at_K.sum())
    lat = latency or timing.Latency(None, None, None, None)
    return cls(num_draft_tokens=int(drafted_at_K.sum()), num_accepted_tokens=num_accepted,
               acceptance_rate_per_position=rates,
               mean_acceptance_length=float((num_accepted + num_steps) / num_steps)
               if num_steps else 0.0,
               num_steps=int(num_steps), num_generated_tokens=int(num_generated),
               wall_time_s=float(wall_time_s),
               tokens_per_second=float(num_generated / wall_time_s) if wall_time_s > 0 else 0.0,
               num_drafts_per_position=[int(x) for x in drafted_at_K],
               num_accepted_per_position=[int(x) for x in accepted_at_K],
               ttft_s=lat.ttft_s, tpot_s=lat.tpot_s, itl_p50_s=lat.itl_p50_s,
               itl_p99_s=lat.itl_p99_s, token_times_s=token_times_s)

  def summary(self) -> str:
    rates = " ".join(f"{r:.2f}" for r in self.acceptance_rate_per_position)
    ms = lambda x: "-" if x is None else f"{1e3 * x:.1f}"
    return (f"{self.num_generated_tokens} tokens in {self.wall_time_s:.2f} s "
            f"({self.tokens_per_second:.1f} tok/s), {self.num_steps} steps, "
            f"mean acceptance length {self.mean_acceptance_length:.2f}"
            + (f", acceptance per position [{rates}]" if rates else "")
            + (f", TTFT {ms(self.ttft_s)} ms, TPOT {ms(self.tpot_s)} ms, ITL p50 "
               f"{ms(self.itl_p50_s)} / p99 {ms(self.itl_p99_s)} ms"
               if self.ttft_s is not None else ""))


@dataclasses.dataclass
class Logprob:
  """A token's log-probability under the target (its raw log-softmax, before temperature,
  top-k and top-p: vLLM's default), its rank in the vocabulary (1: the most likely; ties share
  the worse rank, as vLLM counts them) and its text where the model has a tokenizer."""
  logprob: float
  rank: int | None = None
  decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
  index: int                 # which of the request's n completions
  token_ids: list[int]
  text: str | None
  finish_reason: str         # 'stop' (EOS or a stop id, included in token_ids) or 'length'
  logprobs: list[PositionLogprobs] | None = None  # one dict per token; None unless asked
  cumulative_logprob: float | None = None         # the sum over token_ids; None unless asked
  metrics: RequestMetrics | None = None
  # What ended it, as vLLM says: the stop string (SamplingParams.stop) or the stop token id
  # (SamplingParams.stop_token_ids); None where EOS or max_tokens did.
  stop_reason: str | int | None = None


@dataclasses.dataclass
class RequestOutput:
  prompt_token_ids: list[int]
  outputs: list[CompletionOutput]
  metrics: RequestMetrics    # pooled over the n completions
  prompt_logprobs: list[PositionLogprobs | None] | None = None

  # The first completion's, so that code written for one completion per prompt keeps working.
  @property
  def token_ids(self) -> list[int]:
    return self.outputs[0].token_ids

  @property
  def text(self) -> str | None:
    return self.outputs[0].text

  @property
  def finish_reason(self) -> str:
    return self.outputs[0].finish_reason

  @property
  def stop_reason(self) -> str | int | None:
    return self.outputs[0].stop_reason

  @property
  def logprobs(self) -> list[PositionLogprobs] | None:
    return self.outputs[0].logprobs

  @property
  def cumulative_logprob(self) -> float | None:
    return self.outputs[0].cumulative_logprob


class GenerateOutputs(list):
  """A list of RequestOutput, in prompt order, with the aggregate `metrics` of the call and,
  under continuous batching, how many device dispatches and loop iterations it took, the
  host's work per dispatch (seconds, overlapped with the next dispatch's device work) and each
  dispatch's timing (jspec.schedulers.base.DispatchTiming)."""

  def __init__(self, outputs, metrics: RequestMetrics, host_seconds_per_dispatch: float = 0.0,
               dispatches: list | None = None):
    super().__init__(outputs)
    self.metrics = metrics
    self.host_seconds_per_dispatch = host_seconds_per_dispatch
    self.dispatches = dispatches or []

  @property
  def num_dispatches(self) -> int:
    return len(self.dispatches)

  @property
  def num_iterations(self) -> int:
    return sum(d.iterations for d in self.dispatches)


def aggregate(outputs, k: int, wall_time_s: float) -> RequestMetrics:
  """Totals over requests or completions (anything with `.metrics`); rates are pooled counts
  (not a mean of per-request rates), latency pooled over the completions' token times."""
  drafted = np.zeros(k, np.int64)
  accepted = np.zeros(k, np.int64)
  for out in outputs:
    drafted += np.asarray(out.metrics.num_drafts_per_position, np.int64)
    accepted += np.asarray(out.metrics.num_accepted_per_position, np.int64)
  steps = sum(out.metrics.num_steps for out in outputs)
  generated = sum(out.metrics.num_generated_tokens for out in outputs)
  times = [t for t in _token_times(outputs) if t is not None]
  return RequestMetrics.from_counts(drafted, accepted, steps, generated, wall_time_s,
                                    latency=timing.pooled_latency(times) if times else None)


def _token_times(outputs):
  for out in outputs:
    completions = getattr(out, "outputs", None)
    if completions is None:
      yield out.metrics.token_times_s
    else:
      for c in completions:
        yield c.metrics.token_times_s if c.metrics is not None else None


def position_logprobs(chosen_T, logprob_T, rank_T, top_ids_TX, top_logprobs_TX,
                      decode=None) -> list[PositionLogprobs]:
  """vLLM's per-position dicts from host arrays: the chosen token first, then the top
  alternatives in rank order (a chosen token among them appears once). `decode(ids)` -> the
  texts of single tokens, or None for no text."""
  chosen_T, rank_T = np.asarray(chosen_T).tolist(), np.asarray(rank_T).tolist()
  logprob_T = np.asarray(logprob_T, np.float64).tolist()
  top_ids_TX = np.asarray(top_ids_TX).tolist()
  top_logprobs_TX = np.asarray(top_logprobs_TX, np.float64).tolist()
  texts = {}
  if decode is not None:
    ids = sorted(set(chosen_T).union(*map(set, top_ids_TX)) if chosen_T else ())
    texts = dict(zip(ids, decode(ids)))
  result = []
  for t, token in enumerate(chosen_T):
    entry = {token: Logprob(logprob_T[t], rank_T[t], texts.get(token))}
    for r, (alt, value) in enumerate(zip(top_ids_TX[t], top_logprobs_TX[t]), start=1):
      if alt not in entry:
        entry[alt] = Logprob(value, r, texts.get(alt))
    result.append(entry)
  return result
