"""Ahead-of-time compile cases of ``grouped_fp8_matmul`` at Qwen3-30B-A3B shapes (``aot_check.py``).

Qwen3-30B-A3B experts: E=128, top-8, D=2048, expert F=768. Per MoE layer the rollout runs
gate+up as one call over two stacks ``[E, 768, 2048]`` (N = 768 + 768, K = 2048) and down
``[E, 2048, 768]`` (N = 2048, K = 768), at ``rows = tokens · 8``: decode steps of B = 1, 8, 64
and 256 sequences (8..2048 rows) and prefill chunks of 512 and 8192 tokens (4096 and 65536
rows). Every row runs for each entry of ``KINDS`` (the Hopper kernel with FP8 activations and with
BF16 activations quantized by XLA first, the TPU kernel on v5e and v6e, the XLA row-tile path on
H100); ``EXTRA`` adds E5M2, F32 output, the separate gate projection and non-default tiles. Every
case is one the support check accepts (an explicit impl it rejects raises), so compiling them all
proves the check at these shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.aot import AotCase
from kernels_pallas.grouped_fp8_matmul.api import grouped_fp8_matmul
from kernels_pallas.grouped_fp8_matmul.pallas_mosaic_gpu import MgpuConfig
from kernels_pallas.grouped_fp8_matmul.pallas_tpu import TpuConfig
from kernels_pallas.qarray import QArray

E, TOP_K, D, F = 128, 8, 2048, 768
DECODE_ROWS = (8, 64, 512, 2048)  # B = 1, 8, 64, 256 sequences, top-8
PREFILL_ROWS = (4096, 65536)  # 512 and 8192 prompt tokens, top-8
ALL_ROWS = DECODE_ROWS + PREFILL_ROWS
# (layer, K, N of each weight stack)
LAYERS = (("gate+up", D, (F, F)), ("down", F, (D,)))
# (impl, target, activations): "fp8" a per-token QArray, "bf16" raw (quantized by XLA)
KINDS = (
    ("pallas_mosaic_gpu", "h100", "fp8"),
    ("pallas_mosaic_gpu", "h100", "bf16"),
    ("pallas_tpu", "v5e", "fp8"),
    ("pallas_tpu", "v6e", "fp8"),
    ("xla", "h100", "fp8"),
)
_E4, _E5, _BF, _F32 = "float8_e4m3fn", "float8_e5m2", "bfloat16", "float32"
# (impl, target, FP8 format, output dtype, layer, K, Ns, rows, config)
EXTRA = (
    ("pallas_mosaic_gpu", "h100", _E5, _BF, "gate+up", D, (F, F), 512, None),
    ("pallas_mosaic_gpu", "h100", _E4, _F32, "down", F, (D,), 65536, None),
    ("pallas_mosaic_gpu", "h100", _E4, _F32, "gate+up", D, (F, F), 64, None),
    ("pallas_mosaic_gpu", "h100", _E4, _BF, "gate", D, (F,), 512, None),
    ("pallas_mosaic_gpu", "h100", _E4, _BF, "gate+up", D, (F, F), 4096, MgpuConfig(64, 128, 4)),
    ("pallas_mosaic_gpu", "h100", _E4, _BF, "gate+up", D, (F, F), 65536, MgpuConfig(128, 128, 4)),
    ("pallas_mosaic_gpu", "h100", _E4, _BF, "down", F, (D,), 65536, MgpuConfig(256, 128, 3)),
    ("pallas_mosaic_gpu", "h100", _E4, _BF, "gate+up", D, (F, F), 8192, MgpuConfig(64, 64, 5)),
    ("pallas_mosaic_gpu", "h100", _E4, _BF, "gate", D, (F,), 8192, MgpuConfig(64, 64, 6)),
    ("pallas_mosaic_gpu", "h100", _E4, _BF, "down", F, (D,), 2048, MgpuConfig(64, 128, 4, True)),
    ("pallas_mosaic_gpu", "h100", _E4, _BF, "gate+up", D, (F, F), 8, MgpuConfig(32, 64, 5, True)),
    (
        "pallas_mosaic_gpu",
        "h100",
        _E4,
        _BF,
        "gate+up",
        D,
        (F, F),
        512,
        MgpuConfig(32, 128, 5, True),
    ),
    ("pallas_tpu", "v6e", _E5, _BF, "gate+up", D, (F, F), 512, None),
    ("pallas_tpu", "v5e", _E4, _F32, "down", F, (D,), 65536, None),
    ("pallas_tpu", "v6e", _E4, _BF, "gate", D, (F,), 64, TpuConfig(block_m=128, block_k=1024)),
    ("xla", "h100", _E4, _BF, "gate", D, (F,), 2048, None),
)


def _operands(rows: int, k: int, ns: tuple[int, ...], x_kind: str, fmt: str = _E4):
    """(x [rows, K], weight stacks [E, N_i, K], group sizes [E]) as ShapeDtypeStructs."""
    sds, f8, f32 = jax.ShapeDtypeStruct, jnp.dtype(fmt), jnp.float32
    if x_kind == "fp8":
        x = QArray(sds((rows, k), f8), sds((rows, k // 128), f32), (128,), jnp.bfloat16)
    else:
        x = sds((rows, k), jnp.bfloat16)
    ws = tuple(
        QArray(sds((E, n, k), f8), sds((E, n // 128, k // 128), f32), (128, 128), jnp.bfloat16)
        for n in ns
    )
    return x, ws if len(ws) > 1 else ws[0], sds((E,), jnp.int32)


def _call(x, w_q, group_sizes_E, *, impl: str, out_dtype: str, config=None):
    return grouped_fp8_matmul(x, w_q, group_sizes_E, out_dtype=jnp.dtype(out_dtype), impl=impl,
                              config=config)  # fmt: skip


def _case(impl, target, x_kind, fmt, out_dtype, layer, k, ns, rows, config=None) -> AotCase:
    phase = "decode" if rows in DECODE_ROWS else "prefill"
    tags = [x_kind + " x"]
    tags += [] if fmt == _E4 else ["e5m2"]
    tags += [] if out_dtype == _BF else [f"{out_dtype} out"]
    tags += [] if config is None else [str(config)]
    n = "+".join(map(str, ns))
    label = f"Qwen3-30B-A3B {layer} E={E} K={k} N={n} rows={rows} ({phase}, {', '.join(tags)})"
    fn = functools.partial(_call, impl=impl, out_dtype=out_dtype, config=config)
    return AotCase(
        "grouped_fp8_matmul", impl, target, label, fn, _operands(rows, k, ns, x_kind, fmt)
    )


def cases() -> list[AotCase]:
    """Every (kernel, target, activation kind) at every layer and row count, plus ``EXTRA``."""
    out = [
        _case(impl, target, x_kind, _E4, _BF, layer, k, ns, rows)
        for impl, target, x_kind in KINDS
        for layer, k, ns in LAYERS
        for rows in ALL_ROWS
    ]
    return out + [_case(i, t, "fp8", *rest) for i, t, *rest in EXTRA]
