"""Rollout: the engine contract, the static and paged engines, KV caches and scales, sampling."""

from fp8rl_jax.generation.config import (
    ENGINES,
    KV_CACHE_DTYPES,
    KV_SCALE_MODES,
    ComputeDtype,
    EngineName,
    KVCacheDtype,
    KVScaleMode,
    PagedConfig,
    RolloutConfig,
)
from fp8rl_jax.generation.engine import (
    Capabilities,
    Engine,
    Prompts,
    Rollout,
    bucket_length,
    make_prompts,
)
from fp8rl_jax.generation.kv import KVScales, calibrate_kv_scales
from fp8rl_jax.generation.rollout import (
    ENGINE_IMPLS,
    PinParams,
    calibrate_initial_kv_scales,
    cast_floats,
    check_engine,
    kv_scale_metrics,
    prompt_segment_ids,
    recalibrate_kv_scales,
    rollout,
    rollout_weights,
)
from fp8rl_jax.generation.sampling import (
    SamplingConfig,
    process_logits,
    row_keys,
    sample,
    token_logprobs,
)
from fp8rl_jax.generation.static import DecodeState, generate

__all__ = [
    "ENGINES",
    "ENGINE_IMPLS",
    "KV_CACHE_DTYPES",
    "KV_SCALE_MODES",
    "ComputeDtype",
    "EngineName",
    "KVCacheDtype",
    "KVScaleMode",
    "Capabilities",
    "DecodeState",
    "Engine",
    "KVScales",
    "PagedConfig",
    "PinParams",
    "Prompts",
    "Rollout",
    "RolloutConfig",
    "SamplingConfig",
    "bucket_length",
    "calibrate_initial_kv_scales",
    "calibrate_kv_scales",
    "cast_floats",
    "check_engine",
    "generate",
    "kv_scale_metrics",
    "make_prompts",
    "process_logits",
    "prompt_segment_ids",
    "recalibrate_kv_scales",
    "rollout",
    "rollout_weights",
    "row_keys",
    "sample",
    "token_logprobs",
]
