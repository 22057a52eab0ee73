"""The KV caches the model runs over (``models.cache`` protocol) and their FP8 scales."""

from fp8rl_jax.generation.kv.dense import (
    CACHE_ALIGN,
    DenseStep,
    KVCache,
    cache_len,
    cdiv,
    extend_cache,
    init_cache,
)
from fp8rl_jax.generation.kv.paged import (
    PagedKVCache,
    PagedStep,
    check_kernel_page_size,
    init_paged_cache,
    page_bytes,
)
from fp8rl_jax.generation.kv.scales import (
    MODES,
    KVScales,
    LayerKV,
    Mode,
    calibrate_kv_scales,
    quantize_kv,
)

__all__ = [
    "CACHE_ALIGN",
    "MODES",
    "DenseStep",
    "KVCache",
    "KVScales",
    "LayerKV",
    "Mode",
    "PagedKVCache",
    "PagedStep",
    "cache_len",
    "calibrate_kv_scales",
    "cdiv",
    "check_kernel_page_size",
    "extend_cache",
    "init_cache",
    "init_paged_cache",
    "page_bytes",
    "quantize_kv",
]
