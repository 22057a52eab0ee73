"""Row tiles of a grouped matmul: which expert and which row block each tile multiplies.

Rows are sorted by group. A tile is ``tile_m`` consecutive rows of one aligned row block
``[b·tm, (b+1)·tm)`` multiplied by one group's weight; a row block that holds the boundary
between two groups is multiplied once per group it holds (megablox ``make_group_metadata``,
jax ``ragged_dot_mgpu.GroupInfo``). Only non-empty groups get tiles, so at most
``cdiv(M, tm) + min(E, M) - 1`` tiles exist (``num_tiles``: every group boundary adds at most
one tile to the ``cdiv(M, tm)`` row blocks). Tiles past the live ones ("dead") repeat the last
live tile's group and block (a TPU grid step whose block indices are unchanged fetches nothing)
and are skipped by the kernels.

The TPU kernel and the Hopper kernel's swap-AB (decode) tiles compute all ``tm`` rows of a
tile with the tile's expert into its own output tile ``out[t·tm : (t+1)·tm]`` (rows of the block
that belong to another group are computed and ignored), and ``gather_rows`` picks row m from the
tile of its own group: one gather of the output. The Hopper kernel's prefill tiles store only
their group's rows, straight into ``y`` (``ragged_meta``: each tile's first row and row count in
its block; the rows past Σ sizes are one more group, whose tiles store zeros), so ``y`` is
written once and never gathered.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def num_tiles(m: int, num_groups: int, tile_m: int) -> int:
    """Static upper bound on the live tiles: ``cdiv(M, tm) + min(E, M) - 1``."""
    return max(-(-m // tile_m) + min(num_groups, m) - 1, 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TileMap:
    """Per tile: its group and row block; per row: where its output lives (all int32)."""

    group_T: jax.Array  # the expert whose weight the tile multiplies
    block_T: jax.Array  # the aligned row block [b·tm, (b+1)·tm) of x the tile reads
    live_T: jax.Array  # 1 for live tiles, 0 for the dead tail
    out_row_M: jax.Array  # row m's output row in the tile outputs [T·tm, N]; -1 past Σ sizes
    tile_m: int = dataclasses.field(metadata=dict(static=True))

    @property
    def meta_3T(self) -> jax.Array:
        """(group, block, live) stacked [3, T]: the kernels' scalar operand."""
        return jnp.stack([self.group_T, self.block_T, self.live_T])


def group_of(ends_E: jax.Array, i: jax.Array) -> jax.Array:
    """The number of ``ends_E`` <= each ``i`` (``searchsorted(..., side="right")``) by comparing
    every pair: one XLA fusion. The default, a binary search as a ``while`` loop of
    ``log2(E) + 1`` steps, launches its 4 fusions and its condition at every step on a GPU,
    ~40 launches per search inside every decode step (``perf_model.hlo_launches`` counts them);
    E is small (the experts), so the E x len(i) compares cost less than one launch."""
    return jnp.searchsorted(ends_E, i, side="right", method="compare_all")


def group_bounds(group_sizes_E: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """``(starts_E, ends_E)``: each group's rows ``[start, end)`` of the ``m`` sorted rows, the
    sizes clipped so that the groups cover at most ``m`` rows (int32)."""
    ends = jnp.minimum(jnp.cumsum(group_sizes_E.astype(jnp.int32)), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def _tiles(starts: jax.Array, ends: jax.Array, t: int, tile_m: int):
    """Per tile (of ``t``): its group, row block and live flag, from the groups' row ranges."""
    e = starts.shape[0]
    first = starts // tile_m
    last = (ends - 1) // tile_m
    n_tiles = jnp.where(ends > starts, last - first + 1, 0)
    tile_end = jnp.cumsum(n_tiles)  # inclusive prefix sum: tiles of groups <= e
    tile_start = tile_end - n_tiles
    live = tile_end[-1]
    idx = jnp.arange(t, dtype=jnp.int32)
    t_eff = jnp.minimum(idx, jnp.maximum(live - 1, 0))  # dead tiles repeat the last live one
    group = jnp.minimum(group_of(tile_end, t_eff), e - 1).astype(jnp.int32)
    block = first[group] + t_eff - tile_start[group]
    return group, block, idx < live, first, tile_start


def make_tile_map(group_sizes_E: jax.Array, m: int, tile_m: int) -> TileMap:
    """The tiles of ``m`` rows sorted into groups of ``group_sizes_E`` (see the module doc).

    Sizes are clipped so that the groups cover at most the ``m`` rows.
    """
    e = group_sizes_E.shape[0]
    starts, ends = group_bounds(group_sizes_E, m)
    group, block, live, first, tile_start = _tiles(starts, ends, num_tiles(m, e, tile_m), tile_m)
    rows = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.minimum(group_of(ends, rows), e - 1)
    row_tile = tile_start[row_group] + rows // tile_m - first[row_group]
    out_row = jnp.where(rows < ends[-1], row_tile * tile_m + rows % tile_m, -1)
    return TileMap(group, block.astype(jnp.int32), live.astype(jnp.int32),
                   out_row.astype(jnp.int32), tile_m)  # fmt: skip


def ragged_meta(group_sizes_E: jax.Array, m: int, tile_m: int) -> jax.Array:
    """The tiles of ragged stores, [5, T] int32 with ``T = num_tiles(m, E + 1, tile_m)``: per
    tile its group (clipped to E - 1), row block, mode (0 dead, 1 live, 2 the rows past Σ sizes:
    store zeros), and the first row and the number of rows of its group inside the block."""
    e = group_sizes_E.shape[0]
    starts, ends = group_bounds(group_sizes_E, m)
    starts = jnp.concatenate([starts, ends[-1:]])  # the rows past Σ sizes: group e
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    group, block, live, _, _ = _tiles(starts, ends, num_tiles(m, e + 1, tile_m), tile_m)
    row0 = block * tile_m
    first = jnp.maximum(starts[group] - row0, 0)
    count = jnp.minimum(ends[group] - row0, tile_m) - first
    mode = jnp.where(live, jnp.where(group == e, 2, 1), 0)
    meta = (jnp.minimum(group, e - 1), block, mode, first, count)
    return jnp.stack([a.astype(jnp.int32) for a in meta])


def gather_rows(out_tiles: jax.Array, tiles: TileMap, out_dtype) -> jax.Array:
    """``y[m] = out_tiles[out_row[m]]`` ([T·tm, N] -> [M, N]); rows past Σ sizes are zero."""
    rows = jnp.take(out_tiles, jnp.maximum(tiles.out_row_M, 0), axis=0)
    return jnp.where(tiles.out_row_M[:, None] >= 0, rows, 0).astype(out_dtype)


def gather_cols(out_tiles_t: jax.Array, tiles: TileMap, out_dtype) -> jax.Array:
    """As ``gather_rows`` for transposed tile outputs ``[N, T·tm]`` (swap-AB kernels)."""
    cols = jnp.take(out_tiles_t, jnp.maximum(tiles.out_row_M, 0), axis=1).T
    return jnp.where(tiles.out_row_M[:, None] >= 0, cols, 0).astype(out_dtype)
