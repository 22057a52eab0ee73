"""BF16 grouped matmul for Hopper (sm_90) with Pallas Mosaic GPU: the MoE experts' training GEMMs.

XLA:GPU lowers ``jax.lax.ragged_dot`` densely: every row times every group's weight, then a
select (a lone ``ragged_dot`` compiled for H100 makes ``bf16[M, E, N]`` in the forward and
``f32[E, M, K]`` in the gradient). For Qwen3-30B-A3B's local dispatch buffer (E/n = 16 experts at
expert = 8, ~1/8 of its rows live) that is ~128x the useful FLOPs. These kernels compute the live
rows only:

  * ``gmm``: ``y = x · w[e]`` (or ``x · w[e]ᵀ``, the input gradient) over the row tiles of
    ``grouped_fp8_matmul``'s tile map (``tiles.py``: one CTA per (tile, N tile), a tile = one
    aligned row block times one group's weight; dead tiles past ``Σ sizes`` return at once), a
    single warpgroup running a ``plgpu.emit_pipeline`` ring of (bm, bk) x (bk, bn) BF16 slices
    into one wgmma accumulator (jax ``ragged_dot_mgpu``'s structure, without its persistent loop
    and with the dead tiles skipped);
  * ``tgmm``: ``dw_e = Σ_{m ∈ e} x_mᵀ dy_m``: one CTA per (group, K tile, N tile) runs a
    pipeline over the row blocks the group's rows touch, its length read from GMEM at run time
    (as jax ``transposed_ragged_dot_mgpu`` does), the x slice transposed in SMEM as the wgmma A
    operand; in the group's first and last blocks the other groups' rows of x are zeroed in SMEM
    first. Empty groups write zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.grouped_fp8_matmul.tiles import (
    gather_rows,
    group_bounds,
    make_tile_map,
    num_tiles,
)

SMEM_BYTES = 227 * 1024  # H100 dynamic shared memory per CTA
_MAX_GRID = 2**31 - 1
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Tiles of both kernels: output ``block_m x block_n`` per CTA, ``block_k`` per pipeline step.

    For ``tgmm`` the output tile is (K tile ``block_m``, N tile ``block_n``) and ``block_k`` is the
    row block of the contraction over a group's rows."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4

    def smem_bytes(self, itemsize: int, out_itemsize: int) -> int:
        ring = self.max_concurrent_steps * (self.block_m + self.block_n) * self.block_k * itemsize
        return ring + self.block_m * self.block_n * out_itemsize


def default_config(k: int, n: int) -> GmmConfig:
    """128-wide tiles where K and N allow, else 64 (e.g. a 64-wide expert in tests)."""
    b = 128 if k % 128 == 0 and n % 128 == 0 else 64
    return GmmConfig(block_m=b, block_n=b)


def supports(m: int, k: int, n: int, dtype, cfg: GmmConfig, *, out_itemsize: int = 4) -> str | None:
    """None if the forward, the input gradient and the weight gradient all compile for rows
    [M, K] x [E, K, N] with this config, else why not (the output tile in SMEM is sized for
    ``out_itemsize``: f32 for ``tgmm``). The forward tiles N by ``block_n`` and contracts K by
    ``block_k``; the input gradient tiles K by ``block_n`` and contracts N by ``block_k``; the
    weight gradient tiles K by ``block_m`` and N by ``block_n``."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"operands must be bfloat16 or float16, got {jnp.dtype(dtype)}"
    if cfg.block_m % 64 or cfg.block_n % 64 or cfg.block_k % 64:
        return f"tiles {cfg.block_m}x{cfg.block_n}x{cfg.block_k} must be multiples of 64"
    if cfg.max_concurrent_steps < 2:
        return "max_concurrent_steps must be >= 2 (the ring releases a slot one step late)"
    tiles = (cfg.block_k, cfg.block_n, cfg.block_m)
    for name, dim, blocks in (("K", k, tiles), ("N", n, tiles[:2])):
        if any(dim % b for b in blocks):
            return f"{name}={dim} must be a multiple of the tiles {blocks} along it"
    if m < 1:
        return "M must be >= 1"
    used = cfg.smem_bytes(jnp.dtype(dtype).itemsize, out_itemsize)
    if used > SMEM_BYTES:
        return f"tiles need {used} B of SMEM > {SMEM_BYTES} B (fewer stages or smaller tiles)"
    return None


def _store(acc, out_gmem_tile):
    """The f32 accumulator through SMEM to its GMEM tile (one TMA store)."""

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM(acc.shape, out_gmem_tile.dtype))
    def _(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem_tile)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _gmm_kernel(meta_gmem, x_gmem, w_gmem, out_gmem, *, cfg: GmmConfig, transpose_w: bool):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    t_idx, n_idx = lax.axis_index("t"), lax.axis_index("n")
    group, block, live = meta_gmem[0, t_idx], meta_gmem[1, t_idx], meta_gmem[2, t_idx]
    k_steps = x_gmem.shape[1] // bk

    @pl.when(live != 0)
    def _():
        def acc_scope(acc_ref):
            def step(_, x_smem, w_smem):
                plgpu.wgmma(acc_ref, x_smem, w_smem.T if transpose_w else w_smem)

            w_spec = (
                plgpu.BlockSpec((bn, bk), lambda s: (n_idx, s), delay_release=1)
                if transpose_w
                else plgpu.BlockSpec((bk, bn), lambda s: (s, n_idx), delay_release=1)
            )
            plgpu.emit_pipeline(
                step,
                grid=(k_steps,),
                in_specs=[plgpu.BlockSpec((bm, bk), lambda s: (block, s), delay_release=1), w_spec],
                max_concurrent_steps=cfg.max_concurrent_steps,
            )(x_gmem, w_gmem.at[group])
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))
        _store(acc, out_gmem.at[pl.ds(t_idx * bm, bm), pl.ds(n_idx * bn, bn)])


