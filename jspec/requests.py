"""Host side of a generate call: requests become a device queue, finished rows become outputs.

A request asks for `n` completions of one prompt (SamplingParams.n). It enters the queue as
one or more *groups* of at most `group` samples: a group is admitted into that many slots of
one data-parallel shard at once, its prompt is prefilled once, and the prefilled state is
written to every slot of the group (jspec.speculative.batching). Sample 0 draws with the
request's own seed, so its tokens are those n = 1 gives; sample i > 0 with a seed derived
from (seed, i).

Queue order is longest `max_tokens` first (stable, so prompt order among equals): a long
request admitted last would leave the other slots idle while it finishes alone; starting
the long ones first lets the short ones fill in around them (longest-processing-time
scheduling). Outputs come back in prompt order whatever the queue order.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec.config import SamplingParams
from jspec.outputs import (CompletionOutput, RequestMetrics, RequestOutput, aggregate,
                           position_logprobs)
from jspec.speculative import buckets


MIN_QUEUE_GROUPS = 64
MIN_QUEUE_TOKENS = 4096


def sample_seed(seed: int, sample: int) -> int:
  """The uint32 seed of completion `sample` of a request seeded `seed` (sample 0: the seed)."""
  if sample == 0:
    return seed % 2**32
  return int(np.random.SeedSequence((seed % 2**32, sample)).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class Group:
  request: int       # index of the prompt in the call
  first_sample: int  # samples first_sample .. first_sample + size - 1 of that request
  size: int


@dataclasses.dataclass
class QueuePlan:
  """What the call puts on device, in queue order, and the static sizes it implies."""
  groups: list[Group]
  prompts: list[list[int]]
  params: list[SamplingParams]
  seeds: list[int]
  group: int              # samples per group at most (static)
  num_sequences: int      # completions over all requests

  @property
  def num_logprobs(self) -> int | None:
    """Alternatives per generated position (the most any request asks), None: not computed."""
    asked = [p.logprobs for p in self.params if p.logprobs is not None]
    return max(asked) if asked else None


def plan_queue(prompts, params, seeds, rows_per_shard: int) -> QueuePlan:
  """Groups in queue order: each request's n samples split into groups of at most
  min(the largest n, rows_per_shard), rounded down to a power of two (static)."""
  largest = max(p.n for p in params)
  group = min(buckets.next_pow2(largest), rows_per_shard)
  if group & (group - 1):
    group = 1 << (group.bit_length() - 1)
  order = sorted(range(len(prompts)), key=lambda i: -params[i].max_tokens)
  groups = []
  for i in order:
    for first in range(0, params[i].n, group):
      groups.append(Group(i, first, min(group, params[i].n - first)))
  return QueuePlan(groups, prompts, params, seeds, group,
                   num_sequences=sum(p.n for p in params))


def queue_arrays(plan: QueuePlan, eos_ids, max_model_len: int) -> dict[str, np.ndarray]:
  """The queue's numpy arrays, padded to power-of-two buckets: Q groups, N prompt tokens,
  X stop ids, M samples per group. Padding groups have size 0 and are never admitted."""
  groups, params = plan.groups, plan.params
  # Generous smallest buckets: calls of a few requests share one compiled program.
  num_q = max(MIN_QUEUE_GROUPS, buckets.next_pow2(len(groups)))
  stop_sets = [list(dict.fromkeys((() if p.ignore_eos else tuple(eos_ids))
                                  + tuple(p.stop_token_ids or ()))) for p in params]
  width = max(4, buckets.next_pow2(max(len(s) for s in stop_sets) or 1))
  lengths = [len(plan.prompts[g.request]) for g in groups]
  num_tokens = max(MIN_QUEUE_TOKENS, buckets.next_pow2(sum(lengths)))
  arrays = dict(
      prompt_tokens_N=np.zeros((num_tokens,), np.int32),
      prompt_start_Q=np.zeros((num_q,), np.int32),
      prompt_len_Q=np.ones((num_q,), np.int32),
      size_Q=np.zeros((num_q,), np.int32),
      temperature_Q=np.zeros((num_q,), np.float32),
      top_k_Q=np.zeros((num_q,), np.int32),
      top_p_Q=np.ones((num_q,), np.float32),
      max_len_Q=np.zeros((num_q,), np.int32),
      stop_ids_QX=np.full((num_q, width), -1, np.int32),
      seeds_QM=np.zeros((num_q, plan.group), np.uint32))
  start = 0
  for q, g in enumerate(groups):
    prompt, p = plan.prompts[g.request], params[g.request]
    arrays["prompt_tokens_N"][start:start + len(prompt)] = prompt
    arrays["prompt_start_Q"][q], arrays["prompt_len_Q"][q] = start, len(prompt)
    start += len(prompt)
    arrays["size_Q"][q] = g.size
    arrays["temperature_Q"][q], arrays["top_k_Q"][q] = p.temperature, p.top_k
    arrays["top_p_Q"][q] = p.top_p
    arrays["max_len_Q"][q] = min(len(prompt) + p.max_tokens, max_model_len)
    stops = stop_sets[g.request]
    arrays["stop_ids_QX"][q, :len(stops)] = stops
    for j in range(g.size):
      arrays["seeds_QM"][q, j] = sample_seed(plan.seeds[g.request], g.first_sample + j)
  return arrays


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
