"""One matmul for BF16 and FP8 weights: model code stays the same when the policy is quantized."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.fp8_matmul import fp8_matmul
from kernels_pallas.qarray import QArray


def matmul(
    x_TK: jax.Array, w_KN: jax.Array | QArray, *, out_dtype=None, impl: str = "auto"
) -> jax.Array:
    """``x @ w`` over the last axis of ``x``; a QArray weight runs the blockwise W8A8 path.

    With a plain weight the product runs in the weight's dtype with FP32 accumulation; with a
    QArray the activations are quantized per token (1 x K-block groups, the weight's FP8 format)
    and ``fp8_matmul`` (``impl``) applies both scales per K group. The output dtype defaults to
    ``x``'s.
    """
    out_dtype = jnp.dtype(out_dtype or x_TK.dtype)
    if isinstance(w_KN, QArray):
        return fp8_matmul(x_TK, w_KN, out_dtype=out_dtype, impl=impl)
    y = jnp.einsum(
        "...k,kn->...n",
        x_TK.astype(w_KN.dtype),
        w_KN,
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST if w_KN.dtype == jnp.float32 else None,
    )
    return y.astype(out_dtype)
