"""Real-size model shapes for benchmarks (random weights built on the device)."""

from jspec.config import LinearAttentionConfig, MLAConfig, MTPConfig, MoEConfig, ModelConfig
from jspec.models.rope import rope_scaling_items

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
        max_position_embeddings=40960,
        moe=MoEConfig(num_experts=128, num_experts_per_tok=8, intermediate_size=768,
                      norm_topk_prob=True)),
    # Qwen3.5-9B (dense, hybrid): 3 Gated DeltaNet layers to each gated-attention layer.
    "qwen3.5-9b": ModelConfig(
        architecture="Qwen3_5ForConditionalGeneration", vocab_size=248320, hidden_size=4096,
        intermediate_size=12288, num_layers=32, num_heads=16, num_kv_heads=4, head_dim=256,
        rms_norm_eps=1e-6, rope_theta=1e7, tie_word_embeddings=False,
        max_position_embeddings=262144, layer_types=_HYBRID_32, partial_rotary_factor=0.25,
        weight_prefix="model.language_model.",
        linear=LinearAttentionConfig(num_key_heads=16, num_value_heads=32, key_head_dim=128,
                                     value_head_dim=128, conv_kernel=4)),
    # Qwen3.5-35B-A3B: 40 hybrid layers, 256 experts top-8 plus a shared expert.
    "qwen3.5-35b-a3b": ModelConfig(
        architecture="Qwen3_5MoeForConditionalGeneration", vocab_size=248320, hidden_size=2048,
        intermediate_size=0, num_layers=40, num_heads=16, num_kv_heads=2, head_dim=256,
        rms_norm_eps=1e-6, rope_theta=1e7, tie_word_embeddings=False,
        max_position_embeddings=262144,
        layer_types=_HYBRID_40, partial_rotary_factor=0.25, weight_prefix="model.language_model.",
        moe=MoEConfig(num_experts=256, num_experts_per_tok=8, intermediate_size=512,
                      norm_topk_prob=True, shared_expert_intermediate_size=512),
        linear=LinearAttentionConfig(num_key_heads=16, num_value_heads=32, key_head_dim=128,
                                     value_head_dim=128, conv_kernel=4)),
    # DeepSeek-V3 / R1 layer shapes (MLA, 256 routed experts top-8 in 8 groups, 1 shared
    # expert, 3 dense layers first) with its NextN layer. All 61 layers take ~1.3 TB in
    # bfloat16; `num_layers` 6 (the 3 dense + 3 MoE layers, ~23 GB each, plus the MTP layer
    # and the embeddings: ~99 GB) fits one 141 GB H200 with 8k-context caches at batch 32.
    "deepseek-v3": ModelConfig(
        architecture="DeepseekV3ForCausalLM", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, num_layers=6, num_heads=128, num_kv_heads=128, head_dim=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=163840,
        rope_scaling=rope_scaling_items(
            {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, 163840),
        rope_interleave=True,
        moe=MoEConfig(num_experts=256, num_experts_per_tok=8, intermediate_size=2048,
                      norm_topk_prob=True, router_scoring="sigmoid", router_correction_bias=True,
                      n_group=8, topk_group=4, routed_scaling_factor=2.5, num_shared_experts=1,
                      first_k_dense_replace=3),
        mtp=MTPConfig(num_layers=1),
        mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128)),
    # GLM-4.5-Air layer shapes (zai-org/GLM-4.5-Air config.json): GQA 96 / 8 heads of 128 with
    # q/k/v biases and RoPE on half of each head, 128 routed experts top-8 (sigmoid, one group,
    # correction bias) + 1 shared expert, the first layer dense, 1 NextN layer. The published
    # model has 46 layers, ~218 GB in bfloat16 (a MoE layer ~4.7 GB: its experts 4.4 GB);
    # `num_layers` 20 (~97 GB with the embeddings, head and MTP layer) leaves a 141 GB H200
    # room for 8k-context caches at batch 32 (~1.1 GB per layer); `--layers` changes it.
    "glm-4.5-air": ModelConfig(
        architecture="Glm4MoeForCausalLM", vocab_size=151552, hidden_size=4096,
        intermediate_size=10944, num_layers=20, num_heads=96, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
        max_position_embeddings=131072,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
        moe=MoEConfig(num_experts=128, num_experts_per_tok=8, intermediate_size=1408,
                      norm_topk_prob=True, router_scoring="sigmoid", router_correction_bias=True,
                      n_group=1, topk_group=1, routed_scaling_factor=1.0, num_shared_experts=1,
                      first_k_dense_replace=1),
        mtp=MTPConfig(num_layers=1)),
    # Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): GQA 32 / 8 heads of 128, llama3 RoPE
    # scaling (factor 8 over the original 8192 positions), untied head.
    "llama-3.1-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        max_position_embeddings=131072, use_qk_norm=False, rope_scaling=rope_scaling_items(
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131072,
            rope_types=("llama3",))),
    # Llama-3.2-1B: 16 layers, GQA 32 / 8 heads of 64, the head tied to the embedding, llama3
    # RoPE scaling with factor 32.
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        max_position_embeddings=131072, use_qk_norm=False, rope_scaling=rope_scaling_items(
            {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131072,
            rope_types=("llama3",))),
    # Mixtral-8x7B-v0.1: 32 layers, GQA 32 / 8 heads of 128, 8 experts top-2 of width 14336 in
    # every layer, no sliding window. The whole model is ~94 GB in bfloat16 (46.7B parameters):
    # it fits one 141 GB H200 with modest caches; `--layers` shrinks it for an 80 GB H100.
    "mixtral-8x7b": ModelConfig(
        architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=4096,
        intermediate_size=0, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
        max_position_embeddings=32768, use_qk_norm=False,
        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=14336,
                      norm_topk_prob=True)),
    # A few-MB model with the same structure, for smoke runs on a CPU.
    "tiny-moe": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1e4, tie_word_embeddings=False, max_position_embeddings=4096,
        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=64,
                      norm_topk_prob=True)),
}
PRESETS["tiny-mla"] = PRESETS["deepseek-v3"].replace(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=4, head_dim=8, max_position_embeddings=4096,
    moe=dict(num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, intermediate_size=32,
             first_k_dense_replace=1),
    mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16))
PRESETS["tiny-glm"] = PRESETS["glm-4.5-air"].replace(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
    moe=dict(num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, intermediate_size=32))

# The MTP layout each preset's checkpoints publish (the others: Qwen3-Next's).
MTP_LAYOUTS = {"deepseek-v3": "deepseek_v3", "tiny-mla": "deepseek_v3",
               "glm-4.5-air": "deepseek_v3", "tiny-glm": "deepseek_v3"}
