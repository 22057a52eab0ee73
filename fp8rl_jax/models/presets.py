"""The published model shapes the project plans, compiles and benchmarks for (from each model's
HF ``config.json``); runs read the shape from the checkpoint, these are for what has none: the
AOT cases, the benchmarks and the planner."""

from __future__ import annotations

from fp8rl_jax.models.config import ModelConfig, RopeConfig

_QWEN3 = dict(
    vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
    max_position_embeddings=40960, qk_norm=True,
)  # fmt: skip

QWEN3_1P7B = ModelConfig(
    **_QWEN3, hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8,
    intermediate_size=6144, tie_word_embeddings=True, architecture="Qwen3ForCausalLM",
)  # fmt: skip
QWEN3_8B = ModelConfig(
    **_QWEN3, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
    intermediate_size=12288, architecture="Qwen3ForCausalLM",
)  # fmt: skip
QWEN3_30B_A3B = ModelConfig(
    **_QWEN3, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
    intermediate_size=6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True, architecture="Qwen3MoeForCausalLM",
)  # fmt: skip
QWEN3_STOP_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>

PRESETS = {"qwen3-1.7b": QWEN3_1P7B, "qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}
