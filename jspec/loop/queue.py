"""The request queue of a continuous-batching call: its host half (numpy arrays in queue order)
and its device half (the `Queue` the jitted loop admits from).

A request asks for `n` completions of one prompt (SamplingParams.n). It enters the queue as
one or more *groups* of at most `group` samples: a group is admitted into that many slots of
one data-parallel shard at once, its prompt is prefilled once, and the prefilled state is
written to every slot of the group (jspec.loop.rounds.admit). Sample 0 draws with the
request's own seed, so its tokens are those n = 1 gives; sample i > 0 with a seed derived
from (seed, i).

Queue order is longest `max_tokens` first (stable, so prompt order among equals): a long
request admitted last would leave the other slots idle while it finishes alone; starting
the long ones first lets the short ones fill in around them (longest-processing-time
scheduling). Outputs come back in prompt order whatever the queue order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.config import SamplingParams
from jspec.shapes import buckets

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


@struct.dataclass
class Queue:
  """The waiting requests, in admission order (`queue_arrays` on device)."""
  prompt_tokens_N: jax.Array
  prompt_start_Q: jax.Array
  prompt_len_Q: jax.Array
  size_Q: jax.Array          # samples in the group; 0 for padding
  temperature_Q: jax.Array
  top_k_Q: jax.Array
  top_p_Q: jax.Array
  max_len_Q: jax.Array
  stop_ids_QX: jax.Array
  seeds_QM: jax.Array        # uint32 seed of each sample of the group

  @property
  def num_groups(self):
    return jnp.sum(self.size_Q > 0).astype(jnp.int32)
