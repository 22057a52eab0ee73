"""QArray: FP8 values travel with their FP32 block scales.

A QArray quantizes the trailing ``len(block_shape)`` axes of an array in blocks; leading axes (for
example the expert axis of stacked MoE weights) have block size 1. ``values`` keep the logical
shape (no padding is stored); ``scales`` have shape ``leading + ceil(trailing / block_shape)``, tail
blocks being partial. Dequantization is ``values * scales`` broadcast over each block.

Layout convention: **the contraction axis is last in every QArray** (8-bit wgmma reads both
operands K-major, and the TPU kernel contracts on the lane axis):
  * weights ``w[..., N, K]`` (out x in: the HF / DeepGEMM / vLLM layout) with
    ``block_shape=(128, 128)`` = (N block, K block) and scales ``[..., N/128, K/128]``; MoE expert
    stacks are ``[E, N, K]``. Plain BF16/F32 training weights stay ``[..., K, N]`` (in x out):
    ``quantize_weight`` takes that layout and transposes while it quantizes (one pass);
  * activations ``x[..., K]``: ``block_shape=(128,)``, i.e. per-token groups of 128 (1x128 tiles).
``dequantize`` always returns the stored layout, so ``dequantize(quantize_weight(w_KN))`` is
``[..., N, K]`` (``≈ w_KN.mT``); ``dequantize_weight`` returns the training layout ``[..., K, N]``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

FP8_DTYPES = {
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
}
# Scale floor: keeps all-zero blocks finite (0 / tiny == 0 exactly) and well above f32 denormals,
# which XLA flushes to zero on CPU/GPU.
SCALE_TINY = 1e-12


def fp8_dtype(dtype) -> jnp.dtype:
    """Normalizes a dtype or its name to one of the supported FP8 dtypes."""
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    if name not in FP8_DTYPES:
        raise ValueError(f"unsupported FP8 dtype {dtype!r}; expected one of {sorted(FP8_DTYPES)}")
    return jnp.dtype(FP8_DTYPES[name])


def fp8_max(dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(jnp.finfo(fp8_dtype(dtype)).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """FP8 ``values`` with FP32 block ``scales``; ``x ~= values * scales`` blockwise."""

    values: jax.Array
    scales: jax.Array
    block_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))  # dtype before quantization

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def nbytes(self) -> int:
        return self.values.size * self.values.dtype.itemsize + self.scales.size * 4

    def __getitem__(self, idx) -> QArray:
        """Indexes leading (unblocked) axes only, e.g. one expert of a stacked weight."""
        n_lead = self.values.ndim - len(self.block_shape)
        idx_t = idx if isinstance(idx, tuple) else (idx,)
        if len(idx_t) > n_lead:
            raise IndexError(f"QArray can only index its {n_lead} leading unblocked axes")
        return QArray(self.values[idx], self.scales[idx], self.block_shape, self.dtype)


def scales_shape(shape: tuple[int, ...], block_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the scale array for ``shape`` quantized in ``block_shape`` blocks."""
    n = len(block_shape)
    if n == 0 or n > len(shape):
        raise ValueError(f"block_shape {block_shape} must cover 1..{len(shape)} trailing axes")
    if any(b <= 0 for b in block_shape):
        raise ValueError(f"block sizes must be positive, got {block_shape}")
    lead, trail = shape[: len(shape) - n], shape[len(shape) - n :]
    return tuple(lead) + tuple(math.ceil(d / b) for d, b in zip(trail, block_shape, strict=True))


def expand_scales(scales: jax.Array, shape: tuple[int, ...], block_shape: tuple[int, ...]):
    """Repeats block scales to the full ``shape`` (tail blocks cut to size)."""
    n = len(block_shape)
    out = scales
    for i, b in enumerate(block_shape):
        axis = len(shape) - n + i
        out = jnp.repeat(out, b, axis=axis, total_repeat_length=out.shape[axis] * b)
        out = jax.lax.slice_in_dim(out, 0, shape[axis], axis=axis)
    return out


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
    """``x ~= values * scales`` (computed in FP32, then cast to ``dtype``)."""
    s = expand_scales(q.scales, q.values.shape, q.block_shape)
    return (q.values.astype(jnp.float32) * s).astype(dtype)


def dequantize_weight(w_q: QArray, dtype=jnp.float32) -> jax.Array:
    """A weight QArray ``[..., N, K]`` back in the training layout ``[..., K, N]``."""
    if len(w_q.block_shape) != 2:
        raise ValueError(f"dequantize_weight: not a weight QArray (block_shape {w_q.block_shape})")
    return jnp.swapaxes(dequantize(w_q, dtype), -1, -2)
