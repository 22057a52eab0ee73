"""One matmul for BF16 and FP8 weights: model code stays the same when the policy is quantized."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.quant.train import TrainQWeight
from kernels_pallas.fp8_matmul import fp8_matmul
from kernels_pallas.fp8_train_matmul import fp8_train_matmul
from kernels_pallas.qarray import QArray


def matmul(x_TK: jax.Array, w, *, out_dtype=None, impl: str = "auto") -> jax.Array:
    """``x @ w`` over the last axis of ``x``; a QArray weight runs the blockwise W8A8 path.

    A plain weight is ``[K, N]`` (training layout) and the product runs in its dtype with FP32
    accumulation. A QArray weight is ``[N, K]`` (``quantize_weight``, K-major for the FP8
    kernels): the activations are quantized per token (1 x K-block groups, the weight's FP8
    format) and ``fp8_matmul`` (``impl``) applies both scales per K group. The output dtype
    defaults to ``x``'s. A ``TrainQWeight`` (``rl.train_precision="fp8_rollout"``) runs the
    QArray path of its rollout copy with straight-through gradients (``fp8_train_matmul``).
    """
    out_dtype = jnp.dtype(out_dtype or x_TK.dtype)
    if isinstance(w, TrainQWeight):
        return fp8_train_matmul(x_TK, w.w, w.cfg).astype(out_dtype)
    if isinstance(w, QArray):
        return fp8_matmul(x_TK, w, out_dtype=out_dtype, impl=impl)
    y = jnp.einsum(
        "...k,kn->...n",
        x_TK.astype(w.dtype),
        w,
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None,
    )
    return y.astype(out_dtype)
