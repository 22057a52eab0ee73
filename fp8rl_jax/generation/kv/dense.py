"""KV cache: per-layer K/V in BF16/F32 or FP8 (static or dynamic scales), per-row write slots.

Layout (one entry per layer in the lists ``k``, ``v``): ``[B, S, K, C]`` arrays of the cache
dtype. Row ``b`` writes its next ``T`` tokens at slots ``lengths_B[b] + arange(T)``; ``valid_BS``
marks slots that hold real (non-pad) tokens. Attention is causal by slot order. Each row carries
its own length, so a finished row can be reset and refilled (continuous batching) with
``reset_rows``. The decode kernels read a row's live range ``live_range(valid_BS)``; that equals
the mask when each row's valid slots are contiguous, as in ``generate`` (left-padded prompt, then
the response).

Scale modes (DESIGN.md §4.5), ``x ≈ x̂ · s``:
  * ``none``: no scales, the cache dtype is BF16/F32;
  * ``static``: one FP32 scale per layer and KV head, ``k_scale[l]`` of shape [K] (a per-layer
    scalar is broadcast to [K]); recalibrated by the trainer from ``ForwardOut.qkv_amax``;
  * ``dynamic``: one FP32 scale per written token and KV head, ``[B, K, S]`` (slots last, so a
    kernel reads a head's scales of a tile contiguously), ``s = max(amax_C |x|, tiny) / fp8_max``,
    computed when the vector is written.
Dequantization is ``kernels_pallas.decode_attention.dequantize_kv``, the one the kernels' reference
uses.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from fp8rl_jax.models.config import ModelConfig
from kernels_pallas.qarray import FP8_DTYPES, SCALE_TINY, fp8_max
from kernels_pallas.quantize import saturating_cast

Mode = Literal["none", "static", "dynamic"]
MODES = ("none", "static", "dynamic")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer K/V cache with optional FP8 scales; see the module docstring."""

    k: list[jax.Array]  # per layer [B, S, K, C], cache dtype
    v: list[jax.Array]  # per layer [B, S, K, C], cache dtype
    k_scale: list[jax.Array] | None  # per layer: static [K] f32, dynamic [B, K, S] f32, none None
    v_scale: list[jax.Array] | None
    valid_BS: jax.Array  # bool: slot holds a real token
    lengths_B: jax.Array  # int32: next write slot per row
    q_scale: list[jax.Array] | None = None  # per layer [K] f32: FP8 attention (Q in E4M3), or None
    mode: str = dataclasses.field(default="none", metadata=dict(static=True))

    @property
    def max_len(self) -> int:
        return self.valid_BS.shape[1]

    @property
    def dtype(self) -> jnp.dtype:
        return self.k[0].dtype


def _per_layer_scale(name: str, scale, n_layers: int, n_kv: int) -> list[jax.Array]:
    arr = jnp.asarray(scale, jnp.float32)
    if arr.ndim == 1 and arr.shape[0] == n_layers:
        arr = arr[:, None]
    if arr.ndim != 2 or arr.shape[0] != n_layers or arr.shape[1] not in (1, n_kv):
        raise ValueError(
            f"init_cache: {name} must have shape [L], [L, 1] or [L, K], got {arr.shape}"
        )
    arr = jnp.broadcast_to(arr, (n_layers, n_kv))
    return [arr[i] for i in range(n_layers)]


def init_cache(
    cfg: ModelConfig,
    batch: int,
    max_len: int,
    *,
    dtype=jnp.bfloat16,
    mode: Mode = "none",
    k_scale=None,
    v_scale=None,
    q_scale=None,
) -> KVCache:
    """Empty cache. ``static`` mode requires ``k_scale``/``v_scale`` ([L], [L, 1] or [L, K]).

    Scales never default to 1.0: missing static scales raise. ``q_scale`` ([L] or [L, K]) turns
    on emulated FP8 attention (Q quantized to E4M3 with that static scale).
    """
    dtype = jnp.dtype(dtype)
    is_fp8 = dtype.name in FP8_DTYPES
    if mode not in MODES:
        raise ValueError(f"init_cache: mode {mode!r} not in {MODES}")
    if is_fp8 == (mode == "none"):
        raise ValueError(f"init_cache: dtype {dtype.name} needs mode static|dynamic iff FP8")
    if mode == "static" and (k_scale is None or v_scale is None):
        raise ValueError("init_cache: static FP8 cache requires k_scale and v_scale")
    if mode != "static" and (k_scale is not None or v_scale is not None):
        raise ValueError(f"init_cache: k_scale/v_scale only apply to static mode, not {mode!r}")
    L, K, C = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    shape = (batch, max_len, K, C)
    zeros = [jnp.zeros(shape, dtype) for _ in range(L)]
    if mode == "static":
        ks, vs = (
            _per_layer_scale("k_scale", k_scale, L, K),
            _per_layer_scale("v_scale", v_scale, L, K),
        )
    elif mode == "dynamic":
        ks = [jnp.zeros((batch, K, max_len), jnp.float32) for _ in range(L)]
        vs = [jnp.zeros((batch, K, max_len), jnp.float32) for _ in range(L)]
    else:
        ks = vs = None
    qs = None if q_scale is None else _per_layer_scale("q_scale", q_scale, L, K)
    return KVCache(
        k=zeros,
        v=[jnp.zeros(shape, dtype) for _ in range(L)],
        k_scale=ks,
        v_scale=vs,
        valid_BS=jnp.zeros((batch, max_len), bool),
        lengths_B=jnp.zeros((batch,), jnp.int32),
        q_scale=qs,
        mode=mode,
    )


