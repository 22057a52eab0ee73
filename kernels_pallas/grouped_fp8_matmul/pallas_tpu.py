"""Grouped blockwise FP8 W8A8 matmul for TPU with Pallas Mosaic TPU (megablox-style tiling).

Grid ``(tile, n, k)`` over the tile map of ``tiles.py`` (megablox ``gmm``'s ``group_ids`` /
``m_tile_ids``), the N tiles and the K tiles; the (group, row block, live) triples arrive by
scalar prefetch, so the index maps pick the row block of ``x`` and the expert of ``w``. The math
per grid step is the dense TPU kernel's (``fp8_matmul/pallas_tpu.py``): FP8 tiles upcast in
VMEM to BF16 (lossless), one MXU product per 128-wide K group promoted into an f32 accumulator,
``acc += (x̂_g · ŵ_gᵀ) * s_x[:, g] * s_w[e, j, g]``. Each tile writes its own output tile
(``[T·tm, N]``); the wrapper gathers rows from their group's tile.

Dead tiles (past the live ones) skip the math and clamp their block indices to the last grid
step of the last live tile, so no DMA is issued for them (Pallas fetches a block only when its
index changes between consecutive steps). Several weight stacks (gate and up) run in one call:
the N tiles run over their concatenation, each stack is its own operand, and outside its N
tiles a stack's block index stays put (no DMA) while the kernel accumulates from the active one.

Layouts as in the dense kernel: ``s_x`` as ``[K/block_k, M_pad, block_k/128]`` in VMEM, ``s_w``
as ``[E, N/128, 1, K/128]`` in SMEM (the tile's row of block scales, read as scalars).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.fp8_matmul.pallas_tpu import GROUP, VMEM_BYTES, vmem_bytes
from kernels_pallas.grouped_fp8_matmul.reference import stacks
from kernels_pallas.grouped_fp8_matmul.tiles import gather_rows, make_tile_map, num_tiles
from kernels_pallas.qarray import QArray


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Tile configuration of the TPU kernel (a static argument)."""

    block_m: int | None = None  # rows per tile, a multiple of 32; None: pow2 >= M/E in [32, 512]
    block_n: int = 128  # must equal the weight N block: one weight scale per (K group, tile)
    block_k: int = 512  # K per grid step, a multiple of 128 (the largest one <= it dividing K)
    compute_dtype: str = "bfloat16"  # dtype FP8 tiles are upcast to for the MXU (lossless)


