"""Ahead-of-time compile cases of ``decode_attention`` at real shapes (``aot_check.py``).

Each row of ``SHAPES`` is a decode batch over a cache of S slots with GQA (query heads H over
KV heads K, head_dim 128), compiled for every cache kind in ``CACHES``: BF16, FP8 with static
per-head scales, FP8 with dynamic per-slot scales. ``KINDS`` says which shapes each (impl,
target) runs: the Hopper kernel on H100, the TPU kernel on v5e and v6e, the XLA fallback on
H100. When the kernel's signature changes (per-row lengths instead of ``valid_BS``, say), only
``_operands`` and ``_call`` need to follow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.aot import AotCase
from kernels_pallas.decode_attention.api import decode_attention

HEAD_DIM = 128
# (model, B rows, S cache slots, H query heads, K kv heads)
SHAPES = (
    ("Qwen3-8B", 1, 32768, 32, 8),
    ("Qwen3-8B", 32, 32768, 32, 8),
    ("Qwen3-8B", 256, 4096, 32, 8),
    ("Llama-3-70B", 16, 32768, 64, 8),
    ("Llama-3-70B", 256, 2048, 64, 8),
)
# Fewer shapes for v6e (the same TPU kernel as v5e) and for the XLA fallback on H100.
SOME_SHAPES = (SHAPES[1], SHAPES[3])
CACHES = ("bf16", "fp8_static", "fp8_dynamic")
# (impl, target, shapes)
KINDS = (
    ("pallas_mosaic_gpu", "h100", SHAPES),
    ("pallas_tpu", "v5e", SHAPES),
    ("pallas_tpu", "v6e", SOME_SHAPES),
    ("xla", "h100", SOME_SHAPES),
)


def _operands(b: int, s: int, h: int, n_kv: int, cache: str):
    """(q, k, v, valid, k_scale, v_scale) as ShapeDtypeStructs (scales None for BF16)."""
    sds = jax.ShapeDtypeStruct
    kv_dtype = jnp.bfloat16 if cache == "bf16" else jnp.float8_e4m3fn
    q = sds((b, h, HEAD_DIM), jnp.bfloat16)
    kv = sds((b, s, n_kv, HEAD_DIM), kv_dtype)
    valid = sds((b, s), jnp.bool_)
    scale = {"bf16": None, "fp8_static": (n_kv,), "fp8_dynamic": (b, s, n_kv)}[cache]
    sc = None if scale is None else sds(scale, jnp.float32)
    return q, kv, kv, valid, sc, sc


def _call(q, k, v, valid, k_scale, v_scale, *, impl: str):
    return decode_attention(
        q, k, v, valid, k_scale=k_scale, v_scale=v_scale, sm_scale=HEAD_DIM**-0.5, impl=impl
    )


def cases() -> list[AotCase]:
    """Every (kernel, target) of ``KINDS`` at its shapes and every cache kind."""
    out = []
    for impl, target, shapes in KINDS:
        for model, b, s, h, n_kv in shapes:
            for cache in CACHES:
                label = f"{model} B={b} S={s} H/K={h}/{n_kv} C={HEAD_DIM} {cache} cache"
                fn = functools.partial(_call, impl=impl)
                args = _operands(b, s, h, n_kv, cache)
                out.append(AotCase("decode_attention", impl, target, label, fn, args))
    return out
