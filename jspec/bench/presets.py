"""Real-size model shapes for benchmarks (random weights built on the device)."""

from jspec.config import ModelConfig

def _every_fourth_full(num_layers: int) -> tuple[str, ...]:
  """The published Qwen3.5 pattern (full_attention_interval 4), written out as its configs do."""
  return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
               for i in range(num_layers))


_HYBRID_32, _HYBRID_40 = _every_fourth_full(32), _every_fourth_full(40)

PRESETS = {
    "qwen3-8b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
        max_position_embeddings=40960),
    "qwen3-30b-a3b": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
        max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True),
    # Qwen3.5-9B (dense, hybrid): 3 Gated DeltaNet layers to each gated-attention layer.
    "qwen3.5-9b": ModelConfig(
        architecture="Qwen3_5ForConditionalGeneration", vocab_size=248320, hidden_size=4096,
        intermediate_size=12288, num_layers=32, num_heads=16, num_kv_heads=4, head_dim=256,
        rms_norm_eps=1e-6, rope_theta=1e7, tie_word_embeddings=False,
        max_position_embeddings=262144, layer_types=_HYBRID_32, partial_rotary_factor=0.25,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel=4,
        weight_prefix="model.language_model."),
    # Qwen3.5-35B-A3B: 40 hybrid layers, 256 experts top-8 plus a shared expert.
    "qwen3.5-35b-a3b": ModelConfig(
        architecture="Qwen3_5MoeForConditionalGeneration", vocab_size=248320, hidden_size=2048,
        intermediate_size=0, num_layers=40, num_heads=16, num_kv_heads=2, head_dim=256,
        rms_norm_eps=1e-6, rope_theta=1e7, tie_word_embeddings=False,
        max_position_embeddings=262144, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, norm_topk_prob=True, shared_expert_intermediate_size=512,
        layer_types=_HYBRID_40, partial_rotary_factor=0.25, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel=4, weight_prefix="model.language_model."),
    # A few-MB model with the same structure, for smoke runs on a CPU.
    "tiny-moe": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1e4, tie_word_embeddings=False, max_position_embeddings=4096, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
}
