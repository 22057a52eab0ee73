"""Decode attention over a paged KV cache (page pool + page tables): reference, XLA, kernels."""

from kernels_pallas.paged_attention.api import TABLE, paged_attention
from kernels_pallas.paged_attention.common import PagedBlocks, window_ladder
from kernels_pallas.paged_attention.reference import (
    gather_page_scales,
    gather_pages,
    is_page_scale,
    paged_attention_reference,
)
from kernels_pallas.paged_attention.xla import paged_attention_xla

__all__ = [
    "TABLE",
    "PagedBlocks",
    "gather_page_scales",
    "gather_pages",
    "is_page_scale",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_xla",
    "window_ladder",
]
