"""Paged decode attention in XLA: the reference's math over a window of the page table.

The gather reads ``B · w`` pages, where ``w`` is the smallest width of ``window_ladder(W)`` that
covers the longest live row (``lax.switch`` over the ladder): at most twice the longest row's
pages, whatever the table width W (the per-sequence budget). Rows shorter than the longest still
read w pages (static shapes); the Pallas kernels read each row's own pages only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention.common import cdiv, window_ladder
from kernels_pallas.paged_attention.reference import paged_attention_reference


def paged_attention_xla(
    q_BHC, k_pages_XYKC, v_pages_XYKC, lengths_B, page_table_BW, *, k_scale=None, v_scale=None,
    sm_scale: float, window_pages: int | None = None,
):  # fmt: skip
    """Same contract as ``paged_attention_reference``; ``window_pages`` fixes the window (the
    caller promises every row fits it), None picks it per call from ``max(lengths_B)``."""
    w, y = page_table_BW.shape[1], k_pages_XYKC.shape[1]

    def attend(width: int, *ops):
        q, k, v, lengths, table, ks, vs = ops
        return paged_attention_reference(
            q, k, v, lengths, table[:, :width], k_scale=ks, v_scale=vs, sm_scale=sm_scale
        )

    ops = (q_BHC, k_pages_XYKC, v_pages_XYKC, lengths_B, page_table_BW, k_scale, v_scale)
    if window_pages is not None:
        return attend(min(window_pages, w), *ops)
    ladder = window_ladder(w)
    if len(ladder) == 1:
        return attend(w, *ops)
    need = cdiv(jnp.max(lengths_B).astype(jnp.int32), y)
    idx = jnp.sum(jnp.asarray(ladder[:-1], jnp.int32) < need)  # first width >= need
    branches = [lambda *o, width=width: attend(width, *o) for width in ladder]
    return jax.lax.switch(idx, branches, *ops)
