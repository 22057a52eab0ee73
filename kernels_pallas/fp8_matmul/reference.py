"""Reference blockwise FP8 W8A8 matmul in pure jnp (the numerics oracle), and the operand rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.qarray import FP8_DTYPES, QArray, dequantize


def operand_error(x, w_q) -> str | None:
    """Why ``(x, w_q)`` are not operands of ``fp8_matmul``, or None: the one place the operand
    contract (ranks, block shapes, dtypes, the contracting dimension) is written down.

    ``x``: a QArray [..., K] with (g,) groups, or a floating array [..., K]; ``w_q``: a QArray
    [N, K] with a (bn, bk) block shape (the QArray weight convention) and ``g == bk``.
    """
    if not isinstance(w_q, QArray) or w_q.ndim != 2 or len(w_q.block_shape) != 2:
        return "w_q must be a rank-2 QArray [N, K] with a 2-D block_shape (use quantize_weight)"
    if w_q.values.dtype.name not in FP8_DTYPES:
        return f"w_q.values must be an FP8 dtype {sorted(FP8_DTYPES)}, got {w_q.values.dtype}"
    if w_q.scales.dtype != jnp.float32:
        return f"w_q.scales must be float32, got {w_q.scales.dtype}"
    if isinstance(x, QArray):
        if x.ndim < 1 or len(x.block_shape) != 1:
            return "x_q must be a QArray [..., K] with per-token groups (g,)"
        if x.values.dtype.name not in FP8_DTYPES:
            return f"x_q.values must be an FP8 dtype {sorted(FP8_DTYPES)}, got {x.values.dtype}"
        if x.scales.dtype != jnp.float32:
            return f"x_q.scales must be float32, got {x.scales.dtype}"
        if x.block_shape[0] != w_q.block_shape[1]:
            return (
                f"activation group {x.block_shape[0]} must equal the weight K block "
                f"{w_q.block_shape[1]}"
            )
    elif not jnp.issubdtype(x.dtype, jnp.floating):
        return f"x must be a QArray or a floating array, got {x.dtype}"
    if x.shape[-1] != w_q.shape[1]:
        return f"contracting dims differ: x K={x.shape[-1]}, w K={w_q.shape[1]} (w_q is [N, K])"
    return None


def check_operands(x, w_q, where: str = "fp8_matmul") -> None:
    """Raises ``ValueError`` naming the broken rule of ``operand_error``."""
    if (reason := operand_error(x, w_q)) is not None:
        raise ValueError(f"{where}: {reason}")


def fp8_matmul_reference(x_q: QArray, w_q: QArray, *, out_dtype=jnp.bfloat16) -> jax.Array:
    """``y_{t,n} = Σ_g s^x_{t,g} · s^w_{n,g} · (x̂_{t,g} · ŵ_{n,g})`` with FP32 accumulation.

    Blockwise W8A8 (DeepSeek-V3 tiles; FP8-RL paper arXiv 2601.18150 §3.1). Each product of an
    FP8 value with its FP32 scale is formed in FP32, so ``dequant(x) · dequant(w)ᵀ`` at HIGHEST
    precision equals the per-group promoted sum up to FP32 rounding. ``x_q``: [M, K] with scales
    [M, K/g]; ``w_q``: [N, K] with scales [N/bn, K/bk] (tail blocks partial).
    """
    check_operands(x_q, w_q, "fp8_matmul_reference")
    x = dequantize(x_q, jnp.float32)
    w = dequantize(w_q, jnp.float32)
    y = jax.lax.dot_general(
        x,
        w,
        (((x.ndim - 1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype)
