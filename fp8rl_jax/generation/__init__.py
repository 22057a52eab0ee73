"""Rollout engine: sampling, FP8 KV-cache scales, the jitted prefill + decode loop."""

from fp8rl_jax.generation.generate import (
    DecodeState,
    Prompts,
    Rollout,
    bucket_length,
    generate,
    make_prompts,
)
from fp8rl_jax.generation.kv_scales import KVScales, calibrate_kv_scales
from fp8rl_jax.generation.sampling import (
    SamplingConfig,
    process_logits,
    row_keys,
    sample,
    token_logprobs,
)

__all__ = [
    "DecodeState",
    "Prompts",
    "Rollout",
    "bucket_length",
    "generate",
    "make_prompts",
    "KVScales",
    "SamplingConfig",
    "calibrate_kv_scales",
    "process_logits",
    "row_keys",
    "sample",
    "token_logprobs",
]
