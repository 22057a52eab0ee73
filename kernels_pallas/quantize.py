"""Blockwise FP8 quantization in pure jnp: the reference for every kernel's fused quantization."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.qarray import SCALE_TINY, QArray, fp8_dtype, fp8_max, scales_shape


def _pad_trailing(x: jax.Array, block_shape: tuple[int, ...]) -> jax.Array:
    n = len(block_shape)
    pads = [(0, 0)] * (x.ndim - n)
    pads += [(0, -d % b) for d, b in zip(x.shape[x.ndim - n :], block_shape, strict=True)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def _blocked(x: jax.Array, block_shape: tuple[int, ...]) -> jax.Array:
    """[..., d1, d2] -> [..., d1/b1, b1, d2/b2, b2] (trailing axes split into blocks)."""
    n = len(block_shape)
    lead = x.shape[: x.ndim - n]
    new = list(lead)
    for d, b in zip(x.shape[x.ndim - n :], block_shape, strict=True):
        new += [d // b, b]
    return x.reshape(new)


def block_amax(x: jax.Array, block_shape: tuple[int, ...]) -> jax.Array:
    """max |x| over each block (FP32), shape ``scales_shape(x.shape, block_shape)``."""
    n = len(block_shape)
    xb = _blocked(_pad_trailing(jnp.abs(x.astype(jnp.float32)), block_shape), block_shape)
    lead = x.ndim - n
    return jnp.max(xb, axis=tuple(lead + 2 * i + 1 for i in range(n)))


def inverse_fp8_max(dtype) -> np.float32:
    """``rn(1 / fp8_max)`` in f32: what XLA's algebraic simplifier multiplies by when it rewrites
    a division by the constant ``fp8_max`` (on every backend), so kernels can match it."""
    return np.float32(1) / np.float32(fp8_max(dtype))


def amax_to_scale(amax: jax.Array, dtype, pow2_scales: bool = False) -> jax.Array:
    """``s = max(amax, tiny) / fp8_max``, written as XLA computes it (``· inverse_fp8_max``);
    ``pow2_scales`` rounds up to a power of two (UE8M0)."""
    s = jnp.maximum(amax.astype(jnp.float32), SCALE_TINY) * inverse_fp8_max(dtype)
    if pow2_scales:
        s = jnp.exp2(jnp.ceil(jnp.log2(s)))
    return s


def saturating_cast(x_scaled: jax.Array, dtype) -> jax.Array:
    """Clamp to +-fp8_max, then round-to-nearest-even cast (never overflows to NaN)."""
    m = fp8_max(dtype)
    return jnp.clip(x_scaled, -m, m).astype(fp8_dtype(dtype))


def _raise_if_nonfinite_eager(x) -> None:
    """Eagerly, NaN/Inf input is an error (it would poison a whole block's scale); under jit the
    caller counts it instead (``quantize_params`` returns the count in ``QuantStats``)."""
    if isinstance(x, jax.core.Tracer):
        return
    bad = int(jnp.sum(~jnp.isfinite(x)))
    if bad:
        raise ValueError(f"quantize: input of shape {x.shape} has {bad} NaN/Inf entries")


def quantize_blockwise(
    x: jax.Array,
    block_shape: tuple[int, ...] = (128, 128),
    dtype=jnp.float8_e4m3fn,
    *,
    pow2_scales: bool = False,
) -> QArray:
    """Blockwise FP8 quantization of the trailing axes of ``x``.

    ``s_b = max(amax_b, tiny) / fp8_max`` (FP32), ``x̂ = cast(clamp(x / s_b, ±fp8_max))``
    (DeepSeek-V3 128x128 weight blocks; FP8-RL paper, arXiv 2601.18150, §3.1).
    """
    block_shape = tuple(int(b) for b in block_shape)
    scales_shape(x.shape, block_shape)  # validates block_shape against x
    _raise_if_nonfinite_eager(x)
    scales = amax_to_scale(block_amax(x, block_shape), dtype, pow2_scales)
    n = len(block_shape)
    x_pad = _pad_trailing(x.astype(jnp.float32), block_shape)
    # scales broadcast over the block axes of the blocked view [..., d1/b1, 1, d2/b2, 1].
    sb = scales.reshape(
        scales.shape[: x.ndim - n] + sum(((d, 1) for d in scales.shape[x.ndim - n :]), ())
    )
    qb = saturating_cast(_blocked(x_pad, block_shape) / sb, dtype)
    q = qb.reshape(x_pad.shape)[tuple(slice(0, d) for d in x.shape)]
    return QArray(q, scales, block_shape, jnp.dtype(x.dtype))


def quantize_activations(x: jax.Array, group_size: int = 128, dtype=jnp.float8_e4m3fn) -> QArray:
    """Dynamic per-token FP8 quantization in groups of ``group_size`` along the last axis (1x128).

    ``s_{t,g} = amax_{c in g} |x_{t,c}| / fp8_max`` (DeepSeek-V3 activation tiles) and
    ``x̂ = cast(clamp(x · (fp8_max / max(amax, tiny)), ±fp8_max))``: one division per group, a
    multiply per element (no IEEE division per element on the hot path; XLA fuses the whole
    thing, amax reduce included, into the activations' producer or one small fusion). Equal to
    ``quantize_blockwise(x, (group_size,))`` up to one f32 rounding of the scaled value.
    """
    scales_shape(x.shape, (group_size,))  # validates group_size against x
    _raise_if_nonfinite_eager(x)
    amax = block_amax(x, (group_size,))
    scales = amax_to_scale(amax, dtype)
    inv = fp8_max(dtype) / jnp.maximum(amax.astype(jnp.float32), SCALE_TINY)  # [..., G]
    x_pad = _pad_trailing(x.astype(jnp.float32), (group_size,))
    xb = _blocked(x_pad, (group_size,))  # [..., G, group]
    q = saturating_cast(xb * inv[..., None], dtype).reshape(x_pad.shape)[..., : x.shape[-1]]
    return QArray(q, scales, (group_size,), jnp.dtype(x.dtype))


def quantize_weight(
    w: jax.Array,
    block_shape: tuple[int, int] = (128, 128),
    dtype=jnp.float8_e4m3fn,
    *,
    pow2_scales: bool = False,
) -> QArray:
    """Rollout copy of a training weight ``w[..., K, N]``: a QArray ``[..., N, K]`` (K-major).

    ``block_shape`` is ``(K block, N block)``, in the order of ``w``'s axes; the QArray's
    ``block_shape`` is ``(N block, K block)`` (see ``qarray.py``). The transpose is part of the
    quantization pass (XLA fuses it into the amax and cast fusions), so the K-major layout the FP8
    kernels need costs no extra pass. Same formula as ``quantize_blockwise``.
    """
    if w.ndim < 2 or len(block_shape) != 2:
        raise ValueError(
            f"quantize_weight: needs a weight [..., K, N] and a (K, N) block, got {w.shape} "
            f"and {block_shape}"
        )
    bk, bn = (int(b) for b in block_shape)
    return quantize_blockwise(jnp.swapaxes(w, -1, -2), (bn, bk), dtype, pow2_scales=pow2_scales)
