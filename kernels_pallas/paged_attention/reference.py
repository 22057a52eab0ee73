"""Pure-jnp reference for decode attention over a paged KV cache (gather by page table)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.decode_attention.reference import decode_attention_reference


def gather_pages(pages_XYKC: jax.Array, page_table_BW: jax.Array) -> jax.Array:
    """``[B, W·Y, K, C]``: row b's logical slots in order, slot s from page ``table[b, s // Y]``."""
    b, w = page_table_BW.shape
    _, y, n_kv, c = pages_XYKC.shape
    return pages_XYKC[page_table_BW].reshape(b, w * y, n_kv, c)


def gather_page_scales(scale_XKY: jax.Array, page_table_BW: jax.Array) -> jax.Array:
    """Dynamic scales of the pages ``[X, K, Y]`` as the dense layout ``[B, K, W·Y]``."""
    b, w = page_table_BW.shape
    _, n_kv, y = scale_XKY.shape
    s_BWKY = scale_XKY[page_table_BW]
    return jnp.swapaxes(s_BWKY, 1, 2).reshape(b, n_kv, w * y)


def is_page_scale(scale) -> bool:
    """True for dynamic scales (one per cached vector, ``[X, K, Y]``)."""
    return scale is not None and jnp.ndim(scale) == 3


def paged_attention_reference(
    q_BHC: jax.Array,
    k_pages_XYKC: jax.Array,
    v_pages_XYKC: jax.Array,
    lengths_B: jax.Array,
    page_table_BW: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float,
) -> jax.Array:
    """One query per row over the row's paged cache slots ``[0, lengths_B[b])``, with GQA.

    ``o_{b,h} = Σ_{s < len_b} softmax_s(sm_scale · q_{b,h} · K_{b,s,k(h)}) V_{b,s,k(h)}`` where
    slot s of row b is entry ``s mod Y`` of page ``page_table_BW[b, s // Y]`` and
    ``K = K̂ · s_K``, ``V = V̂ · s_V`` are dequantized in float32 (scales None, [] or [K]
    static, ``[X, K, Y]`` dynamic). Equal to ``decode_attention_reference`` over the gathered
    pages; a row with length 0 gives zeros. Reads the whole table (an oracle, not a kernel).
    """
    k = gather_pages(k_pages_XYKC, page_table_BW)
    v = gather_pages(v_pages_XYKC, page_table_BW)
    if is_page_scale(k_scale):
        k_scale = gather_page_scales(k_scale, page_table_BW)
        v_scale = gather_page_scales(v_scale, page_table_BW)
    return decode_attention_reference(
        q_BHC, k, v, lengths_B, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale
    )
