"""The dense KV cache: per-layer K/V rows in BF16/F32 or FP8 (static or dynamic scales).

Layout (one entry per layer in the lists ``k``, ``v``): ``[B, S, K, C]`` arrays of the cache
dtype. Row ``b`` writes its next ``T`` tokens at slots ``lengths_B[b] + arange(T)``; ``valid_BS``
marks slots that hold real (non-pad) tokens. Attention is causal by slot order. A one-token step
with ``kernels.decode_attention`` set reads each row's live range ``live_range(valid_BS)``
through ``kernels_pallas.decode_attention``; that equals the mask when each row's valid slots
are contiguous, as in the static engine (left-padded prompt, then the response). The cache is
then ``CACHE_ALIGN``-slot aligned (``cache_len``), so the kernels' tiles divide it.

Scales (``scales.py``, DESIGN.md §4.5): ``static`` one FP32 scale per layer and KV head, ``[K]``;
``dynamic`` one per written token and KV head, ``[B, K, S]`` (slots last, so a kernel reads a
head's scales of a tile contiguously). Dequantization is ``kernels_pallas.decode_attention
.dequantize_kv``, the one the kernels' reference uses. ``q_scale`` (static [K] per layer) turns
on emulated FP8 attention: Q is cast to E4M3 with that scale before it meets the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8rl_jax.generation.kv.scales import (
    LayerKV,
    Mode,
    check_mode,
    per_layer_scale,
    quantize_kv,
    with_layers,
)
from fp8rl_jax.models.attention import attention, cache_mask, fake_quantize_q
from fp8rl_jax.models.config import ModelConfig
from kernels_pallas.backend import KernelImpls
from kernels_pallas.decode_attention import decode_attention, dequantize_kv

CACHE_ALIGN = 128  # cache slots are rounded up to this when a decode kernel reads them


def cdiv(a, b):
    """``ceil(a / b)`` for positive ints or integer arrays."""
    return -(-a // b)


def cache_len(n: int, kernels: KernelImpls) -> int:
    """Cache slots for n tokens: a multiple of ``CACHE_ALIGN`` when a decode kernel reads the
    cache (its tiles must divide the allocation; the extra slots stay invalid, never read)."""
    return n if kernels.decode_attention is None else cdiv(n, CACHE_ALIGN) * CACHE_ALIGN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer K/V rows with optional FP8 scales; see the module docstring."""

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

    def prepare(self, valid_BT: jax.Array, kernels: KernelImpls) -> DenseStep:
        """The ``models.cache.CacheStep`` of T new tokens per row, written at ``lengths_B``."""
        T = valid_BT.shape[1]
        slots_BT = self.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)
        valid_after = scatter_slots(self.valid_BS, valid_BT, slots_BT)
        live = mask = None
        if kernels.decode_attention is not None and T == 1:
            # The valid slots up to the query's own: its row's live range, computed once.
            starts_B, ends_B = live_range(valid_after)
            live = (starts_B, jnp.minimum(ends_B, slots_BT[:, 0] + 1))
        else:
            mask = cache_mask(valid_after, slots_BT)
        return DenseStep(self, kernels, slots_BT, valid_BT, mask, live)


@dataclasses.dataclass(frozen=True)
class DenseStep:
    """One forward call over a ``KVCache`` (``models.cache.CacheStep``)."""

    cache: KVCache
    kernels: KernelImpls
    slots_BT: jax.Array  # int32 write slots
    valid_BT: jax.Array  # bool: real tokens
    mask_BTS: jax.Array | None  # the jnp attention's mask (None on the decode-kernel path)
    live: tuple[jax.Array, jax.Array] | None  # (starts_B, lengths_B) read by the decode kernel

    @property
    def positions_BT(self) -> jax.Array:
        return self.slots_BT

    def attend(self, layer: int, q_BTHC, k_BTKC, v_BTKC, sm_scale: float, quant_out=None):
        c = self.cache
        if c.q_scale is not None:
            q_BTHC = fake_quantize_q(q_BTHC, c.q_scale[layer])
        kv = write_layer(c, layer, k_BTKC, v_BTKC, self.slots_BT)
        if self.live is not None:  # one query per row: the kernel op over the live slots
            starts_B, lengths_B = self.live
            o = decode_attention(
                q_BTHC[:, 0], kv.k, kv.v, lengths_B, starts_B=starts_B, k_scale=kv.k_scale,
                v_scale=kv.v_scale, sm_scale=sm_scale, impl=self.kernels.decode_attention,
                quant_out=quant_out, interpret=self.kernels.interpret,
            )  # fmt: skip
            return (o if quant_out is not None else o[:, None]), kv
        fp8 = c.mode != "none"
        k = dequantize_kv(kv.k, kv.k_scale) if fp8 else kv.k
        v = dequantize_kv(kv.v, kv.v_scale) if fp8 else kv.v
        return attention(q_BTHC, k, v, self.mask_BTS, sm_scale=sm_scale), kv

    def advance(self, writes: list[LayerKV]) -> KVCache:
        """Cache after the call: new per-layer buffers, valid slots, ``lengths += T``."""
        c = self.cache
        return with_layers(
            c, writes, valid_BS=scatter_slots(c.valid_BS, self.valid_BT, self.slots_BT),
            lengths_B=c.lengths_B + self.slots_BT.shape[1],
        )  # fmt: skip


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
    check_mode("init_cache", dtype, mode)
    if mode == "static" and (k_scale is None or v_scale is None):
        raise ValueError("init_cache: static FP8 cache requires k_scale and v_scale")
    if mode != "static" and (k_scale is not None or v_scale is not None):
        raise ValueError(f"init_cache: k_scale/v_scale only apply to static mode, not {mode!r}")
    L, K, C = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    shape = (batch, max_len, K, C)
    ks = vs = None
    if mode == "static":
        ks, vs = (
            per_layer_scale("k_scale", k_scale, L, K),
            per_layer_scale("v_scale", v_scale, L, K),
        )
    elif mode == "dynamic":
        ks = [jnp.zeros((batch, K, max_len), jnp.float32) for _ in range(L)]
        vs = [jnp.zeros((batch, K, max_len), jnp.float32) for _ in range(L)]
    return KVCache(
        k=[jnp.zeros(shape, dtype) for _ in range(L)],
        v=[jnp.zeros(shape, dtype) for _ in range(L)],
        k_scale=ks,
        v_scale=vs,
        valid_BS=jnp.zeros((batch, max_len), bool),
        lengths_B=jnp.zeros((batch,), jnp.int32),
        q_scale=None if q_scale is None else per_layer_scale("q_scale", q_scale, L, K),
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


def write_layer(cache: KVCache, layer: int, k_BTKC, v_BTKC, slots_BT) -> LayerKV:
    """One layer's buffers after writing the new tokens at ``slots_BT``."""
    ks = cache.k_scale[layer] if cache.k_scale is not None else None
    vs = cache.v_scale[layer] if cache.v_scale is not None else None
    static = cache.mode == "static"
    k_q, k_s = quantize_kv(k_BTKC, cache.mode, cache.dtype, ks if static else None)
    v_q, v_s = quantize_kv(v_BTKC, cache.mode, cache.dtype, vs if static else None)
    k = scatter_slots(cache.k[layer], k_q, slots_BT)
    v = scatter_slots(cache.v[layer], v_q, slots_BT)
    if cache.mode == "dynamic":
        ks, vs = scatter_scales(ks, k_s, slots_BT), scatter_scales(vs, v_s, slots_BT)
    return LayerKV(k, v, ks, vs)
