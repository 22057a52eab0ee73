"""Paged KV cache: a pool of fixed-size pages per layer and a page table per decode slot.

Layout (one entry per layer in ``k``, ``v``): ``[X, Y, K, C]`` pages of the cache dtype; slot u
holds ``lengths_U[u]`` tokens, its logical slot s at entry ``s mod Y`` of page
``page_table_UW[u, s // Y]``. Pages are owned by the rollout engine (``generation.paged``), which
fills the table and shares pages between slots; this module only writes and copies them. Table
entries past a slot's held pages may name any page: nothing reads beyond ``lengths_U``. A
forward over it (``models.cache`` protocol) takes one token per slot and attends over the slot's
pages through ``kernels_pallas.paged_attention``; the page size must be a tile of the chosen
kernel (``check_kernel_page_size``).

Scale modes as the dense cache (``scales.py``, DESIGN.md §4.5), ``x ≈ x̂ · s``: ``none``;
``static`` one FP32 scale per layer and KV head ``[K]``; ``dynamic`` one per written vector,
stored per page as ``[X, K, Y]`` (slots last, so a kernel loads one head's scales of a page
contiguously). New vectors are quantized by ``scales.quantize_kv``, the dense cache's rule, so a
token has the same stored bits in either cache.
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
from fp8rl_jax.models.attention import fake_quantize_q
from fp8rl_jax.models.config import ModelConfig
from kernels_pallas.backend import KernelImpls
from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.paged_attention.pallas_mosaic_gpu import PAGE_SIZES as GPU_PAGE_SIZES
from kernels_pallas.paged_attention.pallas_tpu import PAGE_SIZES as TPU_PAGE_SIZES

KERNEL_PAGE_SIZES = {"pallas_tpu": TPU_PAGE_SIZES, "pallas_mosaic_gpu": GPU_PAGE_SIZES}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Per-layer page pools with optional FP8 scales, page tables and lengths of the slots."""

    k: list[jax.Array]  # per layer [X, Y, K, C], cache dtype
    v: list[jax.Array]  # per layer [X, Y, K, C], cache dtype
    k_scale: list[jax.Array] | None  # per layer: static [K] f32, dynamic [X, K, Y] f32, none None
    v_scale: list[jax.Array] | None
    page_table_UW: jax.Array  # int32: page of each slot's w-th page
    lengths_U: jax.Array  # int32: tokens held per slot (its next write position)
    q_scale: list[jax.Array] | None = None  # per layer [K] f32: FP8 attention (Q in E4M3), or None
    mode: str = dataclasses.field(default="none", metadata=dict(static=True))

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def dtype(self) -> jnp.dtype:
        return self.k[0].dtype

    def prepare(self, valid_BT: jax.Array, kernels: KernelImpls) -> PagedStep:
        """The ``models.cache.CacheStep`` of one token per slot (T = 1), at ``lengths_U``."""
        if valid_BT.shape[1] != 1:
            raise ValueError(
                f"forward: a PagedKVCache takes one token per slot, got T={valid_BT.shape[1]}"
            )
        valid_U = valid_BT[:, 0]
        # A valid slot attends over its held tokens and the new one; an invalid one over none.
        read_U = jnp.where(valid_U, self.lengths_U + 1, 0)
        return PagedStep(self, kernels, valid_U, read_U)


@dataclasses.dataclass(frozen=True)
class PagedStep:
    """One forward call over a ``PagedKVCache`` (``models.cache.CacheStep``)."""

    cache: PagedKVCache
    kernels: KernelImpls
    valid_U: jax.Array  # bool: the slot runs (writes and advances)
    read_U: jax.Array  # int32: tokens each slot's query attends over

    @property
    def positions_BT(self) -> jax.Array:
        return self.cache.lengths_U[:, None]

    def attend(self, layer: int, q_BTHC, k_BTKC, v_BTKC, sm_scale: float, quant_out=None):
        c = self.cache
        if c.q_scale is not None:
            q_BTHC = fake_quantize_q(q_BTHC, c.q_scale[layer])
        kv = write_token(c, layer, k_BTKC, v_BTKC, self.valid_U)
        o = paged_attention(
            q_BTHC[:, 0], kv.k, kv.v, self.read_U, c.page_table_UW, k_scale=kv.k_scale,
            v_scale=kv.v_scale, sm_scale=sm_scale, impl=self.kernels.decode_attention or "xla",
            quant_out=quant_out, interpret=self.kernels.interpret,
        )  # fmt: skip
        return (o if quant_out is not None else o[:, None]), kv

    def advance(self, writes: list[LayerKV]) -> PagedKVCache:
        """Cache after a one-token step: new per-layer pools, ``lengths += valid``."""
        c = self.cache
        return with_layers(c, writes, lengths_U=c.lengths_U + self.valid_U.astype(jnp.int32))


def check_kernel_page_size(
    page_size: int, kernels: KernelImpls, field: str = "rollout.paged"
) -> None:
    """A paged decode kernel's tile is one page: an explicitly chosen kernel must support the
    page size (``auto`` falls back to ``xla``, which reads any page size); ``field`` names the
    config field in the error."""
    allowed = KERNEL_PAGE_SIZES.get(kernels.decode_attention)
    if allowed is not None and page_size not in allowed:
        raise ValueError(
            f"{field}.page_size={page_size} is not a block size of the {kernels.decode_attention} "
            f"paged kernel {allowed} (a tile is one page)"
        )


