"""jspec: sharded speculative decoding for JAX.

    llm = jspec.LLM(model="path/to/hf_dir", speculative_config={"method": "mtp",
                                                               "num_speculative_tokens": 3})
    outs = llm.generate(["Hello"], jspec.SamplingParams(temperature=0.0, max_tokens=64))
"""

import importlib as _importlib
import logging as _logging

# Public names, imported on first use (PEP 562): `import jspec` itself loads nothing heavy, so
# the CLI sets its Ctrl-C handler before JAX starts importing (a couple of seconds in which a
# Ctrl-C used to print a long traceback, or be lost).
_EXPORTS = {"LLM": "jspec.api", "ModelConfig": "jspec.config", "MoEConfig": "jspec.config",
            "MLAConfig": "jspec.config", "LinearAttentionConfig": "jspec.config",
            "MTPConfig": "jspec.config", "SamplingParams": "jspec.config",
            "SpecConfig": "jspec.config",
            "MTPSpec": "jspec.models.mtp", "CompletionOutput": "jspec.outputs",
            "GenerateOutputs": "jspec.outputs", "Logprob": "jspec.outputs",
            "RequestMetrics": "jspec.outputs", "RequestOutput": "jspec.outputs",
            "demo_model_path": "jspec.assets", "MeshConfig": "jspec.sharding.rules",
            "ShardingRules": "jspec.sharding.rules"}


def __getattr__(name):
  if name in _EXPORTS:
    value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'jspec' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))


class _NoTorchAdvice(_logging.Filter):
  """transformers says on import that PyTorch is missing: jspec needs none (it reads configs and
  tokenizers only). That one advisory is dropped; the rest of transformers' logging is kept."""

  def filter(self, record):
    return not record.getMessage().startswith("PyTorch was not found")


_logging.getLogger("transformers").addFilter(_NoTorchAdvice())

__all__ = ["LLM", "SamplingParams", "SpecConfig", "MeshConfig", "ShardingRules", "ModelConfig",
           "MoEConfig", "MLAConfig", "LinearAttentionConfig", "MTPConfig", "MTPSpec", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics",
           "GenerateOutputs", "demo_model_path"]
__version__ = "0.1.0"
