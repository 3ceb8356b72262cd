"""jspec: sharded speculative decoding for JAX.

    llm = jspec.LLM(model="path/to/hf_dir", speculative_config={"method": "mtp",
                                                               "num_speculative_tokens": 3})
    outs = llm.generate(["Hello"], jspec.SamplingParams(temperature=0.0, max_tokens=64))
"""

from jspec.api import LLM
from jspec.config import ModelConfig, SamplingParams, SpecConfig
from jspec.models.mtp import MTPSpec
from jspec.outputs import (CompletionOutput, GenerateOutputs, Logprob, RequestMetrics,
                           RequestOutput)
from jspec.assets import demo_model_path
from jspec.sharding.rules import MeshConfig, ShardingRules

__all__ = ["LLM", "SamplingParams", "SpecConfig", "MeshConfig", "ShardingRules", "ModelConfig",
           "MTPSpec", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics",
           "GenerateOutputs", "demo_model_path"]
__version__ = "0.1.0"