def page_bytes(cfg: ModelConfig, page_size: int, dtype, mode: Mode) -> int:
    """HBM bytes of one page in every layer: K and V values, plus dynamic scales (f32)."""
    per_vector = cfg.head_dim * jnp.dtype(dtype).itemsize + (4 if mode == "dynamic" else 0)
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * per_vector


def init_paged_cache(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    num_slots: int,
    table_width: int,
    *,
    dtype=jnp.bfloat16,
    mode: Mode = "none",
    k_scale=None,
    v_scale=None,
    q_scale=None,
) -> PagedKVCache:
    """Zeroed pools, tables naming page 0, lengths 0. ``static`` mode requires the scales
    (``[L]``, ``[L, 1]`` or ``[L, K]``); scales never default to 1.0. ``q_scale``: FP8 attention,
    as ``init_cache``."""
    dtype = jnp.dtype(dtype)
    check_mode("init_paged_cache", dtype, mode)
    if (mode == "static") != (k_scale is not None and v_scale is not None):
        raise ValueError("init_paged_cache: k_scale and v_scale are required by (only) static mode")
    L, K, C = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    shape = (num_pages, page_size, K, C)
    ks = vs = None
    if mode == "static":
        ks = per_layer_scale("k_scale", k_scale, L, K)
        vs = per_layer_scale("v_scale", v_scale, L, K)
    elif mode == "dynamic":
        ks = [jnp.zeros((num_pages, K, page_size), jnp.float32) for _ in range(L)]
        vs = [jnp.zeros((num_pages, K, page_size), jnp.float32) for _ in range(L)]
    return PagedKVCache(
        k=[jnp.zeros(shape, dtype) for _ in range(L)],
        v=[jnp.zeros(shape, dtype) for _ in range(L)],
        k_scale=ks,
        v_scale=vs,
        page_table_UW=jnp.zeros((num_slots, table_width), jnp.int32),
        lengths_U=jnp.zeros((num_slots,), jnp.int32),
        q_scale=None if q_scale is None else per_layer_scale("q_scale", q_scale, L, K),
        mode=mode,
    )


def write_slots(cache: PagedKVCache, valid_U: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(page_U, offset_U) of each slot's next token; page X (out of bounds: the write is
    dropped) where ``valid_U`` is False."""
    y = cache.page_size
    page = jnp.take_along_axis(cache.page_table_UW, (cache.lengths_U // y)[:, None], axis=1)
    page = jnp.where(valid_U, page[:, 0], cache.num_pages)
    return page, cache.lengths_U % y


def write_token(cache: PagedKVCache, layer: int, k_U1KC, v_U1KC, valid_U) -> LayerKV:
    """One layer's buffers after writing each valid slot's new token."""
    page_U, off_U = write_slots(cache, valid_U)
    ks = cache.k_scale[layer] if cache.k_scale is not None else None
    vs = cache.v_scale[layer] if cache.v_scale is not None else None
    static = cache.mode == "static"
    k_q, k_s = quantize_kv(k_U1KC, cache.mode, cache.dtype, ks if static else None)
    v_q, v_s = quantize_kv(v_U1KC, cache.mode, cache.dtype, vs if static else None)
    k = cache.k[layer].at[page_U, off_U].set(k_q[:, 0], mode="drop")
    v = cache.v[layer].at[page_U, off_U].set(v_q[:, 0], mode="drop")
    if cache.mode == "dynamic":
        ks = ks.at[page_U, :, off_U].set(k_s[:, 0], mode="drop")
        vs = vs.at[page_U, :, off_U].set(v_s[:, 0], mode="drop")
    return LayerKV(k, v, ks, vs)


def copy_pages(cache: PagedKVCache, src_N: jax.Array, dst_N: jax.Array) -> PagedKVCache:
    """Every layer's page ``dst_N[i]`` := page ``src_N[i]`` (values and dynamic scales); a
    ``dst`` of X (out of bounds) copies nothing."""

    def cp(pool):
        return pool.at[dst_N].set(pool[jnp.minimum(src_N, pool.shape[0] - 1)], mode="drop")

    dynamic = cache.mode == "dynamic"
    return dataclasses.replace(
        cache,
        k=[cp(x) for x in cache.k],
        v=[cp(x) for x in cache.v],
        k_scale=[cp(x) for x in cache.k_scale] if dynamic else cache.k_scale,
        v_scale=[cp(x) for x in cache.v_scale] if dynamic else cache.v_scale,
    )


def store_pages(cache: PagedKVCache, k, v, k_scale, v_scale, dst_N) -> PagedKVCache:
    """Writes whole pages: per layer ``k[l]``, ``v[l]`` ``[N, Y, K, C]`` (cache dtype) and, in
    dynamic mode, ``k_scale[l]``, ``v_scale[l]`` ``[N, K, Y]`` at pages ``dst_N`` (X: dropped)."""

    def put(pools, new):
        return [p.at[dst_N].set(n.astype(p.dtype), mode="drop") for p, n in zip(pools, new)]

    dynamic = cache.mode == "dynamic"
    return dataclasses.replace(
        cache,
        k=put(cache.k, k),
        v=put(cache.v, v),
        k_scale=put(cache.k_scale, k_scale) if dynamic else cache.k_scale,
        v_scale=put(cache.v_scale, v_scale) if dynamic else cache.v_scale,
    )
