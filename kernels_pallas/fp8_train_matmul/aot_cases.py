"""Ahead-of-time compile cases of ``fp8_train_matmul`` (forward + backward) at real shapes.

Each case compiles ``(y, dx, dw)`` of one linear layer of a train step (``jax.vjp``): the W8A8
forward and the dgrad through the target's ``fp8_matmul`` kernel (Mosaic GPU on H100, Mosaic
TPU on v5e/v6e), the wgrad through ``fp8_matmul``'s XLA path (1D1D scaling), for the BF16 and
the FP8 (DeepSeek-V3) backward. Token counts M are the rows of one training micro-batch.

``GROUPED``: the MoE expert stacks of Qwen3-30B-A3B (E=128, top-8, D=2048, expert F=768) with the
FP8 backward of ``grouped.py``: forward and dgrad through the target's ``grouped_fp8_matmul``
kernel, wgrad in XLA (128-token tiles per expert), at the rows of a 4,096-token micro-batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.aot import AotCase
from kernels_pallas.fp8_train_matmul.api import TrainMatmulConfig, fp8_train_matmul
from kernels_pallas.fp8_train_matmul.grouped import grouped_fp8_train_matmul

# (model, layer, K, N, token counts M)
LAYERS = (
    ("Qwen3-8B", "q_proj|o_proj", 4096, 4096, (4096,)),
    ("Qwen3-8B", "gate|up_proj", 4096, 12288, (8192,)),
    ("Qwen3-8B", "down_proj", 12288, 4096, (4096,)),
)
KINDS = (("pallas_mosaic_gpu", "h100"), ("pallas_tpu", "v5e"), ("pallas_tpu", "v6e"))
BACKWARDS = ("bf16", "fp8")
# (model, layer, E, K, N of each stack, rows = tokens x top-k)
GROUPED = (
    ("Qwen3-30B-A3B", "experts gate+up", 128, 2048, (768, 768), 4096 * 8),
    ("Qwen3-30B-A3B", "experts down", 128, 768, (2048,), 4096 * 8),
)


def train_gemms(x, w, dy, *, cfg: TrainMatmulConfig):
    """``(y, dx, dw)`` of one linear layer: the forward and its straight-through backward."""
    y, vjp = jax.vjp(lambda a, b: fp8_train_matmul(a, b, cfg), x, w)
    return (y, *vjp(dy))


def grouped_train_gemms(x, ws, dy, group_sizes_E, *, cfg: TrainMatmulConfig):
    """``(y, dx, dws)`` of one expert stack set: the W8A8 grouped forward and its FP8 backward."""
    y, vjp = jax.vjp(lambda a, b: grouped_fp8_train_matmul(a, b, group_sizes_E, cfg), x, ws)
    return (y, *vjp(dy))


def _grouped_cases() -> list[AotCase]:
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    out = []
    for impl, target in KINDS:
        for model, layer, e, k, ns, rows in GROUPED:
            cfg = TrainMatmulConfig(backward="fp8", impl=impl)
            ws = tuple(sds((e, k, n), bf16) for n in ns)
            dy = sds((rows, sum(ns)), bf16)
            args = (sds((rows, k), bf16), ws, dy, sds((e,), jnp.int32))
            n = "+".join(map(str, ns))
            label = f"{model} {layer} E={e} K={k} N={n} rows={rows} (fp8 backward, grouped)"
            fn = functools.partial(grouped_train_gemms, cfg=cfg)
            out.append(AotCase("fp8_train_matmul", impl, target, label, fn, args))
    return out


def cases() -> list[AotCase]:
    """Every (kernel, target) x layer x token count x backward, then the grouped experts."""
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    out = []
    for impl, target in KINDS:
        for model, layer, k, n, ms in LAYERS:
            for m in ms:
                for backward in BACKWARDS:
                    cfg = TrainMatmulConfig(backward=backward, impl=impl)
                    args = (sds((m, k), bf16), sds((k, n), bf16), sds((m, n), bf16))
                    label = f"{model} {layer} K={k} N={n} M={m} ({backward} backward)"
                    fn = functools.partial(train_gemms, cfg=cfg)
                    out.append(AotCase("fp8_train_matmul", impl, target, label, fn, args))
    return out + _grouped_cases()