def tile_m(m: int, num_groups: int, cfg: TpuConfig) -> int:
    if cfg.block_m is not None:
        return cfg.block_m
    mean = max(-(-m // max(num_groups, 1)), 1)
    return min(max(1 << (mean - 1).bit_length(), 32), 512)


def tiles(m: int, k: int, ns: tuple[int, ...], num_groups: int, cfg: TpuConfig):
    """(block_m, block_k) for this problem (``ns``: N of each weight stack), or why the kernel
    cannot take it."""
    bm = tile_m(m, num_groups, cfg)
    if cfg.block_n != GROUP:
        return f"block_n must be {GROUP} (one weight scale per tile), got {cfg.block_n}"
    if bm % 32 or bm <= 0:
        return f"block_m={bm} must be a positive multiple of 32 (8-bit sublane tiles)"
    if cfg.block_k % GROUP or cfg.block_k <= 0:
        return f"block_k={cfg.block_k} must be a positive multiple of {GROUP}"
    if cfg.compute_dtype not in ("bfloat16", "float32"):
        return f"compute_dtype must be bfloat16 or float32, got {cfg.compute_dtype!r}"
    if k % GROUP or k == 0:
        return f"K={k} must be a positive multiple of {GROUP}"
    if any(n % cfg.block_n for n in ns):
        return f"N={'+'.join(map(str, ns))} must be multiples of {cfg.block_n}"
    if m < 1:
        return "M must be >= 1"
    block_k = max(b for b in range(GROUP, cfg.block_k + 1, GROUP) if k % b == 0)
    if (used := vmem_bytes(bm, cfg.block_n, block_k)) > VMEM_BYTES:
        return f"tiles need ~{used} B of VMEM > {VMEM_BYTES} B (smaller block_m or block_k)"
    return bm, block_k


def _kernel(meta_ref, x_ref, sx_ref, *refs, n_groups, compute_dtype, stack_tiles):
    *w_refs, out_ref, acc_ref = refs
    t, j, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def accumulate(w_ref, sw_ref):
        acc = acc_ref[...]
        for g in range(n_groups):  # static unroll over the 128-wide scale groups of this K tile
            cols = slice(g * GROUP, (g + 1) * GROUP)
            x_g = x_ref[:, cols].astype(compute_dtype)
            w_g = w_ref[:, cols].astype(compute_dtype)
            part = jax.lax.dot_general(
                x_g, w_g, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            acc = acc + part * (sx_ref[:, g : g + 1] * sw_ref[0, k * n_groups + g])
        acc_ref[...] = acc

    lo = 0
    for s, hi in enumerate(itertools.accumulate(stack_tiles)):  # the stack of this N tile
        cond = (meta_ref[2, t] != 0) & (j >= lo) & (j < hi)
        pl.when(cond)(functools.partial(accumulate, w_refs[2 * s], w_refs[2 * s + 1]))
        lo = hi

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _index_maps(stack_tiles: tuple[int, ...], nk: int):
    """Block index maps over (tile, n, k, meta). Outside its N tiles a stack's weight stays on
    the block it needs next (its first before them, its last after them); dead tiles stay on the
    last live step's blocks. Either way the index does not change, so nothing is fetched."""

    def k_eff(t, kk, meta):
        live = meta[2, t]
        return kk * live + (nk - 1) * (1 - live)

    def x_map(t, j, kk, meta):
        return meta[1, t], k_eff(t, kk, meta)

    def sx_map(t, j, kk, meta):
        return k_eff(t, kk, meta), meta[1, t], 0

    def stack_maps(lo: int, n_s: int):
        def local(t, j, kk, meta):
            live = meta[2, t]
            after = jnp.where(j >= lo + n_s, 1, 0) * live + (1 - live)  # past it, or dead
            active = jnp.where((j >= lo) & (j < lo + n_s), 1, 0) * live
            j_loc = (j - lo) * active + (n_s - 1) * after
            return j_loc, kk * active + (nk - 1) * after

        def w_map(t, j, kk, meta):
            return (meta[0, t], *local(t, j, kk, meta))

        def sw_map(t, j, kk, meta):
            return meta[0, t], local(t, j, kk, meta)[0], 0, 0

        return w_map, sw_map

    los = [0, *itertools.accumulate(stack_tiles)][:-1]
    return x_map, sx_map, [stack_maps(lo, n_s) for lo, n_s in zip(los, stack_tiles, strict=True)]


def _call(meta, x, sx, ws: tuple[QArray, ...], t: int, bm: int, block_k: int, cfg: TpuConfig,
          out_dtype, interpret):  # fmt: skip
    (e, _, k), bn = ws[0].shape, cfg.block_n
    n_groups, n = block_k // GROUP, sum(w.shape[1] for w in ws)
    stack_tiles = tuple(w.shape[1] // bn for w in ws)
    x_map, sx_map, maps = _index_maps(stack_tiles, k // block_k)
    w_specs, w_args = [], []
    for w, (w_map, sw_map) in zip(ws, maps, strict=True):
        w_specs += [
            pl.BlockSpec((None, bn, block_k), w_map),
            pl.BlockSpec((None, None, 1, k // GROUP), sw_map, memory_space=pltpu.SMEM),
        ]
        w_args += [w.values, w.scales.reshape(e, w.shape[1] // GROUP, 1, k // GROUP)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(t, n // bn, k // block_k),
        in_specs=[
            pl.BlockSpec((bm, block_k), x_map),
            pl.BlockSpec((None, bm, n_groups), sx_map),
            *w_specs,
        ],  # fmt: skip
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk, meta: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
    )
    kernel = functools.partial(_kernel, n_groups=n_groups, stack_tiles=stack_tiles,
                               compute_dtype=jnp.dtype(cfg.compute_dtype))  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t * bm, n), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(meta, x, sx, *w_args)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def grouped_fp8_matmul_tpu(
    x_q: QArray, w_q, group_sizes_E: jax.Array, *, out_dtype=jnp.bfloat16,
    interpret: bool | pltpu.InterpretParams = False, config: TpuConfig | None = None,
) -> jax.Array:  # fmt: skip
    """``y_m = Σ_g s_x[m, g] s_w[e(m), :, g] (x̂_m,g · ŵ_e(m),gᵀ)`` with an f32 VMEM accumulator.

    ``x_q``: QArray [M, K] with (128,) groups, rows sorted by group; ``w_q``: QArray [E, N, K]
    with (128, 128) blocks, or a tuple of them (one call over their concatenation along N);
    ``group_sizes_E``: int [E]. Needs K % 128 == 0 and every N % 128 == 0.
    """
    cfg = config or TpuConfig()
    ws = stacks(w_q)
    if tuple(ws[0].block_shape) != (GROUP, GROUP) or tuple(x_q.block_shape) != (GROUP,):
        raise ValueError(
            f"grouped_fp8_matmul_tpu: needs ({GROUP},) activation groups and ({GROUP}, {GROUP}) "
            f"weight blocks, got {x_q.block_shape} and {ws[0].block_shape}"
        )
    (m, k), e = x_q.shape, ws[0].shape[0]
    tl = tiles(m, k, tuple(w.shape[1] for w in ws), e, cfg)
    if isinstance(tl, str):
        raise ValueError(f"grouped_fp8_matmul_tpu: {tl}")
    bm, block_k = tl
    tmap = make_tile_map(group_sizes_E, m, bm)
    t = num_tiles(m, e, bm)
    m_pad = pl.cdiv(m, bm) * bm
    x = jnp.pad(x_q.values, ((0, m_pad - m), (0, 0)))
    # [M, K/128] -> [K/block_k, M_pad, G]: one (block_m, G) scale tile per grid step.
    sx = jnp.pad(x_q.scales, ((0, m_pad - m), (0, 0)))
    sx = sx.reshape(m_pad, k // block_k, block_k // GROUP).transpose(1, 0, 2)
    out = _call(tmap.meta_3T, x, sx, ws, t, bm, block_k, cfg, jnp.dtype(out_dtype), interpret)
    return gather_rows(out, tmap, out_dtype)
