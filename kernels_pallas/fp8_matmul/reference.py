"""Reference blockwise FP8 W8A8 matmul in pure jnp (also the CPU path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.qarray import QArray, dequantize


def fp8_matmul_reference(x_q: QArray, w_q: QArray, *, out_dtype=jnp.bfloat16) -> jax.Array:
    """``y_{t,n} = Σ_g s^x_{t,g} · s^w_{g,n} · (x̂_{t,g} · ŵ_{g,n})`` with FP32 accumulation.

    Blockwise W8A8 (DeepSeek-V3 tiles; FP8-RL paper arXiv 2601.18150 §3.1). Each product of an
    FP8 value with its FP32 scale is formed in FP32, so ``dequant(x) @ dequant(w)`` at HIGHEST
    precision equals the per-group promoted sum up to FP32 rounding. ``x_q``: [M, K] with scales
    [M, K/g]; ``w_q``: [K, N] with scales [K/bk, N/bn].
    """
    x = dequantize(x_q, jnp.float32)
    w = dequantize(w_q, jnp.float32)
    y = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)
