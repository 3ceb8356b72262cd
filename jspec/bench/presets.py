"""Real-size model shapes for benchmarks (random weights built on the device)."""

from jspec.config import ModelConfig

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
    # A few-MB model with the same structure, for smoke runs on a CPU.
    "tiny-moe": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1e4, tie_word_embeddings=False, max_position_embeddings=4096, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
}
