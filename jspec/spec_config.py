"""Speculative decoding settings: vLLM's `speculative_config` dict, checked once
(re-exported by jspec.config, where the other records live)."""

from __future__ import annotations

import dataclasses
import functools

from jspec.token_tree import TokenTree


SPEC_METHODS = ("mtp", "ngram", "draft_model", "eagle3")
SEPARATE_DRAFT_METHODS = ("draft_model", "eagle3")
TREE_METHODS = ("mtp", "draft_model", "eagle3")  # drafters with logits at every tree node
# Drafts per step at most: vLLM's MTP / EAGLE recipes use 1-7, n-gram lookup up to ~10.
MAX_SPECULATIVE_TOKENS = 16  # drafters loaded from their own directory


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Speculative decoding settings; vLLM's `speculative_config` dict maps onto it."""
  method: str
  num_speculative_tokens: int
  prompt_lookup_min: int = 1
  prompt_lookup_max: int = 3
  draft_tp: int | None = None  # 1 = replicate the draft over tp; None = shard like the target.
  # MTP only: token ids the head may draft (a reduced draft vocabulary; outputs are unchanged).
  draft_vocab: tuple[int, ...] | None = None
  # draft_model / eagle3: the drafter's local Hugging Face directory.
  model: str | None = None
  # A static token tree to verify instead of a chain, in vLLM's spelling: a list of paths of
  # child ranks ("[(0,), (1,), (0, 0)]" or the list itself; jspec.token_tree). Its nodes (the
  # root excluded) must number num_speculative_tokens.
  speculative_token_tree: str | tuple | list | None = None

  def __post_init__(self):
    if self.method not in SPEC_METHODS:
      raise ValueError(f"speculative method {self.method!r} is not supported; "
                       f"choose one of {SPEC_METHODS}")
    k = self.num_speculative_tokens
    if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
      raise ValueError(f"num_speculative_tokens={k!r} must be an integer in [1, "
                       f"{MAX_SPECULATIVE_TOKENS}]: each draft token adds a verify row to every "
                       "step and a compiled shape, and acceptance falls with each one")
    if self.method in SEPARATE_DRAFT_METHODS and not self.model:
      raise ValueError(f"speculative method {self.method!r} needs 'model': the drafter's "
                       "checkpoint directory")
    if self.method not in SEPARATE_DRAFT_METHODS and self.model is not None:
      raise ValueError(f"speculative method {self.method!r} takes no 'model' (it drafts from "
                       f"the target's own checkpoint); 'model' is for {SEPARATE_DRAFT_METHODS}")
    if self.draft_vocab is not None:
      if self.method != "mtp":
        raise ValueError(f"draft_vocab restricts an MTP head's drafts; method is {self.method!r}")
      ids = tuple(int(t) for t in self.draft_vocab)
      if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ValueError("draft_vocab must hold at least one token id, each >= 0 and distinct")
      object.__setattr__(self, "draft_vocab", ids)
    if self.speculative_token_tree is not None:
      tree = TokenTree.parse(self.speculative_token_tree)
      if self.method not in TREE_METHODS:
        raise ValueError(f"speculative_token_tree needs a drafter with logits at every node "
                         f"({TREE_METHODS}); method is {self.method!r}")
      if tree.num_nodes - 1 != k:
        raise ValueError(f"speculative_token_tree has {tree.num_nodes - 1} nodes but "
                         f"num_speculative_tokens={k}: they must be equal (each node is a "
                         "draft token the target verifies)")
      object.__setattr__(self, "speculative_token_tree", tree.paths[1:])
    if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
      raise ValueError(
          f"n-gram bounds out of order: need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) "
          f"<= prompt_lookup_max ({self.prompt_lookup_max})")

  @property
  def token_tree(self) -> TokenTree | None:
    """The tree to verify, or None for a chain."""
    if self.speculative_token_tree is None:
      return None
    return _tree_of(self.speculative_token_tree)

  @classmethod
  def parse(cls, spec: "SpecConfig | dict | None") -> "SpecConfig | None":
    if spec is None or isinstance(spec, SpecConfig):
      return spec
    if not isinstance(spec, dict):
      raise ValueError(f"speculative_config must be a dict, SpecConfig or None, got {spec!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(spec) - known
    if unknown:
      raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(known)}")
    if "method" not in spec or "num_speculative_tokens" not in spec:
      raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
    return cls(**spec)


@functools.cache
def _tree_of(paths: tuple) -> TokenTree:
  """One TokenTree per normalised path tuple: the loop asks for it at every trace."""
  return TokenTree.from_paths(paths)
