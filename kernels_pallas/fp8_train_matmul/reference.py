"""Float64 reference of ``fp8_train_matmul``'s forward and gradients (the numerics oracle).

The quantizers are the library's own (``quantize_blockwise``: exact FP32 scale and cast); every
product and sum after them is formed in float64 (NumPy), so the kernel path differs from this
only by its f32 accumulation.
"""

from __future__ import annotations

import numpy as np

from kernels_pallas.qarray import dequantize
from kernels_pallas.quantize import quantize_activations, quantize_blockwise


def _f64(q) -> np.ndarray:
    return np.asarray(dequantize(q), np.float64)


def train_matmul_grads_reference(x_MK, w_KN, dy_MN, cfg):
    """``(y, dx, dw)`` in float64 for ``fp8_train_matmul(x, w, cfg)`` with cotangent ``dy``.

    ``y = Σ_k x̂_{mk} ŵ_{kn}`` (1x128 groups of x, the recipe's weight blocks). Backward ``bf16``:
    ``dx = dy · wᵀ``, ``dw = xᵀ · dy`` over the unquantized operands; ``fp8`` (DeepSeek-V3,
    arXiv 2412.19437 §3.3): ``dx = q₁ₓ₁₂₈(dy) · ŵ`` and ``dw = q₁₂₈ₓ₁(x)ᵀ · q₁₂₈ₓ₁(dy)``.
    """
    from kernels_pallas.fp8_train_matmul.api import GROUP, quantize_train_weight

    x32, w32, dy32 = (np.asarray(a, np.float32) for a in (x_MK, w_KN, dy_MN))
    w_q = quantize_train_weight(w_KN, cfg)  # [N, K]
    y = _f64(quantize_activations(x_MK, w_q.block_shape[1], cfg.dtype)) @ _f64(w_q).T
    if cfg.backward == "bf16":
        x64, w64, dy64 = (a.astype(np.float64) for a in (x32, w32, dy32))
        return y, dy64 @ w64.T, x64.T @ dy64
    dx = _f64(quantize_activations(dy_MN, GROUP, cfg.dtype)) @ _f64(w_q)
    x_t = _f64(quantize_activations(x_MK.T, GROUP, cfg.dtype))  # [K, M]
    dy_t = _f64(quantize_blockwise(dy_MN.T, (1, GROUP), cfg.dtype))  # [N, M]
    return y, dx, x_t @ dy_t.T
