"""Shared test utilities: fixture paths, cached LLMs (compiles are the slow part on CPU)."""

import functools
import os

import numpy as np

import jspec

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FIXTURE_NAMES = ("qwen3_dense", "qwen3_dense_tied_legacy", "qwen3_moe", "qwen3_moe_legacy")


def fixture_dir(name: str) -> str:
  return os.path.join(FIXTURES, name)


def reference(name: str):
  return np.load(os.path.join(fixture_dir(name), "reference.npz"))


@functools.lru_cache(maxsize=None)
def cached_llm(name: str, method: str | None = None, k: int = 0, max_model_len: int = 128,
               **kwargs) -> jspec.LLM:
  """One LLM per configuration for the whole test session (float32, exact on CPU)."""
  spec = None if method is None else {"method": method, "num_speculative_tokens": k, **kwargs}
  return jspec.LLM(model=fixture_dir(name), dtype="float32", max_model_len=max_model_len,
                   speculative_config=spec)


def greedy(max_tokens: int, **kwargs) -> jspec.SamplingParams:
  return jspec.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
