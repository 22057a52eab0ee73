"""The producers whose outputs the FP8 GEMMs quantize, and their quantized forms in pure jnp.

``rms_norm`` is the model's RMSNorm (``fp8rl_jax.models.layers`` re-exports it); the
``*_quantize_reference`` functions are the exact math the fused kernels (``fused.py``) compute:
the producer in the activations' dtype, then ``quantize_activations`` (per-token 1x128 groups).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.qarray import QArray
from kernels_pallas.quantize import quantize_activations

GROUP = 128


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """``w · x / sqrt(mean(x²) + eps)`` (Zhang & Sennrich 2019), f32 math, HF cast order.

    As in HF, the normalized activations are cast back to ``x``'s dtype before the weight multiply.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w * normed.astype(x.dtype)).astype(x.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) ⊙ up`` (Shazeer 2020, arXiv 2002.05202) in the inputs' dtype."""
    return jax.nn.silu(gate) * up


def split_gate_up(y: jax.Array, block_n: int = GROUP) -> tuple[jax.Array, jax.Array]:
    """The fused gate|up GEMM's output ``[..., 2F]`` (gate and up in alternating ``block_n``
    column blocks, ``fp8rl_jax.models.fused``) -> gate and up ``[..., F]``."""
    *lead, two_f = y.shape
    y = y.reshape(*lead, two_f // (2 * block_n), 2, block_n)
    return y[..., 0, :].reshape(*lead, two_f // 2), y[..., 1, :].reshape(*lead, two_f // 2)


def rmsnorm_quantize_reference(x, w, eps: float, dtype=jnp.float8_e4m3fn) -> QArray:
    """``quantize_activations(rms_norm(x, w, eps))``: x [..., D] -> QArray [..., D]."""
    return quantize_activations(rms_norm(x, w, eps), GROUP, dtype)


def swiglu_quantize_reference(gate, up, dtype=jnp.float8_e4m3fn) -> QArray:
    """``quantize_activations(swiglu(gate, up))``: [..., F] -> QArray [..., F]."""
    return quantize_activations(swiglu(gate, up), GROUP, dtype)
