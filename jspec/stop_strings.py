"""Stop strings (vLLM's `SamplingParams.stop`): a completion ends where its text first holds one.

Applied on the host to each finished completion: the loop generates until a stop token id,
EOS or max_tokens as before, and the completion is then cut after the first token whose text
completes a stop string (vLLM's rule: that token is kept in `token_ids`); the text ends before
the stop string (or after it, with `include_stop_str_in_output`). The tokens generated past it
cost their steps; its metrics count them (they describe the work the loop did).
"""

from __future__ import annotations

from jspec.outputs import CompletionOutput


def first_stop(text: str, stops) -> tuple[int, str] | None:
  """(index, stop string) of the stop string that begins first in `text`, or None."""
  hits = [(text.find(stop), stop) for stop in stops if stop in text]
  return min(hits) if hits else None


def apply_stop_strings(completion: CompletionOutput, stops, include: bool, decode) -> None:
  """Cuts `completion` (token_ids, text, logprobs) at its first stop string, in place;
  `decode`: token ids -> text, as the completion's text was decoded."""
  hit = None if completion.text is None else first_stop(completion.text, stops)
  if hit is None:
    return
  index, stop = hit
  ids = completion.token_ids
  # The fewest tokens whose text holds the stop string (holding it is monotone in the count).
  low, high = 1, len(ids)
  while low < high:
    middle = (low + high) // 2
    if stop in decode(ids[:middle]):
      high = middle
    else:
      low = middle + 1
  completion.token_ids = ids[:low]
  completion.text = completion.text[:index + (len(stop) if include else 0)]
  completion.finish_reason = "stop"
  completion.stop_reason = stop
  if completion.logprobs is not None:
    completion.logprobs = completion.logprobs[:low]
    completion.cumulative_logprob = sum(position[token].logprob for position, token
                                        in zip(completion.logprobs, completion.token_ids))
