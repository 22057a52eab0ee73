"""Pure-jnp reference for single-token (decode) attention over a KV cache, FP8 or not."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dequantize_kv(x_BSKC: jax.Array, scale: jax.Array | None) -> jax.Array:
    """``x̂ · s`` in f32; ``scale``: None, per tensor [], per KV head [K] or per slot [B, K, S]."""
    x = x_BSKC.astype(jnp.float32)
    if scale is None:
        return x
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim <= 1:
        return x * scale[..., None]  # [] or [K] broadcast over [B, S, K, C]
    b, s, n_kv, _ = x_BSKC.shape
    if scale.shape != (b, n_kv, s):
        raise ValueError(f"dynamic scale must be [B, K, S] = {(b, n_kv, s)}, got {scale.shape}")
    return x * jnp.swapaxes(scale, 1, 2)[..., None]


def live_mask(starts_B: jax.Array | None, lengths_B: jax.Array, s: int) -> jax.Array:
    """[B, S] bool: slot ``s`` of row ``b`` is live iff ``starts_B[b] <= s < lengths_B[b]``."""
    slot_S = jnp.arange(s, dtype=jnp.int32)[None, :]
    live = slot_S < lengths_B.astype(jnp.int32)[:, None]
    if starts_B is not None:
        live &= slot_S >= starts_B.astype(jnp.int32)[:, None]
    return live


def decode_attention_reference(
    q_BHC: jax.Array,
    k_BSKC: jax.Array,
    v_BSKC: jax.Array,
    lengths_B: jax.Array,
    *,
    starts_B: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float,
) -> jax.Array:
    """One query per row attending over the row's live cache slots, with GQA (H = K · group).

    ``o_{b,h} = Σ_s softmax_s(sm_scale · q_{b,h} · K_{b,s,k(h)}) V_{b,s,k(h)}`` over the slots
    ``starts_B[b] <= s < lengths_B[b]`` (``starts_B`` None: 0), where ``K = K̂ · s_K`` and
    ``V = V̂ · s_V`` are dequantized in float32 and ``k(h) = h // group``. A row with no live slot
    returns zeros. Output dtype is ``q``'s. Reads the whole allocation (an oracle, not a kernel).
    """
    b, h, c = q_BHC.shape
    s, n_kv = k_BSKC.shape[1], k_BSKC.shape[2]
    if h % n_kv:
        raise ValueError(f"decode_attention: {h} query heads not a multiple of {n_kv} KV heads")
    q_BKGC = q_BHC.astype(jnp.float32).reshape(b, n_kv, h // n_kv, c)
    k_BSKC = dequantize_kv(k_BSKC, k_scale)
    v_BSKC = dequantize_kv(v_BSKC, v_scale)
    s_BKGS = jnp.einsum("bkgc,bskc->bkgs", q_BKGC, k_BSKC, precision="highest") * sm_scale
    live_B11S = live_mask(starts_B, lengths_B, s)[:, None, None, :]
    s_BKGS = jnp.where(live_B11S, s_BKGS, -jnp.inf)
    m_BKG1 = jnp.max(s_BKGS, axis=-1, keepdims=True)
    p_BKGS = jnp.where(live_B11S, jnp.exp(s_BKGS - jnp.where(jnp.isfinite(m_BKG1), m_BKG1, 0)), 0)
    l_BKG1 = jnp.sum(p_BKGS, axis=-1, keepdims=True)
    o_BKGC = jnp.einsum("bkgs,bskc->bkgc", p_BKGS, v_BSKC, precision="highest")
    o_BKGC = o_BKGC / jnp.where(l_BKG1 > 0, l_BKG1, 1.0)
    return o_BKGC.reshape(b, h, c).astype(q_BHC.dtype)
