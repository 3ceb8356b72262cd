"""Llama 2 / 3.x, Mistral, Mixtral and Qwen2 (transformers `LlamaForCausalLM`,
`MistralForCausalLM`, `MixtralForCausalLM`, `Qwen2ForCausalLM`).

Each is the neutral pre-norm block (jspec.models.decoder.DecoderLayer) without q/k norms; they
differ only where the config says so (transformers modeling_llama.py, modeling_mistral.py,
modeling_mixtral.py, modeling_qwen2.py):
  - Llama: `attention_bias` biases q/k/v AND o_proj (`LlamaAttention`); `mlp_bias` is refused;
    Llama-3.1 / 3.2 scale RoPE with `rope_type: "llama3"` (jspec.models.rope); 3.2-1B / 3B tie
    the embedding and the head.
  - Mistral: Llama without biases, with a sliding window in v0.1 (`sliding_window`).
  - Qwen2: biases on q/k/v only (`Qwen2Attention`); a sliding window only where
    `use_sliding_window` (AutoConfig then keeps `sliding_window`, else sets it to None) and only
    in the layers `layer_types` marks "sliding_attention" (from `max_window_layers` on).
  - Mixtral: every MLP is `MixtralSparseMoeBlock`: softmax over all experts in float32, the top
    2 renormalised to sum to 1 (`MixtralTopKRouter`) -- Qwen3-MoE's routing with
    norm_topk_prob (jspec.models.moe) -- over experts of width `intermediate_size`, published as
    `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.{w1 (gate), w3 (up), w2 (down)}`.
    `router_jitter_noise` multiplies the inputs only in training (`if self.training and
    self.jitter_noise > 0`), so inference ignores it.
Sliding windows are not applied: attention covers the whole context, exact while every position
is inside the window, and jspec.LLM refuses a longer max_model_len (`ModelConfig.sliding_window`).

`DecoderLayer` (the neutral layer, whose attention follows the config's flags) and
`LlamaCausalLM` are built from a ModelConfig alone, as draft models built on this family are.
"""

from __future__ import annotations

from jspec.config import ModelConfig, MoEConfig
from jspec.models import weights as W
from jspec.models.decoder import CausalLM, DecoderLayer, common_fields
from jspec.models.rope import rope_scaling_items

__all__ = ["DecoderLayer", "LlamaCausalLM", "read_config", "moe_rules"]

LLAMA = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
MIXTRAL = "MixtralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
ACTIVATIONS = ("silu",)
ROPE_TYPES = ("default", "llama3", "yarn")


# The family's model is the neutral decoder stack, every layer dense or (Mixtral) every layer
# MoE (`cfg.layer_is_moe`); the name stays for its callers.
LlamaCausalLM = CausalLM


# ---- configuration ----------------------------------------------------------------------------

def read_config(hf_config, arch: str) -> ModelConfig:
  act = getattr(hf_config, "hidden_act", "silu")
  if act not in ACTIVATIONS:
    raise ValueError(f"hidden_act={act!r} is not supported; jspec supports {list(ACTIVATIONS)}")
  if getattr(hf_config, "mlp_bias", False):
    raise ValueError(f"mlp_bias=True is not supported for {arch} (no published checkpoint "
                     "jspec knows has MLP biases); jspec supports mlp_bias=False")
  rope = dict(getattr(hf_config, "rope_parameters", None) or {})
  scaling = rope_scaling_items(rope, hf_config.max_position_embeddings, ROPE_TYPES,
                               where=f"for {arch}")
  theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
  fields = common_fields(hf_config, {"rope_theta": theta})  # the scaling is read above
  fields.update(rope_scaling=scaling, use_qk_norm=False)
  if arch == LLAMA:
    bias = bool(getattr(hf_config, "attention_bias", False))
    fields.update(attention_bias=bias, o_proj_bias=bias)
  elif arch == QWEN2:
    fields.update(attention_bias=True, sliding_window=_qwen2_window(hf_config))
  elif arch in (MISTRAL, MIXTRAL):
    fields.update(sliding_window=int(getattr(hf_config, "sliding_window", None) or 0))
  if arch == MIXTRAL:
    fields.update(intermediate_size=0, moe=MoEConfig(
        num_experts=int(hf_config.num_local_experts),
        num_experts_per_tok=int(hf_config.num_experts_per_tok),
        intermediate_size=int(hf_config.intermediate_size), norm_topk_prob=True))
  return ModelConfig(architecture=arch, **fields)


def _qwen2_window(hf_config) -> int:
  """The window of Qwen2's sliding layers, 0 if none slides (transformers `Qwen2Attention`:
  `config.sliding_window if layer_type == "sliding_attention" else None`)."""
  window = getattr(hf_config, "sliding_window", None)
  layer_types = getattr(hf_config, "layer_types", None) or ()
  return int(window) if window and "sliding_attention" in layer_types else 0


# ---- checkpoint layout ------------------------------------------------------------------------

def moe_rules(cfg: ModelConfig, p: str, names: set[str]) -> dict:
  """Mixtral's experts as published (`block_sparse_moe.experts.{e}.w1/w3/w2`, what
  transformers' save_pretrained writes too), or under transformers' own module names
  (`mlp.gate`, `mlp.experts.gate_up_proj`) where a checkpoint holds those."""
  if p + "mlp.gate.weight" in names:
    return W.expert_rules(cfg, p, names)
  return W.expert_rules(cfg, p, names, block="block_sparse_moe.",
                        expert_names=("w1", "w3", "w2"))
