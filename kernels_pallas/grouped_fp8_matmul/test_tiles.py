"""The grouped kernels' row tiles (``tiles.py``): the tile map and the ragged stores' tile meta
by hand and as invariants over random routings, and the group search without a loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_fp8_matmul import make_tile_map, num_tiles
from kernels_pallas.grouped_fp8_matmul import tiles as tiles_mod


def test_tile_map_hand_case():
    # tm=4; groups 1 (rows 0-4), 3 (rows 5-7), 4 (rows 8-16); rows 17-19 past Σ sizes.
    # Tiles: (g1, block 0), (g1, b1), (g3, b1), (g4, b2), (g4, b3), (g4, b4); 4 dead tiles repeat
    # the last live one; num_tiles = cdiv(20, 4) + min(6, 20) - 1 = 10.
    tiles = make_tile_map(jnp.array([0, 5, 0, 3, 9, 0]), 20, 4)
    np.testing.assert_array_equal(tiles.group_T, [1, 1, 3, 4, 4, 4, 4, 4, 4, 4])
    np.testing.assert_array_equal(tiles.block_T, [0, 1, 1, 2, 3, 4, 4, 4, 4, 4])
    np.testing.assert_array_equal(tiles.live_T, [1] * 6 + [0] * 4)
    expect = [0, 1, 2, 3, 4, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, -1, -1, -1]
    np.testing.assert_array_equal(tiles.out_row_M, expect)


def test_ragged_meta_hand_case():
    # The groups of test_tile_map_hand_case (tm=4) plus rows 17-19 as a seventh, zero group:
    # (group, block, mode, first row in the block, rows) per tile; num_tiles(20, 7, 4) = 11.
    meta = np.asarray(tiles_mod.ragged_meta(jnp.array([0, 5, 0, 3, 9, 0]), 20, 4))
    live = [(1, 0, 1, 0, 4), (1, 1, 1, 0, 1), (3, 1, 1, 1, 3), (4, 2, 1, 0, 4), (4, 3, 1, 0, 4),
            (4, 4, 1, 0, 1), (5, 4, 2, 1, 3)]  # fmt: skip
    assert meta.shape == (5, 11)
    np.testing.assert_array_equal(meta[:, :7].T, live)
    np.testing.assert_array_equal(meta[2, 7:], 0)  # dead


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tile_m", [1, 8, 32])
def test_ragged_meta_covers_every_row_once(seed, tile_m):
    """The live tiles' row ranges cover each row of its group exactly once, in the group's
    own row block; the zero tiles cover exactly the rows past Σ sizes."""
    rng = np.random.default_rng(seed)
    e, m = 12, 70
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.ones(e) * 0.3))
    meta = np.asarray(tiles_mod.ragged_meta(jnp.asarray(sizes, jnp.int32), m, tile_m))
    assert meta.shape == (5, num_tiles(m, e + 1, tile_m))
    covered = np.full(m, -1)
    for g, block, mode, first, count in meta.T:
        if mode == 0:
            continue
        rows = block * tile_m + np.arange(first, first + count)
        assert first >= 0 and count > 0 and first + count <= tile_m
        assert (covered[rows] == -1).all()
        covered[rows] = g if mode == 1 else e
    np.testing.assert_array_equal(covered, np.append(np.repeat(np.arange(e), sizes),
                                                     np.full(m - sizes.sum(), e)))  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tile_m", [1, 8, 32])
def test_tile_map_invariants(seed, tile_m):
    """Each row's output row is in a live tile of its own group and row block; the live tiles
    are distinct and fit the static bound."""
    rng = np.random.default_rng(seed)
    e, m = 12, 70
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.ones(e) * 0.3))
    tiles = make_tile_map(jnp.asarray(sizes, jnp.int32), m, tile_m)
    group, block, live = (np.asarray(a) for a in (tiles.group_T, tiles.block_T, tiles.live_T))
    assert len(group) == num_tiles(m, e, tile_m)
    row_group = np.repeat(np.arange(e), sizes)
    out_row = np.asarray(tiles.out_row_M)
    assert (out_row[len(row_group) :] == -1).all()
    for r, g in enumerate(row_group):
        t, i = divmod(out_row[r], tile_m)
        assert live[t] and group[t] == g and block[t] * tile_m + i == r
    pairs = {(g, b) for g, b, lv in zip(group, block, live, strict=True) if lv}
    assert len(pairs) == live.sum()


def test_tile_map_searches_without_a_loop():
    """``tiles.group_of`` is ``searchsorted(side="right")`` (random sorted ends, queries past
    both ends), and the tile map compiles to no ``while``: on a GPU each iteration of the
    default binary search launches its fusions, ~40 launches per search per decode step."""
    rng = np.random.default_rng(3)
    ends = np.sort(rng.integers(0, 300, 64)).astype(np.int32)
    i = np.arange(-2, 310, dtype=np.int32)
    np.testing.assert_array_equal(tiles_mod.group_of(jnp.asarray(ends), jnp.asarray(i)),
                                  np.searchsorted(ends, i, side="right"))  # fmt: skip
    text = jax.jit(make_tile_map, static_argnums=(1, 2)).lower(
        jnp.zeros((128,), jnp.int32), 512, 32).as_text()  # fmt: skip
    assert "while" not in text
