"""Reference grouped blockwise FP8 W8A8 matmul in pure jnp (the numerics oracle), operand rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.qarray import FP8_DTYPES, QArray, dequantize, dequantize_weight


def stacks(w_q) -> tuple[QArray, ...]:
    """The weight stacks of a ``w_q`` operand: one QArray, or a tuple concatenated along N."""
    return tuple(w_q) if isinstance(w_q, tuple | list) else (w_q,)


def _weights_error(ws: tuple[QArray, ...]) -> str | None:
    for w in ws:
        if not isinstance(w, QArray) or w.ndim != 3 or len(w.block_shape) != 2:
            return "w_q must be a rank-3 QArray [E, N, K] with a 2-D block_shape (quantize_weight)"
        if w.values.dtype.name not in FP8_DTYPES:
            return f"w_q.values must be an FP8 dtype {sorted(FP8_DTYPES)}, got {w.values.dtype}"
        if w.scales.dtype != jnp.float32:
            return f"w_q.scales must be float32, got {w.scales.dtype}"
    w0 = ws[0]
    for w in ws[1:]:
        same = (w.shape[0], w.shape[2], w.block_shape, w.values.dtype)
        if same != (w0.shape[0], w0.shape[2], w0.block_shape, w0.values.dtype):
            return (
                "stacked weights must share E, K, block_shape and FP8 format, got "
                f"{w0.shape} {w0.block_shape} {w0.values.dtype} and {w.shape} {w.block_shape} "
                f"{w.values.dtype}"
            )
    return None


def operand_error(x, w_q, group_sizes_E) -> str | None:
    """Why ``(x, w_q, group_sizes_E)`` are not operands of ``grouped_fp8_matmul``, or None.

    ``x``: a QArray [M, K] with (g,) groups, or a floating array [M, K], rows sorted by group;
    ``w_q``: a QArray [E, N, K] with a (bn, bk) block shape (K-major expert stacks, scales
    [E, N/bn, K/bk]) and ``g == bk``, or a tuple of such stacks [E, N_i, K] (one product over
    their concatenation along N, e.g. gate and up); ``group_sizes_E``: an integer array [E]
    (sum <= M).
    """
    if not stacks(w_q):
        return "w_q must be a QArray or a non-empty tuple of QArrays"
    if (reason := _weights_error(stacks(w_q))) is not None:
        return reason
    w_q = stacks(w_q)[0]
    if isinstance(x, QArray):
        if x.ndim != 2 or len(x.block_shape) != 1:
            return "x_q must be a QArray [M, K] with per-token groups (g,)"
        if x.values.dtype.name not in FP8_DTYPES:
            return f"x_q.values must be an FP8 dtype {sorted(FP8_DTYPES)}, got {x.values.dtype}"
        if x.scales.dtype != jnp.float32:
            return f"x_q.scales must be float32, got {x.scales.dtype}"
        if x.block_shape[0] != w_q.block_shape[1]:
            return (
                f"activation group {x.block_shape[0]} must equal the weight K block "
                f"{w_q.block_shape[1]}"
            )
    elif x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        return f"x must be a QArray or a floating array [M, K], got {x.shape} {x.dtype}"
    if x.shape[-1] != w_q.shape[2]:
        return f"contracting dims differ: x K={x.shape[-1]}, w K={w_q.shape[2]} (w_q is [E, N, K])"
    gs = group_sizes_E
    if gs.ndim != 1 or gs.shape[0] != w_q.shape[0] or not jnp.issubdtype(gs.dtype, jnp.integer):
        return (
            f"group_sizes_E must be an integer array [E={w_q.shape[0]}], got {gs.shape} {gs.dtype}"
        )
    return None


def check_operands(x, w_q, group_sizes_E, where: str = "grouped_fp8_matmul") -> None:
    """Raises ``ValueError`` naming the broken rule of ``operand_error``."""
    if (reason := operand_error(x, w_q, group_sizes_E)) is not None:
        raise ValueError(f"{where}: {reason}")


def grouped_fp8_matmul_reference(
    x_q: QArray, w_q, group_sizes_E: jax.Array, *, out_dtype=jnp.bfloat16
) -> jax.Array:
    """``y_{m,n} = Σ_g s^x_{m,g} · s^w_{e(m),n,g} · (x̂_{m,g} · ŵ_{e(m),n,g})``, FP32 accumulation.

    Grouped blockwise W8A8 (DeepSeek-V3 tiles; FP8-RL paper arXiv 2601.18150 §3.1) for experts:
    row m belongs to expert ``e(m)``, the e with ``Σ_{e'<e} |e'| <= m < Σ_{e'<=e} |e'|``
    (``|e|`` = ``group_sizes_E[e]``); rows past ``Σ_e |e|`` are zero. Each FP8 value times its FP32
    scale is exact in FP32, so ``ragged_dot`` of the dequantized operands at HIGHEST precision is
    the per-group promoted sum up to FP32 rounding. A tuple of stacks is one product over
    their concatenation along N. (On XLA:GPU ``ragged_dot`` expands into E zero-padded dense
    dots, openxla/xla#45996: an oracle, not a fast path.)
    """
    check_operands(x_q, w_q, group_sizes_E, "grouped_fp8_matmul_reference")
    w_EKN = jnp.concatenate([dequantize_weight(w, jnp.float32) for w in stacks(w_q)], axis=-1)
    y = jax.lax.ragged_dot(
        dequantize(x_q, jnp.float32),
        w_EKN,
        group_sizes_E.astype(jnp.int32),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype)