def _tgmm_kernel(meta_gmem, x_gmem, dy_gmem, out_gmem, *, cfg: GmmConfig):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    e_idx, m_idx, n_idx = lax.axis_index("e"), lax.axis_index("m"), lax.axis_index("n")
    start, end = meta_gmem[0, e_idx], meta_gmem[1, e_idx]  # the group's rows [start, end)
    first = start // bk
    count = jnp.where(end > start, (end + bk - 1) // bk - first, 0)
    itemsize = jnp.dtype(x_gmem.dtype).itemsize
    swizzle = plgpu.find_swizzle(bm * itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

    def row_blocks(width: int, col_idx):  # the group's row blocks [bk, width] of x or dy
        return plgpu.BlockSpec((bk, width), lambda r: (first + r, col_idx), delay_release=1,
                               transforms=transforms)  # fmt: skip

    def acc_scope(acc_ref):
        def step(idx, x_smem, dy_smem):
            r = idx[0]

            # The group's first and last row blocks hold other groups' rows: zero them in x
            # (dw = xᵀ dy, so that drops their dy rows too). Rows past M arrive as TMA's zeros.
            @pl.when((r == 0) | (r == count - 1))
            def _():
                rows = (first + r) * bk + plgpu.layout_cast(
                    lax.broadcasted_iota(jnp.int32, (bk, bm), 0), plgpu.Layout.WGMMA
                )
                keep = ((rows >= start) & (rows < end)).astype(x_smem.dtype)
                x_smem[...] = x_smem[...] * keep
                plgpu.commit_smem()

            plgpu.wgmma(acc_ref, x_smem.T, dy_smem)  # [bk rows, bm]ᵀ · [bk rows, bn]

        @pl.when(count > 0)
        def _():
            plgpu.emit_pipeline(
                step,
                grid=(count,),
                in_specs=[row_blocks(bm, m_idx), row_blocks(bn, n_idx)],  # x, dy
                max_concurrent_steps=cfg.max_concurrent_steps,
            )(x_gmem, dy_gmem)

        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))
    _store(acc, out_gmem.at[e_idx, pl.ds(m_idx * bm, bm), pl.ds(n_idx * bn, bn)])


def _interpret(interpret: bool) -> dict:
    return {"interpret": plgpu.InterpretGPUParams()} if interpret else {}


_PARAMS = dict(
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
)


@functools.partial(jax.jit, static_argnames=("transpose_w", "out_dtype", "config", "interpret"))
def gmm_mgpu(x_MK, w, group_sizes_E, *, transpose_w: bool = False, out_dtype=None,
             config: GmmConfig | None = None, interpret: bool = False) -> jax.Array:  # fmt: skip
    """``y_m = x_m · w[e(m)]`` [M, N] (``w`` [E, K, N]), or with ``transpose_w`` ``x_m · w[e(m)]ᵀ``
    (``w`` [E, N, K]: the input gradient against the forward's stacks); rows past ``Σ sizes``
    are zero. f32 accumulation, ``out_dtype`` (default x's) output."""
    m, k = x_MK.shape
    e = w.shape[0]
    n = w.shape[1] if transpose_w else w.shape[2]
    cfg = config or default_config(k, n)
    out_dtype = jnp.dtype(out_dtype or x_MK.dtype)
    tiles = make_tile_map(group_sizes_E, m, cfg.block_m)
    t = num_tiles(m, e, cfg.block_m)
    m_pad = pl.cdiv(m, cfg.block_m) * cfg.block_m
    x = jnp.pad(x_MK.astype(w.dtype), ((0, m_pad - m), (0, 0)))
    kern = plgpu.kernel(
        functools.partial(_gmm_kernel, cfg=cfg, transpose_w=transpose_w),
        out_type=jax.ShapeDtypeStruct((t * cfg.block_m, n), out_dtype),
        grid=(t, n // cfg.block_n),
        grid_names=("t", "n"),
        **_PARAMS,
        **_interpret(interpret),
    )
    return gather_rows(kern(tiles.meta_3T, x, w), tiles, out_dtype)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def tgmm_mgpu(x_MK, dy_MN, group_sizes_E, *, config: GmmConfig | None = None,
              interpret: bool = False) -> jax.Array:  # fmt: skip
    """``dw_e = Σ_{m ∈ e} x_mᵀ dy_m`` [E, K, N] in f32 (rows past ``Σ sizes`` contribute 0)."""
    (m, k), n = x_MK.shape, dy_MN.shape[1]
    cfg = config or default_config(k, n)
    e = group_sizes_E.shape[0]
    starts, ends = group_bounds(group_sizes_E, m)
    kern = plgpu.kernel(
        functools.partial(_tgmm_kernel, cfg=cfg),
        out_type=jax.ShapeDtypeStruct((e, k, n), jnp.float32),
        grid=(e, k // cfg.block_m, n // cfg.block_n),
        grid_names=("e", "m", "n"),
        **_PARAMS,
        **_interpret(interpret),
    )
    return kern(jnp.stack([starts, ends]), x_MK, dy_MN.astype(x_MK.dtype))
