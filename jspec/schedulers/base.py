"""What every scheduler offers the LLM, and the plan pieces both build the same way.

A scheduler turns a call's encoded requests into outputs: `generate(prompt_ids, params, seeds,
use_tqdm, decode) -> RunResult`, outputs in prompt order. It runs its programs over a
`DeviceModel` (jspec.device) and refuses, in `check`, sampling settings it cannot serve.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from flax import nnx

from jspec.config import SamplingParams, SpecConfig
from jspec.models.params import merge_module
from jspec.models.projections import with_loop_constants
from jspec.outputs import RequestOutput
from jspec.shapes import buckets
from jspec.loop.step import LoopPlan
from jspec.speculative.drafters import make_drafter


def program_models(device, target_state, draft_state, plan: LoopPlan, in_loop: bool):
  """(target, drafter) at the top of a program: the modules merged from their states, with
  the FP8 kernel scales prepared once, outside the loop of steps, where `in_loop`; the drafter
  built once for the whole program and handed down to every function that drafts."""
  target = nnx.merge(device.target_graphdef, target_state)
  draft = merge_module(device.draft_graphdef, draft_state)
  if in_loop:
    target, draft = with_loop_constants(target), with_loop_constants(draft)
  return target, make_drafter(plan.method, target, draft, plan, device.ctx)


@dataclasses.dataclass
class DispatchTiming:
  """One dispatch as the launching thread saw it. On a GPU a launch returns when its while
  loop has ended (the host reads the loop condition back), so `seconds` is the dispatch's
  device time plus the launch; on a CPU a launch returns at once."""
  start_s: float       # when the launch began, from the call's start
  seconds: float       # until the dispatch had ended (the launch, and on a CPU the wait)
  iterations: int = 0  # decode steps (rounds) it ran
  clock: int = 0       # the loop's clock when it ended (jspec.timing)


@dataclasses.dataclass
class RunResult:
  outputs: list[RequestOutput]
  wall_time_s: float     # running only: compiling a new bucket is reported on its own
  host_seconds_per_dispatch: float = 0.0  # host work per dispatch (overlapped with the next)
  dispatches: list[DispatchTiming] = dataclasses.field(default_factory=list)


class Scheduler(Protocol):

  def check(self, params: list[SamplingParams]) -> None:
    """Refuses, before anything runs, the settings this scheduler cannot serve."""

  def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams],
               seeds: list[int], use_tqdm=True, decode=None) -> RunResult:
    """Outputs in prompt order, and the seconds spent running (compilation excluded).
    `decode(ids) -> texts`: each token's own text (Logprob.decoded_token), or None."""


def num_drafts(spec: SpecConfig | None) -> int:
  """k: drafts per step, 0 without speculation."""
  return spec.num_speculative_tokens if spec else 0


def draft_positions(spec: SpecConfig | None) -> int:
  """How many draft positions the acceptance metrics report: k for a chain, the depth for a
  token tree (its nodes are counted by depth: drafted and accepted at depth 1, 2, ...)."""
  tree = spec.token_tree if spec else None
  return tree.depth if tree is not None else num_drafts(spec)


def cache_len_for(prompts, params, k: int, max_model_len: int) -> int:
  """The cache bucket of a batch: its longest prompt + max_tokens, capped, with k+1 slack."""
  max_total = max(min(len(p) + sp.max_tokens, max_model_len) for p, sp in zip(prompts, params))
  return buckets.cache_bucket(max_total, k, max_model_len)


def loop_plan(spec: SpecConfig | None, params: list[SamplingParams], *, batch: int,
              cache_len: int, prefill_chunk: int, num_logprobs: int | None = None) -> LoopPlan:
  """The static plan of a program serving `params`: the sampling paths they need (argmax only
  when all are greedy; sorting only when one filters by top-k or top-p)."""
  all_greedy = all(sp.temperature == 0 for sp in params)
  tree = spec.token_tree if spec else None
  return LoopPlan(batch=batch, cache_len=cache_len, method=spec.method if spec else None,
                  k=num_drafts(spec), all_greedy=all_greedy, tree=tree,
                  any_filtered=any(sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1)
                                   for sp in params),
                  ngram_min=spec.prompt_lookup_min if spec else 1,
                  ngram_max=spec.prompt_lookup_max if spec else 1,
                  prefill_chunk=prefill_chunk, num_logprobs=num_logprobs)
