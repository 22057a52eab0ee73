"""Ahead-of-time compile cases of ``fp8_matmul`` at real linear-layer shapes (``aot_check.py``).

Each row of ``LAYERS`` is one linear layer ``[in=K, out=N]`` and the token counts M it is
compiled at: decode (M <= 64) and prefill (M >= 128). ``KINDS`` says which layers each
(impl, target) runs: the Hopper kernel with FP8 activations (a QArray) and with BF16 activations
(quantized in-kernel: the path ``quant.matmul`` takes), the TPU kernel on v5e (and on v6e for
``ONE_PER_MODEL``), and the XLA fallback on H100. When the kernel's signature or weight layout
changes, only ``_operands`` and ``_call`` need to follow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.aot import AotCase
from kernels_pallas.fp8_matmul.api import fp8_matmul
from kernels_pallas.qarray import QArray

DECODE_M = (1, 16, 64)
PREFILL_M = (128, 4096, 8192)
ALL_M = DECODE_M + PREFILL_M

# (model, layer, K, N, token counts M)
LAYERS = (
    ("Qwen3-8B", "q_proj|o_proj", 4096, 4096, ALL_M),
    ("Qwen3-8B", "k_proj|v_proj", 4096, 1024, (16, 4096)),
    ("Qwen3-8B", "gate|up_proj", 4096, 12288, ALL_M),
    ("Qwen3-8B", "down_proj", 12288, 4096, (16, 4096)),
    ("Qwen3-30B-A3B", "q_proj", 2048, 4096, (16, 4096)),
    ("Qwen3-30B-A3B", "k_proj|v_proj", 2048, 512, (16, 4096)),
    ("Qwen3-30B-A3B", "o_proj", 4096, 2048, (16, 4096)),
    ("Llama-3-70B", "q_proj|o_proj", 8192, 8192, (16, 4096)),
    ("Llama-3-70B", "k_proj|v_proj", 8192, 1024, (16, 4096)),
    ("Llama-3-70B", "gate|up_proj", 8192, 28672, (1, 64, 8192)),
    ("Llama-3-70B", "down_proj", 28672, 8192, (16, 4096)),
)
# One layer per model at one decode and one prefill M: for the XLA fallback on H100, and for v6e
# (the same TPU kernel as on v5e; a different chip generation for the Mosaic TPU compiler).
ONE_PER_MODEL = (
    ("Qwen3-8B", "gate|up_proj", 4096, 12288, (16, 4096)),
    ("Qwen3-30B-A3B", "q_proj", 2048, 4096, (16, 4096)),
    ("Llama-3-70B", "gate|up_proj", 8192, 28672, (16, 4096)),
)
# (impl, target, activations, layers): activations "fp8" a per-token QArray, "bf16" raw
KINDS = (
    ("pallas_mosaic_gpu", "h100", "fp8", LAYERS),
    ("pallas_mosaic_gpu", "h100", "bf16", LAYERS),
    ("pallas_tpu", "v5e", "fp8", LAYERS),
    ("pallas_tpu", "v6e", "fp8", ONE_PER_MODEL),
    ("xla", "h100", "fp8", ONE_PER_MODEL),
)

F8 = jnp.float8_e4m3fn
F32 = jnp.float32


def _operands(m: int, k: int, n: int, x_kind: str):
    """(x, w_q) as ShapeDtypeStructs: x [M, K] (QArray with 1x128 groups, or BF16), w [K, N]."""
    sds = jax.ShapeDtypeStruct
    if x_kind == "fp8":
        x = QArray(sds((m, k), F8), sds((m, -(-k // 128)), F32), (128,), jnp.bfloat16)
    else:
        x = sds((m, k), jnp.bfloat16)
    w = QArray(sds((k, n), F8), sds((-(-k // 128), -(-n // 128)), F32), (128, 128), jnp.bfloat16)
    return x, w


def _call(x, w_q, *, impl: str):
    return fp8_matmul(x, w_q, out_dtype=jnp.bfloat16, impl=impl)


def cases() -> list[AotCase]:
    """Every (kernel, target, activation kind) of ``KINDS`` at its layer shapes."""
    out = []
    for impl, target, x_kind, layers in KINDS:
        for model, layer, k, n, ms in layers:
            for m in ms:
                phase = "decode" if m <= 64 else "prefill"
                label = f"{model} {layer} K={k} N={n} M={m} ({phase}, {x_kind} x)"
                args = _operands(m, k, n, x_kind)
                fn = functools.partial(_call, impl=impl)
                out.append(AotCase("fp8_matmul", impl, target, label, fn, args))
    return out
