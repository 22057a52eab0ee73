"""Ahead-of-time compile cases of ``decode_attention`` at real shapes (``scripts/aot_check.py``).

Each row of ``SHAPES`` is a decode batch over a cache of S slots with GQA (query heads H over KV
heads K, head_dim 128), compiled for every cache kind in ``CACHES``: BF16, FP8 with static
per-KV-head scales, FP8 with dynamic per-slot scales. ``KINDS`` says which shapes each (impl,
target) runs: the Hopper kernel on H100, the TPU kernel on v5e and v6e, the XLA reference on
H100. The per-shape default tiling splits the sequence where B x K gives too few CTAs (B <= 16
on H100: 33 and 2 chunks), so the table holds split and unsplit kernels. ``VARIANTS`` then cover
the rest of what the support checks accept (block sizes, stages, chunk counts, cache and query
dtypes, head_dim 64 on Hopper), so that every configuration ``auto`` can pick was compiled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.aot import AotCase
from kernels_pallas.decode_attention.api import decode_attention
from kernels_pallas.decode_attention.common import DecodeBlocks

HEAD_DIM = 128
# (model, B rows, S cache slots, H query heads, K kv heads)
SHAPES = (
    ("Qwen3-8B", 1, 32768, 32, 8),
    ("Qwen3-8B", 32, 32768, 32, 8),
    ("Qwen3-8B", 256, 4096, 32, 8),
    ("Llama-3-70B", 16, 32768, 64, 8),
    ("Llama-3-70B", 256, 2048, 64, 8),
)
# Fewer shapes for v6e (the same TPU kernel as v5e) and for the XLA reference on H100.
SOME_SHAPES = (SHAPES[1], SHAPES[3])
CACHES = ("bf16", "fp8_static", "fp8_dynamic")
# (impl, target, shapes)
KINDS = (
    ("pallas_mosaic_gpu", "h100", SHAPES),
    ("pallas_tpu", "v5e", SHAPES),
    ("pallas_tpu", "v6e", SOME_SHAPES),
    ("xla", "h100", SOME_SHAPES),
)
_B, _S = 32, 8192
# (impl, target, cache, q dtype, head_dim, DecodeBlocks): configurations beyond the defaults.
VARIANTS = (
    ("pallas_mosaic_gpu", "h100", "bf16", "bf16", 128, DecodeBlocks(128, 1, 2)),
    ("pallas_mosaic_gpu", "h100", "bf16", "bf16", 128, DecodeBlocks(128, 4, 3)),  # SMEM max
    ("pallas_mosaic_gpu", "h100", "fp8_static", "bf16", 128, DecodeBlocks(64, 8, 2)),
    ("pallas_mosaic_gpu", "h100", "fp8_dynamic", "f32", 128, DecodeBlocks(64, 1, 2)),
    ("pallas_mosaic_gpu", "h100", "bf16", "f16", 128, DecodeBlocks(64, 1, 3)),
    ("pallas_mosaic_gpu", "h100", "f16", "f16", 64, None),
    ("pallas_mosaic_gpu", "h100", "f16", "bf16", 128, DecodeBlocks(128, 2, 3)),
    ("pallas_mosaic_gpu", "h100", "e5m2_static", "bf16", 64, DecodeBlocks(64, 2, 3)),
    # swap-AB on FP8 at 128 slots per tile (query groups up to 16: wgmma N <= 16)
    ("pallas_mosaic_gpu", "h100", "fp8_static", "bf16", 128, DecodeBlocks(128, 1, 3)),
    ("pallas_mosaic_gpu", "h100", "fp8_dynamic", "bf16", 128, DecodeBlocks(128, 4, 2)),
    # deeper rings (the autotuner's candidates): 4-5 stages, FP8 and 16-bit, both tile sizes
    ("pallas_mosaic_gpu", "h100", "fp8_static", "bf16", 128, DecodeBlocks(64, 1, 4)),
    ("pallas_mosaic_gpu", "h100", "fp8_dynamic", "bf16", 128, DecodeBlocks(64, 2, 5)),
    ("pallas_mosaic_gpu", "h100", "bf16", "bf16", 128, DecodeBlocks(64, 1, 5)),
    ("pallas_mosaic_gpu", "h100", "fp8_static", "bf16", 128, DecodeBlocks(128, 1, 4)),
    ("pallas_mosaic_gpu", "h100", "fp8_static", "bf16", 128, DecodeBlocks(128, 2, 5)),
    # the unswapped kernel (the query group padded to a 64-row M tile): both block sizes and
    # stage counts, FP8 and 16-bit caches, split and not
    ("pallas_mosaic_gpu", "h100", "fp8_static", "bf16", 128, DecodeBlocks(64, 1, 3, False)),
    ("pallas_mosaic_gpu", "h100", "fp8_dynamic", "bf16", 128, DecodeBlocks(64, 4, 2, False)),
    ("pallas_mosaic_gpu", "h100", "bf16", "bf16", 128, DecodeBlocks(128, 2, 3, False)),
    ("pallas_mosaic_gpu", "h100", "f16", "f16", 64, DecodeBlocks(64, 1, 2, False)),
    ("pallas_tpu", "v5e", "fp8_dynamic", "bf16", 128, DecodeBlocks(128, 4)),
    ("pallas_tpu", "v5e", "bf16", "bf16", 128, DecodeBlocks(256, 2)),
    ("pallas_tpu", "v5e", "f32", "f32", 128, None),
    ("pallas_tpu", "v6e", "e5m2_static", "bf16", 128, DecodeBlocks(256, 1)),
    ("pallas_tpu", "v6e", "fp8_dynamic", "f32", 128, DecodeBlocks(512, 4)),
)
_KV = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32, "e5m2": jnp.float8_e5m2}
_Q = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


def _operands(b: int, s: int, h: int, n_kv: int, cache: str, q_dtype="bf16", c=HEAD_DIM):
    """(q, k, v, lengths, starts, k_scale, v_scale) as ShapeDtypeStructs (FP8 only: scales)."""
    sds = jax.ShapeDtypeStruct
    kind, _, mode = cache.partition("_")
    kv_dtype = _KV.get(kind, jnp.float8_e4m3fn)
    q = sds((b, h, c), _Q[q_dtype])
    kv = sds((b, s, n_kv, c), kv_dtype)
    rows = sds((b,), jnp.int32)
    scale = {"static": (n_kv,), "dynamic": (b, n_kv, s)}.get(mode)
    sc = None if scale is None else sds(scale, jnp.float32)
    return q, kv, kv, rows, rows, sc, sc


def _call(q, k, v, lengths, starts, k_scale, v_scale, *, impl: str, config):
    return decode_attention(
        q, k, v, lengths, starts_B=starts, k_scale=k_scale, v_scale=v_scale,
        sm_scale=q.shape[-1] ** -0.5, impl=impl, config=config,
    )  # fmt: skip


def _case(impl, target, label, args, config=None) -> AotCase:
    fn = functools.partial(_call, impl=impl, config=config)
    return AotCase("decode_attention", impl, target, label, fn, args)


def cases() -> list[AotCase]:
    """Every (kernel, target) of ``KINDS`` at its shapes and cache kinds, then ``VARIANTS``."""
    out = []
    for impl, target, shapes in KINDS:
        for model, b, s, h, n_kv in shapes:
            for cache in CACHES:
                label = f"{model} B={b} S={s} H/K={h}/{n_kv} C={HEAD_DIM} {cache} cache"
                out.append(_case(impl, target, label, _operands(b, s, h, n_kv, cache)))
    for impl, target, cache, q_dtype, c, blocks in VARIANTS:
        cfg = "default blocks"
        if blocks is not None:
            cfg = f"bs={blocks.block_s} J={blocks.num_splits} stages={blocks.num_stages}"
            cfg += ", unswapped" if blocks.swap_ab is False else ""
        label = f"B={_B} S={_S} H/K=32/8 C={c} {cache} cache, q {q_dtype}, {cfg}"
        args = _operands(_B, _S, 32, 8, cache, q_dtype, c)
        out.append(_case(impl, target, label, args, blocks))
    # the widest query group the swap-AB kernel takes (wgmma N = 64: one KV head, 64 queries)
    label = f"B={_B} S={_S} H/K=64/1 C={HEAD_DIM} fp8_static cache, widest swap-AB group"
    out.append(_case("pallas_mosaic_gpu", "h100", label, _operands(_B, _S, 64, 1, "fp8_static")))
    # the widest query group the 128-slot FP8 tile takes (16 queries per KV head: wgmma N = 16)
    label = f"B={_B} S={_S} H/K=128/8 C={HEAD_DIM} fp8_static cache, bs=128, widest FP8 group"
    args = _operands(_B, _S, 128, 8, "fp8_static")
    out.append(_case("pallas_mosaic_gpu", "h100", label, args, DecodeBlocks(128, 1, 3)))
    return out
