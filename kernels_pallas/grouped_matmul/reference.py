"""The BF16 grouped matmul's semantics: ``jax.lax.ragged_dot`` and its weight gradient.

``y_m = x_m · w[e(m)]`` for rows ``x [M, K]`` sorted by group (``group_sizes_E``, ``Σ <= M``; rows
past the sum give zeros), weights ``w [E, K, N]``, f32 accumulation. Its gradients:

  * ``dx_m = dy_m · w[e(m)]ᵀ`` (the same grouped product against the transposed stacks);
  * ``dw_e = Σ_{m ∈ e} x_mᵀ · dy_m`` (a contraction over each group's rows: the "transposed"
    ragged dot; rows past the sum contribute nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul_reference(x_MK, w_EKN, group_sizes_E, out_dtype=None) -> jax.Array:
    """``jax.lax.ragged_dot`` with f32 accumulation (HIGHEST precision for f32 operands)."""
    prec = jax.lax.Precision.HIGHEST if w_EKN.dtype == jnp.float32 else None
    y = jax.lax.ragged_dot(x_MK.astype(w_EKN.dtype), w_EKN, group_sizes_E.astype(jnp.int32),
                           precision=prec, preferred_element_type=jnp.float32)  # fmt: skip
    return y.astype(out_dtype or x_MK.dtype)


def grouped_wgrad_reference(x_MK, dy_MN, group_sizes_E) -> jax.Array:
    """``dw_e = Σ_{m ∈ e} x_mᵀ dy_m`` [E, K, N] in f32 at HIGHEST precision (a one-hot einsum:
    dense over the groups, a reference, not a fast path)."""
    e = group_sizes_E.shape[0]
    gs = group_sizes_E.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    g_M = jnp.searchsorted(ends, jnp.arange(x_MK.shape[0]), side="right")  # E past the groups
    onehot_ME = jax.nn.one_hot(g_M, e, dtype=jnp.float32)  # all-zero rows past Σ sizes
    return jnp.einsum("me,mk,mn->ekn", onehot_ME, x_MK.astype(jnp.float32),
                      dy_MN.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)  # fmt: skip
