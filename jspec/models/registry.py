"""Model families: a config's `architectures` name -> how to read it, build it and load it.

A family is one file under jspec/models/ (qwen3.py, qwen3_5.py, ...) built on the neutral
decoder (jspec.models.decoder), and a `Family` record here naming what it does differently:
  - `read_config(hf_config, arch) -> ModelConfig`,
  - a model class with the surface the loop uses (`__call__`, `logits`, `embed_tokens`,
    `init_caches`; `make_norm` / `make_mtp_decoder` / `make_mtp_cache` for its MTP heads),
  - `moe_rules` and `mixer_rules`: how its MoE blocks and token mixers are published, from
    which the decoder's builders make `target_rules(cfg, names)` and `decoder_rules(cfg,
    names)` (checkpoint tensor names -> parameters, jspec.models.weights) for the target and
    for an MTP head's decoder layer,
  - optionally `skipped_prefixes(cfg)`: tensors present in published checkpoints that are
    never read (a multimodal model's vision tower).
Nothing outside jspec/models/ names a family; the speculative loop sees only the surface.
A checkpoint directory's config is read through this table by jspec.models.hf_config.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jspec.config import ModelConfig
from jspec.models import decoder, deepseek_v3, glm4_moe, llama, qwen3, qwen3_5


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  read_config: Callable
  model: type
  moe_rules: decoder.MoeRules
  mixer_rules: decoder.MixerRules = decoder.attention_mixer_rules
  skipped_prefixes: Callable[[ModelConfig], tuple[str, ...]] = lambda cfg: ()

  def target_rules(self, cfg: ModelConfig, names: set[str]) -> dict:
    return decoder.target_rules(cfg, names, self.moe_rules, self.mixer_rules)

  def decoder_rules(self, cfg: ModelConfig, names: set[str]) -> Callable[[str, bool], dict]:
    return decoder.decoder_rules(cfg, names, self.moe_rules, self.mixer_rules)


_QWEN3 = Family("qwen3", qwen3.read_config, qwen3.Qwen3CausalLM, qwen3.moe_rules)
_QWEN3_5 = Family("qwen3_5", qwen3_5.read_config, qwen3_5.Qwen35CausalLM, qwen3_5.moe_rules,
                  qwen3_5.mixer_rules, qwen3_5.skipped_prefixes)
_DEEPSEEK_V3 = Family("deepseek_v3", deepseek_v3.read_config, deepseek_v3.DeepseekV3CausalLM,
                      deepseek_v3.moe_rules, deepseek_v3.mixer_rules)
_GLM4_MOE = Family("glm4_moe", glm4_moe.read_config, glm4_moe.Glm4MoeCausalLM,
                   glm4_moe.moe_rules)
_LLAMA = Family("llama", llama.read_config, llama.LlamaCausalLM, llama.moe_rules)

ARCHITECTURES = {
    "Qwen3ForCausalLM": _QWEN3,
    "Qwen3MoeForCausalLM": _QWEN3,
    "Qwen3_5ForConditionalGeneration": _QWEN3_5,
    "Qwen3_5MoeForConditionalGeneration": _QWEN3_5,
    "Qwen3_5ForCausalLM": _QWEN3_5,
    "Qwen3_5MoeForCausalLM": _QWEN3_5,
    "Qwen3NextForCausalLM": _QWEN3_5,
    "DeepseekV3ForCausalLM": _DEEPSEEK_V3,
    "Glm4MoeLiteForCausalLM": _DEEPSEEK_V3,
    "Glm4MoeForCausalLM": _GLM4_MOE,
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "MixtralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def family_of(cfg_or_arch: ModelConfig | str) -> Family:
  arch = getattr(cfg_or_arch, "architecture", cfg_or_arch)
  if arch not in ARCHITECTURES:
    raise ValueError(f"unsupported architecture {arch!r}; jspec supports "
                     f"{list(SUPPORTED_ARCHITECTURES)}")
  return ARCHITECTURES[arch]


def read_config(hf_config) -> ModelConfig:
  architectures = list(getattr(hf_config, "architectures", None) or [])
  arch = next((a for a in architectures if a in ARCHITECTURES), None)
  if arch is None:
    raise ValueError(f"unsupported architecture {architectures or hf_config.model_type!r}; "
                     f"jspec supports {list(SUPPORTED_ARCHITECTURES)}")
  return ARCHITECTURES[arch].read_config(hf_config, arch)
