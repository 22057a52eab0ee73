"""Grouped-query attention: Q/K/V projections (bias, QK-norm, RoPE) and the attention math."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.fused import QKV, split_qkv
from fp8rl_jax.models.layers import linear, rms_norm
from fp8rl_jax.models.rope import apply_rope
from kernels_pallas.quantize import saturating_cast

_MASKED = float(jnp.finfo(jnp.float32).min)  # finite: a fully masked row stays NaN-free
# Queries per block when T is longer: the f32 scores are [B, H, Q_CHUNK, S] at a time, not
# [B, H, T, S] (a 64 x 1024-token prefill over 4K slots would need 34 GB of scores at once).
Q_CHUNK = 256


def project_qkv(p: dict, x_BTD: jax.Array, cos_BTC, sin_BTC, cfg: ModelConfig, impl="auto"):
    """q [B, T, H, C], k and v [B, T, K, C]: projections, bias, QK-norm, then RoPE (as HF)."""
    B, T, _ = x_BTD.shape
    H, K, C = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if QKV in p:  # one FP8 GEMM for all three (``models.fused``), biases after the split
        q, k, v = split_qkv(linear(x_BTD, p[QKV], impl=impl), cfg)
        q, k, v = (_biased(y, p.get(f"{n}_bias")) for y, n in zip((q, k, v), "qkv", strict=True))
    else:
        q = linear(x_BTD, p["wq"], p.get("q_bias"), impl=impl).reshape(B, T, H, C)
        k = linear(x_BTD, p["wk"], p.get("k_bias"), impl=impl).reshape(B, T, K, C)
        v = linear(x_BTD, p["wv"], p.get("v_bias"), impl=impl).reshape(B, T, K, C)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos_BTC, sin_BTC), apply_rope(k, cos_BTC, sin_BTC), v


def _biased(y_BTNC: jax.Array, bias) -> jax.Array:
    """``y`` plus a flat ``[N·C]`` projection bias (as ``linear`` adds it, in ``y``'s dtype)."""
    return y_BTNC if bias is None else y_BTNC + bias.reshape(y_BTNC.shape[-2:]).astype(y_BTNC.dtype)


def fake_quantize_q(q_BTHC: jax.Array, q_scale_K: jax.Array, dtype=jnp.float8_e4m3fn):
    """Emulated FP8 attention input: ``cast_e4m3(q / s_k) · s_k``, one static scale per KV group."""
    B, T, H, C = q_BTHC.shape
    K = q_scale_K.shape[0]
    s = q_scale_K[:, None, None]  # broadcast over the group's heads and head_dim
    q = q_BTHC.astype(jnp.float32).reshape(B, T, K, H // K, C)
    q = saturating_cast(q / s, dtype).astype(jnp.float32) * s
    return q.reshape(B, T, H, C).astype(q_BTHC.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentMask:
    """The mask of ``causal_segment_mask`` kept as its segment ids: query rows are built per
    block (``rows``), so no ``[B, T, T]`` array exists (at T = 10K that is 100 MB per row, and
    XLA may keep copies of it per layer for the backward pass)."""

    segment_ids_BT: jax.Array  # 0 = padding; queries and keys are the same T tokens

    def rows(self, start, num: int) -> jax.Array:
        """[B, num, T]: the mask rows of queries ``start .. start + num - 1`` (rows past T: none
        visible, as the padding of a materialized mask)."""
        seg = self.segment_ids_BT
        T = seg.shape[1]
        q = start + jnp.arange(num)
        seg_q = jnp.take(seg, jnp.minimum(q, T - 1), axis=1)  # [B, num]
        keys = jnp.arange(T)
        causal = (keys[None, :] <= q[:, None]) & (q[:, None] < T)  # [num, T]
        same = seg_q[:, :, None] == seg[:, None, :]
        return causal[None] & same & (seg[:, None, :] != 0)


def attention(
    q_BTHC: jax.Array,
    k_BSKC: jax.Array,
    v_BSKC: jax.Array,
    mask_BTS: jax.Array | SegmentMask,
    *,
    sm_scale: float,
    q_chunk: int = Q_CHUNK,
) -> jax.Array:
    """``softmax(q kᵀ · sm_scale + mask) v`` with GQA (an FP8 cache dequantizes K/V first).

    Query head ``h`` reads KV head ``h // (H / K)``; scores and softmax are f32. More than
    ``q_chunk`` queries run in blocks of ``q_chunk`` (``lax.map``, rematerialized in the
    backward pass), so memory holds one block's scores; rows are independent, so the result is
    the same. ``mask_BTS``: a boolean array, or a ``SegmentMask`` whose rows are made per block
    (the same values; no ``[B, T, S]`` mask in memory). The decode path (T = 1 over a cache) has
    the same contract as ``kernels_pallas.decode_attention`` when each row's unmasked slots are
    one contiguous range.
    """
    B, T, H, C = q_BTHC.shape
    k, v = k_BSKC, v_BSKC
    lazy = isinstance(mask_BTS, SegmentMask)
    if q_BTHC.shape[1] <= q_chunk:
        return _attend(q_BTHC, k, v, mask_BTS.rows(0, T) if lazy else mask_BTS, sm_scale)
    n = -(-T // q_chunk)
    pad = n * q_chunk - T  # padded query rows see no slot and are dropped below
    q_nBQHC = jnp.pad(q_BTHC, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_nBQHC = q_nBQHC.reshape(B, n, q_chunk, H, C).swapaxes(0, 1)
    if lazy:  # each block makes its own mask rows, inside the rematerialized block
        xs = (q_nBQHC, jnp.arange(n) * q_chunk)
        block = jax.checkpoint(
            lambda qi: _attend(qi[0], k, v, mask_BTS.rows(qi[1], q_chunk), sm_scale)
        )
    else:
        m_nBQS = jnp.pad(mask_BTS, ((0, 0), (0, pad), (0, 0)))
        xs = (q_nBQHC, m_nBQS.reshape(B, n, q_chunk, -1).swapaxes(0, 1))
        block = jax.checkpoint(lambda qm: _attend(qm[0], k, v, qm[1], sm_scale))
    o_nBQHC = jax.lax.map(block, xs)
    return o_nBQHC.swapaxes(0, 1).reshape(B, n * q_chunk, H, C)[:, :T]


def _attend(q_BTHC, k_BSKC, v_BSKC, mask_BTS, sm_scale: float) -> jax.Array:
    """One block of ``attention`` (K/V already dequantized)."""
    B, T, H, C = q_BTHC.shape
    K = k_BSKC.shape[2]
    dt = jnp.promote_types(q_BTHC.dtype, k_BSKC.dtype)
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    q = q_BTHC.reshape(B, T, K, H // K, C).astype(dt)
    s = jnp.einsum(
        "btkgc,bskc->bkgts", q, k_BSKC.astype(dt), preferred_element_type=jnp.float32,
        precision=prec,
    )  # fmt: skip
    s = jnp.where(mask_BTS[:, None, None], s * sm_scale, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum(
        "bkgts,bskc->btkgc",
        p.astype(dt),
        v_BSKC.astype(dt),
        preferred_element_type=jnp.float32,
        precision=prec,
    )
    return o.reshape(B, T, H, C).astype(q_BTHC.dtype)


def causal_segment_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """[B, T, T]: key ≤ query, same segment, key not padding (segment 0)."""
    T = segment_ids_BT.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return causal[None] & same & (segment_ids_BT[:, None, :] != 0)


def cache_mask(valid_BS: jax.Array, slots_BT: jax.Array) -> jax.Array:
    """[B, T, S]: key slot holds a real token and is not after the query's slot."""
    S = valid_BS.shape[1]
    return valid_BS[:, None, :] & (jnp.arange(S)[None, None, :] <= slots_BT[:, :, None])


def qkv_amax(q_BTHC, k_BTKC, v_BTKC, valid_BT) -> tuple[jax.Array, jax.Array, jax.Array]:
    """max |x| over valid tokens: q per KV-head group [K], k and v per KV head [K] (f32)."""
    B, T, H, C = q_BTHC.shape
    K = k_BTKC.shape[2]
    m = valid_BT[:, :, None, None]

    def amax(x, axes):
        return jnp.max(jnp.where(m, jnp.abs(x.astype(jnp.float32)), 0.0), axis=axes)

    q_K = jnp.max(amax(q_BTHC, (0, 1)).reshape(K, H // K, C), axis=(1, 2))
    return q_K, jnp.max(amax(k_BTKC, (0, 1)), -1), jnp.max(amax(v_BTKC, (0, 1)), -1)
