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


def _tiles_f64(a_RC: np.ndarray, group_sizes, dtype) -> np.ndarray:
    """``a`` through FP8 in 128-token tiles restarting at every expert (float64 values x̂ · s).

    NumPy, in ``quantize_activations``' f32 arithmetic (``inv = fp8_max / max(amax, tiny)``,
    ``x̂ = cast(clip(x · inv))``, ``s = max(amax, tiny) / fp8_max``) per tile and column.
    """
    from kernels_pallas.fp8_train_matmul.api import GROUP
    from kernels_pallas.qarray import SCALE_TINY, fp8_dtype, fp8_max

    f32, m = np.float32, np.float32(fp8_max(dtype))
    out, start = np.zeros(a_RC.shape, np.float64), 0
    for size in (int(g) for g in group_sizes):
        for t in range(start, start + size, GROUP):
            tile = np.asarray(a_RC[t : min(t + GROUP, start + size)], f32)
            amax = np.maximum(np.max(np.abs(tile), axis=0), f32(SCALE_TINY))
            q = np.clip(tile * (m / amax), -m, m).astype(fp8_dtype(dtype))
            out[t : t + len(tile)] = q.astype(np.float64) * (amax / m).astype(np.float64)
        start += size
    return out


def grouped_train_grads_reference(x_RD, ws_EDF, dys_RF, group_sizes, cfg):
    """``(dx, (dw_i, ...))`` in float64 for the FP8 backward of the grouped expert GEMM.

    Row r of expert e(r) (rows sorted by expert, ``group_sizes`` rows each): ``dx_r = Σ_i
    q₁ₓ₁₂₈(dy_i)_r · ŵ_{i,e(r)}`` (the forward's 128x128-block weights), ``dw_{i,e} = Σ_{r ∈ e}
    q_t(x)_rᵀ · q_t(dy_i)_r`` with q_t the 128-token tiles of each expert's rows
    (``kernels_pallas.fp8_train_matmul.grouped``). Rows past Σ sizes get dx = 0.
    """
    from kernels_pallas.fp8_train_matmul.api import GROUP, quantize_train_weight

    sizes = [int(g) for g in group_sizes]
    bounds = np.cumsum([0, *sizes])
    x_hat = _tiles_f64(np.asarray(x_RD, np.float32), sizes, cfg.dtype)
    dx = np.zeros(np.shape(x_RD), np.float64)
    dws = []
    for w, dy in zip(ws_EDF, dys_RF, strict=True):
        w_q = _f64(quantize_train_weight(w, cfg))  # [E, F, D]
        dy_q = _f64(quantize_activations(np.asarray(dy, np.float32), GROUP, cfg.dtype))
        dy_t = _tiles_f64(np.asarray(dy, np.float32), sizes, cfg.dtype)
        dw = np.zeros(np.shape(w), np.float64)
        for e in range(len(sizes)):
            a, b = bounds[e], bounds[e + 1]
            dx[a:b] += dy_q[a:b] @ w_q[e]
            dw[e] = x_hat[a:b].T @ dy_t[a:b]
        dws.append(dw)
    return dx, tuple(dws)