def extend_cache(cache: KVCache, max_len: int) -> KVCache:
    """The cache with ``max_len`` slots, the new ones empty (a prefill into a prompt-sized cache
    attends over P slots, not P + N; then the decode loop gets its room)."""
    extra = max_len - cache.max_len
    if extra < 0:
        raise ValueError(f"extend_cache: max_len {max_len} < current {cache.max_len}")

    def pad(x, axis):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)

    dynamic = cache.mode == "dynamic"  # per-slot scales [B, K, S]: slots last
    return dataclasses.replace(
        cache,
        k=[pad(x, 1) for x in cache.k],
        v=[pad(x, 1) for x in cache.v],
        k_scale=[pad(x, 2) for x in cache.k_scale] if dynamic else cache.k_scale,
        v_scale=[pad(x, 2) for x in cache.v_scale] if dynamic else cache.v_scale,
        valid_BS=pad(cache.valid_BS, 1),
    )


def reset_rows(cache: KVCache, rows_B: jax.Array) -> KVCache:
    """Empties the rows where ``rows_B`` is True (length 0, no valid slots) for refilling."""
    return dataclasses.replace(
        cache,
        valid_BS=cache.valid_BS & ~rows_B[:, None],
        lengths_B=jnp.where(rows_B, 0, cache.lengths_B),
    )


def quantize_kv(x_BTKC: jax.Array, mode: str, dtype, scale=None):
    """(stored values, stored scale or None): the cache-dtype form of new K or V vectors."""
    if mode == "none":
        return x_BTKC.astype(dtype), None
    x = x_BTKC.astype(jnp.float32)
    if mode == "static":
        return saturating_cast(x / scale[:, None], dtype), None
    s_BTK = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), SCALE_TINY) / fp8_max(dtype)
    return saturating_cast(x / s_BTK[..., None], dtype), s_BTK


def scatter_slots(buf, new, slots_BT):
    """``buf[b, slots_BT[b, t]] = new[b, t]``; writes past the end are dropped."""
    # mode="drop": writes past max_len are discarded rather than clamped onto earlier slots.
    b_idx = jnp.arange(buf.shape[0])[:, None]
    return buf.at[b_idx, slots_BT].set(new.astype(buf.dtype), mode="drop")


def scatter_scales(buf_BKS, new_BTK, slots_BT):
    """``buf[b, :, slots_BT[b, t]] = new[b, t, :]`` for dynamic scales [B, K, S]."""
    b_idx = jnp.arange(buf_BKS.shape[0])[:, None]
    return buf_BKS.at[b_idx, :, slots_BT].set(new_BTK, mode="drop")


def live_range(valid_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(starts_B, lengths_B) int32: each row's first valid slot and one past its last (0, 0 for
    a row with none): the live range ``[start, length)`` the decode kernels read."""
    S = valid_BS.shape[1]
    any_B = jnp.any(valid_BS, axis=1)
    first = jnp.argmax(valid_BS, axis=1)
    end = S - jnp.argmax(valid_BS[:, ::-1], axis=1)
    return jnp.where(any_B, first, 0).astype(jnp.int32), jnp.where(any_B, end, 0).astype(jnp.int32)


def write_layer(cache: KVCache, layer: int, k_BTKC, v_BTKC, slots_BT):
    """(k, v, k_scale, v_scale) of one layer after writing the new tokens at ``slots_BT``."""
    ks = cache.k_scale[layer] if cache.k_scale is not None else None
    vs = cache.v_scale[layer] if cache.v_scale is not None else None
    k_q, k_s = quantize_kv(k_BTKC, cache.mode, cache.dtype, ks if cache.mode == "static" else None)
    v_q, v_s = quantize_kv(v_BTKC, cache.mode, cache.dtype, vs if cache.mode == "static" else None)
    k = scatter_slots(cache.k[layer], k_q, slots_BT)
    v = scatter_slots(cache.v[layer], v_q, slots_BT)
    if cache.mode == "dynamic":
        ks, vs = scatter_scales(ks, k_s, slots_BT), scatter_scales(vs, v_s, slots_BT)
    return k, v, ks, vs


def advance(cache: KVCache, new_k, new_v, new_ks, new_vs, slots_BT, valid_BT) -> KVCache:
    """Cache after a forward of T tokens: new per-layer buffers, valid slots, ``lengths += T``."""
    valid = scatter_slots(cache.valid_BS, valid_BT, slots_BT)
    return dataclasses.replace(
        cache,
        k=new_k,
        v=new_v,
        k_scale=new_ks if cache.k_scale is not None else None,
        v_scale=new_vs if cache.v_scale is not None else None,
        valid_BS=valid,
        lengths_B=cache.lengths_B + slots_BT.shape[1],
    )
