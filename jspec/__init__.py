"""jspec: sharded speculative decoding for JAX.

    llm = jspec.LLM(model="path/to/hf_dir", speculative_config={"method": "mtp",
                                                               "num_speculative_tokens": 3})
    outs = llm.generate(["Hello"], jspec.SamplingParams(temperature=0.0, max_tokens=64))
"""

import logging as _logging

from jspec.api import LLM
from jspec.config import ModelConfig, SamplingParams, SpecConfig
from jspec.models.mtp import MTPSpec
from jspec.outputs import (CompletionOutput, GenerateOutputs, Logprob, RequestMetrics,
                           RequestOutput)
from jspec.assets import demo_model_path
from jspec.sharding.rules import MeshConfig, ShardingRules


class _NoTorchAdvice(_logging.Filter):
  """transformers says on import that PyTorch is missing: jspec needs none (it reads configs and
  tokenizers only). That one advisory is dropped; the rest of transformers' logging is kept."""

  def filter(self, record):
    return not record.getMessage().startswith("PyTorch was not found")


_logging.getLogger("transformers").addFilter(_NoTorchAdvice())

__all__ = ["LLM", "SamplingParams", "SpecConfig", "MeshConfig", "ShardingRules", "ModelConfig",
           "MTPSpec", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics",
           "GenerateOutputs", "demo_model_path"]
__version__ = "0.1.0"
