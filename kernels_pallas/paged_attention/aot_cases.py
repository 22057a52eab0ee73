"""Ahead-of-time compile cases of ``paged_attention`` at real shapes (``scripts/aot_check.py``).

Each row of ``SHAPES`` is a decode batch of B slots over a page pool of X pages of Y slots,
page tables of W entries (the per-sequence budget), GQA with head_dim 128, for every cache kind
of ``CACHES`` (BF16, FP8 static per-KV-head scales, FP8 dynamic per-slot page scales). The
Mosaic TPU kernel runs on v5e and v6e; the XLA implementation (the window ladder) on H100. The
Mosaic GPU kernel runs on H100 with pages of 64 slots (BF16 and FP8 static pages: it has no
dynamic page scales yet), at ``GPU_SHAPES``, and with pages of 128 slots in ``VARIANTS``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.aot import AotCase
from kernels_pallas.paged_attention.api import paged_attention
from kernels_pallas.paged_attention.common import PagedBlocks

HEAD_DIM = 128
# (model, B slots, X pages, Y page size, W table entries, H query heads, K kv heads)
SHAPES = (
    ("Qwen3-8B", 32, 8192, 128, 160, 32, 8),  # 20K-token budget, 1M-token pool
    ("Qwen3-8B", 256, 4096, 128, 32, 32, 8),
    ("Llama-3-70B", 64, 2048, 256, 80, 64, 8),
)
SOME_SHAPES = SHAPES[:1]
GPU_SHAPES = (
    ("Qwen3-8B", 32, 16384, 64, 320, 32, 8),
    ("Qwen3-8B", 256, 8192, 64, 64, 32, 8),
    ("Llama-3-70B", 64, 4096, 64, 160, 64, 8),
)
CACHES = ("bf16", "fp8_static", "fp8_dynamic")
KINDS = (
    ("pallas_tpu", "v5e", SHAPES),
    ("pallas_tpu", "v6e", SOME_SHAPES),
    ("xla", "h100", SOME_SHAPES),
)
GPU_CACHES = ("bf16", "fp8_static")
# (impl, target, cache, page size, PagedBlocks) beyond the defaults: every page size and a split.
VARIANTS = (
    ("pallas_tpu", "v5e", "fp8_dynamic", 512, PagedBlocks(num_splits=2)),
    ("pallas_tpu", "v6e", "bf16", 256, PagedBlocks(num_splits=4)),
    ("pallas_tpu", "v6e", "fp8_static", 512, None),
    ("pallas_mosaic_gpu", "h100", "bf16", 64, PagedBlocks(num_splits=4, num_stages=3)),
    ("pallas_mosaic_gpu", "h100", "fp8_static", 64, PagedBlocks(num_splits=2, num_stages=3)),
    # the unswapped Hopper kernel (the query group padded to a 64-row M tile)
    ("pallas_mosaic_gpu", "h100", "bf16", 64, PagedBlocks(num_splits=2, swap_ab=False)),
    ("pallas_mosaic_gpu", "h100", "fp8_static", 64, PagedBlocks(1, 3, swap_ab=False)),
    # pages of 128 slots: FP8 (swap-AB, query groups up to 16), 16-bit (both kernels)
    ("pallas_mosaic_gpu", "h100", "fp8_static", 128, None),
    ("pallas_mosaic_gpu", "h100", "fp8_static", 128, PagedBlocks(num_splits=4, num_stages=2)),
    ("pallas_mosaic_gpu", "h100", "bf16", 128, None),
    ("pallas_mosaic_gpu", "h100", "bf16", 128, PagedBlocks(num_splits=2, swap_ab=False)),
    # deeper rings (the autotuner's candidates)
    ("pallas_mosaic_gpu", "h100", "fp8_static", 64, PagedBlocks(num_splits=1, num_stages=4)),
    ("pallas_mosaic_gpu", "h100", "fp8_static", 64, PagedBlocks(num_splits=2, num_stages=5)),
    ("pallas_mosaic_gpu", "h100", "fp8_static", 128, PagedBlocks(num_splits=1, num_stages=4)),
)


def _operands(b, x, y, w, h, n_kv, cache: str, c=HEAD_DIM):
    """(q, k, v, lengths, page_table, k_scale, v_scale) as ShapeDtypeStructs."""
    sds = jax.ShapeDtypeStruct
    kind, _, mode = cache.partition("_")
    kv_dtype = jnp.bfloat16 if kind == "bf16" else jnp.float8_e4m3fn
    pages = sds((x, y, n_kv, c), kv_dtype)
    scale = {"static": (n_kv,), "dynamic": (x, n_kv, y)}.get(mode)
    sc = None if scale is None else sds(scale, jnp.float32)
    q = sds((b, h, c), jnp.bfloat16)
    return q, pages, pages, sds((b,), jnp.int32), sds((b, w), jnp.int32), sc, sc


def _call(q, k, v, lengths, table, k_scale, v_scale, *, impl: str, config):
    return paged_attention(
        q, k, v, lengths, table, k_scale=k_scale, v_scale=v_scale,
        sm_scale=q.shape[-1] ** -0.5, impl=impl, config=config,
    )  # fmt: skip


def _case(impl, target, label, args, config=None) -> AotCase:
    fn = functools.partial(_call, impl=impl, config=config)
    return AotCase("paged_attention", impl, target, label, fn, args)


def cases() -> list[AotCase]:
    """Every (implementation, target) of ``KINDS`` at its shapes and caches, then ``VARIANTS``."""
    out = []
    for impl, target, shapes in KINDS:
        for model, b, x, y, w, h, n_kv in shapes:
            for cache in CACHES:
                label = f"{model} B={b} X={x} Y={y} W={w} H/K={h}/{n_kv} {cache} pages"
                out.append(_case(impl, target, label, _operands(b, x, y, w, h, n_kv, cache)))
    for model, b, x, y, w, h, n_kv in GPU_SHAPES:
        for cache in GPU_CACHES:
            label = f"{model} B={b} X={x} Y={y} W={w} H/K={h}/{n_kv} {cache} pages"
            args = _operands(b, x, y, w, h, n_kv, cache)
            out.append(_case("pallas_mosaic_gpu", "h100", label, args))
    for impl, target, cache, y, blocks in VARIANTS:
        x, w = (1 << 20) // y, 16384 // y
        splits = "default" if blocks is None else f"J={blocks.num_splits}"
        if blocks is not None and blocks.num_stages is not None:
            splits += f", {blocks.num_stages} stages"
        if blocks is not None and blocks.swap_ab is False:
            splits += ", unswapped"
        label = f"B=32 X={x} Y={y} W={w} H/K=32/8 {cache} pages, {splits}"
        out.append(_case(impl, target, label, _operands(32, x, y, w, 32, 8, cache), blocks))
    return out
