"""Ragged row stores of the Hopper grouped kernels (``grouped_fp8_matmul`` and
``grouped_matmul``): a tile's rows of its own group, from a compute warpgroup's 64-row
accumulator straight into ``y [M, n]``, so no tile outputs and no XLA gather exist.

A 64-row sub-tile wholly inside the group goes out as one TMA box from a swizzled SMEM tile
(``stmatrix`` stores, conflict-free). One a group boundary cuts goes through the same bytes
unswizzled (``plgpu.RefUnion``: a TMA box from a swizzled tile must start on its 8-row swizzle
atom, a ragged one starts at any row) as its row count's binary digits: one box of 32, 16, ...,
1 rows per set bit (TMA boxes have static shapes; jax ``ragged_dot_mgpu``'s ladder). Its
unswizzled fragment stores put a warp's 8 rows in the same banks (8 wavefronts each), which
only boundary sub-tiles pay (``perf_model.gpu_grouped.ragged_epilogue_s``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.fp8_matmul.mgpu_k_step import smem_transforms

ROWS = 64  # a compute warpgroup's wgmma rows: the sub-tile a store takes


def scratch(lead: tuple[int, ...], n: int, dtype) -> plgpu.RefUnion:
    """SMEM for ``lead`` sub-tiles of [64, n]: (swizzled, plain) views of the same bytes."""
    shape = (*lead, ROWS, n)
    return plgpu.RefUnion(
        plgpu.SMEM(shape, dtype, transforms=smem_transforms(dtype, n)), plgpu.SMEM(shape, dtype)
    )


def store(views, value, dst_gmem, row, first, count) -> None:
    """Stores the rows ``[first, first + count)`` of the block (clipped to this sub-tile) of
    ``value`` [64, n] (a warpgroup's accumulator, any float dtype) into ``dst_gmem`` [M, n]
    (``y``'s columns of the sub-tile), the sub-tile's first row being ``y`` row ``row``.
    ``views``: this sub-tile's (swizzled, plain) SMEM tiles (``scratch``). Issues the TMA
    stores; the caller waits for them (``plgpu.wait_smem_to_gmem``) before the SMEM is reused
    or the kernel ends. ``first``/``count`` are relative to the sub-tile's first row."""
    swizzled, plain = views
    lo, hi = jnp.clip(first, 0, ROWS), jnp.clip(first + count, 0, ROWS)
    whole = (lo == 0) & (hi == ROWS)

    @pl.when(whole)  # most sub-tiles: one box
    def _():
        swizzled[...] = value.astype(swizzled.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(swizzled, dst_gmem.at[pl.ds(row, ROWS)])

    @pl.when(~whole & (hi > lo))  # a group boundary: the count's binary digits
    def _():
        plain[...] = value.astype(plain.dtype)
        plgpu.commit_smem()
        start, n_rows = lo, hi - lo
        rows = ROWS // 2  # 64 rows are a whole sub-tile
        while rows:

            @pl.when(n_rows & rows != 0)
            def _(start=start, rows=rows):
                plgpu.copy_smem_to_gmem(plain.at[pl.ds(start, rows)],
                                        dst_gmem.at[pl.ds(row + start, rows)])  # fmt: skip

            start = start + (n_rows & rows)
            rows //= 2
