"""Shared pieces of the paged-attention implementations: the static tiling and window ladder."""

from __future__ import annotations

import dataclasses

from kernels_pallas.decode_attention.common import check_swap_ab


@dataclasses.dataclass(frozen=True)
class PagedBlocks:
    """Static tiling of a paged-attention implementation; ``None`` fields take the default.

    The kernels' tile is one page (its size is the pool's ``Y``), so there is no block size.
    """

    num_splits: int | None = None  # kernels: chunks of a row's pages (flash-decoding)
    num_stages: int | None = None  # Mosaic GPU: pages in flight
    window_pages: int | None = None  # xla: a fixed gather window (pages); None: the ladder
    swap_ab: bool | None = None  # Mosaic GPU: the dense kernel's swap-AB (None: on)

    def __post_init__(self):
        for name in ("num_splits", "num_stages", "window_pages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"PagedBlocks.{name} must be a positive int or None, got {v!r}")
        check_swap_ab("PagedBlocks", self.swap_ab)


def cdiv(a, b):
    return -(-a // b)


def window_ladder(w: int) -> tuple[int, ...]:
    """Ascending gather widths ``.., cdiv(W, 4), cdiv(W, 2), W`` down to 1 page: the smallest
    one covering a row is less than twice its page count (or the table width)."""
    out = [w]
    while out[-1] > 1:
        out.append(cdiv(out[-1], 2))
    return tuple(reversed(out))
