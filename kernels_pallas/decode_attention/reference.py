"""Pure-jnp reference for single-token (decode) attention over a KV cache, FP8 or not."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dequantize_kv(x_BSKC: jax.Array, scale: jax.Array | None) -> jax.Array:
    """``x̂ · s`` in f32; ``scale``: None, per tensor [], per KV head [K] or per slot [B, S, K]."""
    x = x_BSKC.astype(jnp.float32)
    if scale is None:
        return x
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim <= 1:
        return x * scale[..., None]  # [] or [K] broadcast over [B, S, K, C]
    if scale.shape != x_BSKC.shape[:3]:
        raise ValueError(f"dynamic scale must be [B, S, K] = {x_BSKC.shape[:3]}, got {scale.shape}")
    return x * scale[..., None]


def decode_attention_reference(
    q_BHC: jax.Array,
    k_BSKC: jax.Array,
    v_BSKC: jax.Array,
    valid_BS: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float,
) -> jax.Array:
    """One query per row attending over the valid cache slots, with GQA (H = K · group).

    ``o_{b,h} = Σ_s softmax_s(sm_scale · q_{b,h} · K_{b,s,k(h)}) V_{b,s,k(h)}`` over slots with
    ``valid_BS[b, s]``, where ``K = K̂ · s_K`` and ``V = V̂ · s_V`` are dequantized in float32 and
    ``k(h) = h // group``. A row with no valid slot returns zeros. Output dtype is ``q``'s.
    """
    b, h, c = q_BHC.shape
    n_kv = k_BSKC.shape[2]
    if h % n_kv:
        raise ValueError(f"decode_attention: {h} query heads not a multiple of {n_kv} KV heads")
    q_BKGC = q_BHC.astype(jnp.float32).reshape(b, n_kv, h // n_kv, c)
    k_BSKC = dequantize_kv(k_BSKC, k_scale)
    v_BSKC = dequantize_kv(v_BSKC, v_scale)
    s_BKGS = jnp.einsum("bkgc,bskc->bkgs", q_BKGC, k_BSKC, precision="highest") * sm_scale
    valid_B11S = valid_BS[:, None, None, :]
    s_BKGS = jnp.where(valid_B11S, s_BKGS, -jnp.inf)
    m_BKG1 = jnp.max(s_BKGS, axis=-1, keepdims=True)
    p_BKGS = jnp.where(valid_B11S, jnp.exp(s_BKGS - jnp.where(jnp.isfinite(m_BKG1), m_BKG1, 0)), 0)
    l_BKG1 = jnp.sum(p_BKGS, axis=-1, keepdims=True)
    o_BKGC = jnp.einsum("bkgs,bskc->bkgc", p_BKGS, v_BSKC, precision="highest")
    o_BKGC = o_BKGC / jnp.where(l_BKG1 > 0, l_BKG1, 1.0)
    return o_BKGC.reshape(b, h, c).astype(q_BHC.dtype)
