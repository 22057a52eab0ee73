"""Ahead-of-time compile cases of ``fp8_train_matmul`` (forward + backward) at real shapes.

Each case compiles ``(y, dx, dw)`` of one linear layer of a train step (``jax.vjp``): the W8A8
forward and the dgrad through the target's ``fp8_matmul`` kernel (Mosaic GPU on H100, Mosaic
TPU on v5e/v6e), the wgrad through ``fp8_matmul``'s XLA path (1D1D scaling), for the BF16 and
the FP8 (DeepSeek-V3) backward. Token counts M are the rows of one training micro-batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.aot import AotCase
from kernels_pallas.fp8_train_matmul.api import TrainMatmulConfig, fp8_train_matmul

# (model, layer, K, N, token counts M)
LAYERS = (
    ("Qwen3-8B", "q_proj|o_proj", 4096, 4096, (4096,)),
    ("Qwen3-8B", "gate|up_proj", 4096, 12288, (8192,)),
    ("Qwen3-8B", "down_proj", 12288, 4096, (4096,)),
)
KINDS = (("pallas_mosaic_gpu", "h100"), ("pallas_tpu", "v5e"), ("pallas_tpu", "v6e"))
BACKWARDS = ("bf16", "fp8")


def train_gemms(x, w, dy, *, cfg: TrainMatmulConfig):
    """``(y, dx, dw)`` of one linear layer: the forward and its straight-through backward."""
    y, vjp = jax.vjp(lambda a, b: fp8_train_matmul(a, b, cfg), x, w)
    return (y, *vjp(dy))


def cases() -> list[AotCase]:
    """Every (kernel, target) x layer x token count x backward."""
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
    return out
