"""Ahead-of-time compile cases of the activation-quantization kernels at real decode and prefill
shapes (``scripts/aot_check.py``): the standalone one-launch quantization and the producer-fused
kernels (RMSNorm, SwiGLU from the fused gate|up output or two arrays, decode attention's chunk
combine), for H100, at the widths of Qwen3-8B, Qwen3-30B-A3B and Llama-3-70B."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.act_quantize import fused
from kernels_pallas.act_quantize.pallas_triton import quantize_activations_triton
from kernels_pallas.aot import AotCase
from kernels_pallas.decode_attention.mgpu_swap import swap_n

BF16, F32 = jnp.bfloat16, jnp.float32
ROWS = (16, 64, 256)  # decode batches: 16-row programs
PREFILL_ROWS = 4096  # 64-row programs (``pallas_triton.row_block``)
# (model, hidden D, ffn F, heads H, KV heads K)
MODELS = (
    ("Qwen3-8B", 4096, 12288, 32, 8),
    ("Qwen3-30B-A3B", 2048, 6144, 32, 4),
    ("Llama-3-70B", 8192, 28672, 64, 8),
)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _rmsnorm(x, w):
    return fused.rmsnorm_quantize_triton(x, w, 1e-6)


def _swiglu(y):
    return fused.swiglu_quantize_triton(y)


def _swiglu_split(g, u):
    return fused.swiglu_quantize_triton(g, u)


def _combine(group):
    def fn(o, lse, v):
        return fused.combine_quantize_triton(o, lse, v, group=group, out_dtype=BF16)

    return fn


def _combine_unsplit(group):
    def fn(o, v):
        return fused.combine_quantize_triton(o, None, v, group=group, out_dtype=BF16)

    return fn


def cases() -> list[AotCase]:
    out = []

    def add(label, fn, *args):
        out.append(AotCase("act_quantize", "pallas_triton", "h100", label, fn, args))

    for model, d, f, h, k in MODELS:
        for m in ROWS:
            add(
                f"{model} rmsnorm+quantize M={m} D={d}",
                _rmsnorm,
                _sds((m, d), BF16),
                _sds((d,), BF16),
            )
            add(f"{model} swiglu+quantize (gate|up) M={m} F={f}", _swiglu, _sds((m, 2 * f), BF16))
        add(f"{model} swiglu+quantize (gate, up) M=16 F={f}", _swiglu_split,
            _sds((16, f), BF16), _sds((16, f), BF16))  # fmt: skip
        add(f"{model} quantize (standalone) M=16 K={d}",
            lambda x: quantize_activations_triton(x, rows=16), _sds((16, d), BF16))  # fmt: skip
        m = PREFILL_ROWS
        add(f"{model} rmsnorm+quantize M={m} D={d}", _rmsnorm, _sds((m, d), BF16), _sds((d,), BF16))
        add(f"{model} swiglu+quantize (gate|up) M={m} F={f}", _swiglu, _sds((m, 2 * f), BF16))
        for kk in (d, f):
            add(f"{model} quantize (standalone) M={m} K={kk}", quantize_activations_triton,
                _sds((m, kk), BF16))  # fmt: skip
        for b, j in ((16, 16), (16, 2), (64, 4), (256, 1)):
            v = _sds((k,), F32)
            if j == 1:
                add(f"{model} combine+quantize B={b} J=1 H/K={h}/{k}", _combine_unsplit(h // k),
                    _sds((b, 1, h, 128), F32), v)  # fmt: skip
            else:
                add(f"{model} combine+quantize B={b} J={j} H/K={h}/{k}", _combine(h // k),
                    _sds((b, j, h, 128), F32), _sds((b, j, k, 64), F32), v)  # fmt: skip
            # the swap-AB decode kernel's transposed chunks [B, J, K, C, N] (the default)
            n, sw = swap_n(h // k), f"combine+quantize B={b} J={j} H/K={h}/{k} (swap-AB layout)"
            o_sw = _sds((b, j, k, 128, n), F32)
            if j == 1:
                add(f"{model} {sw}", _combine_unsplit(h // k), o_sw, v)
            else:
                add(f"{model} {sw}", _combine(h // k), o_sw, _sds((b, j, k, n), F32), v)
    return out
