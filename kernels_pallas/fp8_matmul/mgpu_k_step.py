"""The per-K-step pieces of the Hopper FP8 matmul kernels (``pallas_mosaic_gpu.py`` and the
grouped MoE kernel, ``grouped_fp8_matmul/pallas_mosaic_gpu.py``): the K-step pipeline's operands
and SMEM transforms, the in-register 1x128 quantization of the fused variant, and the wgmma of
one 128-K slice into a fresh f32 accumulator promoted with the block scales (one or two
sub-tiles per compute warpgroup). The kernels' structure and tile orders are described there."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.fp8_matmul.mgpu_config import _WGMMA_M, _WIDE_SUB_N, GROUP, MgpuConfig
from kernels_pallas.qarray import SCALE_TINY, fp8_max


def smem_transforms(dtype, minor: int):
    """The SMEM tiling and swizzle of a buffer whose minor dimension holds ``minor`` elements
    (the widest swizzle that row allows: 128 B for a 128-wide FP8 K row)."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def quantize_rows(x, fp8_dtype):
    """In-register 1x128 quantization of a [64, 128] tile: returns (x_fp8, scale per row)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=1)
    s = jnp.maximum(amax, SCALE_TINY) / fp8_max(fp8_dtype)
    m = fp8_max(fp8_dtype)
    xq = jnp.clip(x / lax.broadcast_in_dim(s, x.shape, [0]), -m, m).astype(fp8_dtype)
    return xq, s


def pipeline_operands(x_gmem, sx_gmem, w_gmem, m_slice, n_slice, k_part=0, *, cfg, fused, wdt):
    """(BlockSpecs, GMEM views) of the K-step pipeline: x [bm, 128], K-major w [bn, 128], and
    the x scales [1, bm] unless fused (transforms keyed on the 128-byte K row)."""
    bm, bn = cfg.block_m, cfg.block_n
    in_specs = [
        plgpu.BlockSpec(
            (bm, GROUP), lambda kk: (0, kk), transforms=smem_transforms(x_gmem.dtype, GROUP)
        ),
        plgpu.BlockSpec(
            (bn, GROUP),
            lambda kk: (0, kk),
            transforms=smem_transforms(wdt, GROUP),
            # a 2-CTA cluster along M shares the weight tile: one TMA multicast to both SMs
            collective_axes=("c",) if cfg.cluster_m > 1 else (),
        ),  # fmt: skip
    ]
    steps = w_gmem.shape[1] // GROUP // cfg.split_k
    k_cols, k_rows = pl.ds(k_part * steps * GROUP, steps * GROUP), pl.ds(k_part * steps, steps)
    gmem_in = [x_gmem.at[m_slice, k_cols], w_gmem.at[n_slice, k_cols]]
    if not fused:
        in_specs.append(plgpu.BlockSpec((1, bm), lambda kk: (kk, 0)))
        gmem_in.append(sx_gmem.at[k_rows, m_slice])
    return in_specs, gmem_in


def promote(acc, lhs, rhs, sx, sw, swap: bool, zero=None):
    """``acc + (lhs · rhs) · s_x · s_w``: one wgmma into a fresh f32 accumulator (zeros, or the
    given ``zero``), waited for, then promoted in registers (s_x per row, or per column when
    swapped; s_w a scalar)."""

    def mma(acc_ref):
        if zero is not None:
            acc_ref[...] = zero
        plgpu.wgmma(acc_ref, lhs, rhs)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    acc_k = pl.run_scoped(mma, plgpu.ACC(acc.shape, jnp.float32))
    scale = lax.broadcast_in_dim(sx * sw, acc.shape, [1 if swap else 0])
    return acc + acc_k * scale


def k_step(x_smem, w_smem, sx_ref, acc, sw, xq_smem, *, cfg: MgpuConfig, fused: bool, wdt):
    """One 128-K step of one compute warpgroup: ``acc + (x̂ ŵᵀ)_kb · s_x · s_w`` (or transposed)."""
    wg = lax.axis_index("wg")
    tm, swap = _WGMMA_M, cfg.swap_ab
    wg_rows = pl.ds(wg * tm, tm)
    if fused:  # each warpgroup quantizes its 64 x rows (never swapped: see supports)
        xq, sx = quantize_rows(x_smem[wg_rows, :], wdt)
        xq_smem[wg] = xq
        plgpu.commit_smem()  # make the register->SMEM stores visible to the wgmma
        x_op = xq_smem.at[wg]
    else:
        sx = sx_ref[0, :] if swap else sx_ref[0, wg_rows]
        x_op = x_smem if swap else x_smem.at[wg_rows]
    lhs, rhs = (w_smem.at[wg_rows], x_op.T) if swap else (x_op, w_smem.T)
    return promote(acc, lhs, rhs, sx, sw, swap)


def k_step_wide(x_smem, w_smem, sx_ref, accs, sws, *, cfg: MgpuConfig, chain: bool = True):
    """One 128-K step of a warpgroup owning two 64x128 sub-tiles (``MgpuConfig.wg_subtiles``):
    wgmma, wait and promotion per sub-tile, in turn (``sws``: the weight scale of each
    128-column block of the CTA).

    Each sub-tile's fresh accumulator starts from ``previous promoted sub-tile x 0.0`` rather
    than from constant zeros: that data dependence keeps ptxas from issuing the next wgmma before
    the previous promotion is done, which needs a third 64-register accumulator (ptxas 12.9
    interleaves them and spills 280 B/thread otherwise; costs 64 FMULs per step). Finite
    outputs are unchanged; a non-finite promoted element (NaN input, f32 overflow) also makes
    the same element of the warpgroup's next sub-tile NaN. ``chain=False`` (GPU interpret mode,
    which cannot store into a wgmma accumulator ref) starts from zeros."""
    wg_m = cfg.block_m // cfg.num_compute_wgs
    base = lax.axis_index("wg") * wg_m
    out = []
    for acc, (r, c) in zip(accs, cfg.wg_subtiles, strict=True):
        rows = pl.ds(base + r, _WGMMA_M)
        w_op = w_smem.at[pl.ds(c, _WIDE_SUB_N)].T
        zero = out[-1] * 0.0 if out and chain else None
        out.append(promote(acc, x_smem.at[rows], w_op, sx_ref[0, rows], sws[c // GROUP], False,
                            zero))  # fmt: skip
    return tuple(out)
