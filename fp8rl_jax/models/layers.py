"""Building blocks: RMSNorm, SwiGLU MLP, biased linear (Array or QArray weights)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.models.fused import GATE_UP, split_gate_up
from fp8rl_jax.quant import matmul


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """``w · x / sqrt(mean(x²) + eps)`` (Zhang & Sennrich 2019), f32 math, HF cast order.

    As in HF, the normalized activations are cast back to ``x``'s dtype before the weight multiply.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w * normed.astype(x.dtype)).astype(x.dtype)


def linear(x: jax.Array, w, bias: jax.Array | None = None, *, impl: str = "auto") -> jax.Array:
    """``x @ w (+ bias)`` in ``x``'s dtype; ``w`` may be a QArray (blockwise W8A8 by ``impl``)."""
    y = matmul(x, w, impl=impl)
    return y if bias is None else y + bias.astype(y.dtype)


def swiglu_mlp(p: dict, x: jax.Array, *, impl: str = "auto") -> jax.Array:
    """``W_down (silu(x W_gate) ⊙ x W_up)`` (Shazeer 2020, arXiv 2002.05202); a fused
    ``w_gate_up`` (``models.fused``) runs both input GEMMs as one."""
    if GATE_UP in p:
        gate, up = split_gate_up(linear(x, p[GATE_UP], impl=impl), p[GATE_UP].block_shape[0])
    else:
        gate, up = linear(x, p["w_gate"], impl=impl), linear(x, p["w_up"], impl=impl)
    return linear(jax.nn.silu(gate) * up, p["w_down"], impl=impl)
