"""Shared pieces of the decode-attention kernels: block sizes and static-scale folding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """Tile sizes of the decode kernels (static)."""

    block_s: int = 128  # cache slots per tile of the online softmax


DEFAULT_BLOCKS = DecodeBlocks()


def is_slot_scale(scale) -> bool:
    """True for a dynamic scale (one per cached vector, [B, S, K])."""
    return scale is not None and jnp.ndim(scale) == 3


def per_head(scale, n_kv: int, group: int) -> jax.Array:
    """A static scale ([] or [K]) per query head [H]; head h reads KV head h // group."""
    s_K = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (n_kv,))
    return jnp.repeat(s_K, group)


def fold_static_scales(q_BHC, k_scale, v_scale, n_kv: int):
    """Static scales leave the kernel: ``q·(K̂ s_K) = (q s_K)·K̂`` and ``Σ p V̂ s_V = s_V Σ p V̂``.

    Returns ``(q_f32, k_slot_scale, v_slot_scale, out_scale_H1)``; the slot scales are the dynamic
    ones (or None), ``out_scale_H1`` multiplies the kernel output (or is None).
    """
    group = q_BHC.shape[1] // n_kv
    q = q_BHC.astype(jnp.float32)
    k_slot = k_scale if is_slot_scale(k_scale) else None
    v_slot = v_scale if is_slot_scale(v_scale) else None
    if k_scale is not None and k_slot is None:
        q = q * per_head(k_scale, n_kv, group)[None, :, None]
    out_scale = None
    if v_scale is not None and v_slot is None:
        out_scale = per_head(v_scale, n_kv, group)[:, None]
    return q, k_slot, v_slot, out_scale


def pad_slots(x, s_pad: int, value=0):
    """Pads axis 1 (slots) of ``x`` by ``s_pad``."""
    if s_pad == 0 or x is None:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, s_pad)
    return jnp.pad(x, widths, constant_values=value)
