"""The per-K-step pieces of the Hopper FP8 matmul kernels (``pallas_mosaic_gpu.py`` and the
grouped MoE kernel, ``grouped_fp8_matmul/pallas_mosaic_gpu.py``): the K-step pipeline's operands
and SMEM transforms, the in-register 1x128 quantization of the fused variant, and the wgmma of
one 128-K slice into a fresh f32 accumulator promoted with the block scales (one or two
sub-tiles per compute warpgroup), and the step of two slices whose promotions run under the
wgmmas (``MgpuConfig.overlap``). The kernels' structure and tile orders are described there."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.fp8_matmul.mgpu_config import _WGMMA_M, _WIDE_SUB_N, GROUP, MgpuConfig
from kernels_pallas.qarray import SCALE_TINY, fp8_max
from kernels_pallas.quantize import inverse_fp8_max


def smem_transforms(dtype, minor: int):
    """The SMEM tiling and swizzle of a buffer whose minor dimension holds ``minor`` elements
    (the widest swizzle that row allows: 128 B for a 128-wide FP8 K row)."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def quantize_rows(x, fp8_dtype):
    """In-register 1x128 quantization of a [rows, 128] tile: (x_fp8, f32 scale per row), with
    ``quantize_activations``' arithmetic: ``x̂ = cast(x · (fp8_max / max(amax, tiny)))``, one
    division per row and a multiply per element, and ``s = max(amax, tiny) · rn(1 / fp8_max)``.
    No clip: ``|x| <= amax`` keeps the product within ``fp8_max`` up to one f32 rounding, which
    the cast's round-to-nearest absorbs (the FP8 ulp at 448 is 32)."""
    x = x.astype(jnp.float32)
    den = jnp.maximum(jnp.max(jnp.abs(x), axis=1), SCALE_TINY)
    inv = fp8_max(fp8_dtype) / den
    xq = (x * lax.broadcast_in_dim(inv, x.shape, [0])).astype(fp8_dtype)
    return xq, den * inverse_fp8_max(fp8_dtype)


def pipeline_operands(x_gmem, sx_gmem, w_gmem, m_slice, n_slice, k_part=0, *, cfg, fused, wdt):
    """(BlockSpecs, GMEM views) of the K-step pipeline: x [bm, kb], K-major w [bn, kb], and
    the x scales [k_slices, bm] unless fused or ``overlap`` (kb = ``cfg.k_block``: 128, 256
    with ``overlap``, 128 x ``k_slices`` on swap-AB tiles; transforms keyed on the 128-byte K
    row)."""
    bm, bn, kb = cfg.block_m, cfg.block_n, cfg.k_block
    in_specs = [
        plgpu.BlockSpec(
            (bm, kb), lambda kk: (0, kk), transforms=smem_transforms(x_gmem.dtype, GROUP)
        ),
        plgpu.BlockSpec(
            (bn, kb),
            lambda kk: (0, kk),
            transforms=smem_transforms(wdt, GROUP),
            # a 2-CTA cluster along M shares the weight tile: one TMA multicast to both SMs
            collective_axes=("c",) if cfg.cluster_m > 1 else (),
        ),  # fmt: skip
    ]
    steps = w_gmem.shape[1] // GROUP // cfg.split_k  # 128-K slices per chunk
    k_cols, k_rows = pl.ds(k_part * steps * GROUP, steps * GROUP), pl.ds(k_part * steps, steps)
    gmem_in = [x_gmem.at[m_slice, k_cols], w_gmem.at[n_slice, k_cols]]
    if not (fused or cfg.overlap):  # overlap: each warpgroup loads its x scales (k_pair_overlap)
        in_specs.append(plgpu.BlockSpec((cfg.k_slices, bm), lambda kk: (kk, 0)))
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
    """One pipeline step of one compute warpgroup: ``acc + (x̂ ŵᵀ)_kb · s_x · s_w`` (or
    transposed) per 128-K slice: one, or ``cfg.k_slices`` on swap-AB tiles (``sw``: then a
    tuple of their weight scales), each its own wgmma, wait and promotion."""
    wg = lax.axis_index("wg")
    tm, swap = _WGMMA_M, cfg.swap_ab
    wg_rows = pl.ds(wg * tm, tm)
    if cfg.k_slices > 1:  # swap-AB only (MgpuConfig.invalid): the slices in turn
        for j, sw_j in enumerate(sw):
            cols = pl.ds(j * GROUP, GROUP)
            acc = promote(acc, w_smem.at[wg_rows, cols], x_smem.at[:, cols].T, sx_ref[j, :],
                          sw_j, swap)  # fmt: skip
        return acc
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


_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma accumulator


def overlap_init(running):
    """The carry of ``k_pair_overlap`` before the first step: no pending product (zeros, scale
    0: the first promotion adds nothing)."""
    zero_rows = plgpu.layout_cast(jnp.zeros((_WGMMA_M,), jnp.float32), _ROW)
    return running, jnp.zeros_like(running), zero_rows, jnp.float32(0.0)


def _promote_pending(running, pending, sx, sw):
    return running + pending * lax.broadcast_in_dim(sx * sw, running.shape, [0])


def overlap_finish(carry):
    """The running accumulator with the last slice's product promoted (after the pipeline)."""
    return _promote_pending(*carry)


def overlap_scales(sx_gmem, kb, rows):
    """The x scales of step ``kb``'s two 128-K slices for a warpgroup's 64 ``rows``, loaded
    from GMEM into registers (``sx_gmem`` [K/128, M_pad]): their first use is the promotion
    one slice later, under a wgmma, so their latency hides, and the ring keeps the SMEM of a
    third stage (three stages of 128x256 x and w tiles, the 32 KiB epilogue tile and 1 KiB of
    x scales per stage would miss the 227 KiB budget by 48 bytes: the ring's barriers)."""
    return tuple(plgpu.load(sx_gmem.at[2 * kb + j, rows], layout=_ROW, optimized=False)
                 for j in range(2))  # fmt: skip


def k_pair_overlap(x_smem, w_smem, sxs, carry, sws):
    """One pipeline step of two 128-K slices for a compute warpgroup whose promotions run under
    its wgmmas (``MgpuConfig.overlap``): per slice, issue its wgmma into a fresh accumulator,
    promote the previous slice's product (carried with its scales: ``carry`` = (running
    accumulator, pending product, s_x of that slice per row, its s_w)) while it runs, wait,
    and carry the slice's product on. The tensor core no longer idles through a promotion (it
    does in ``k_step``: wgmma, wait, promote), for the pending 64x128 f32 product in registers
    beside the running and fresh accumulators. Two slices per step, so that the two fresh
    accumulators alternate: with one slice per step ptxas keeps every wgmma's accumulator in
    the same registers and copies the carried product out of them first (64 moves before each
    wgmma); and each wgmma is waited for inside its step, so none is in flight across the
    loop's back edge (ptxas then serializes every wgmma of the loop: warning C7514) and the
    step's SMEM slots are released as usual. ``sxs``, ``sws``: each slice's x scales (this
    warpgroup's rows, ``overlap_scales``) and weight scale."""
    wg_rows = pl.ds(lax.axis_index("wg") * _WGMMA_M, _WGMMA_M)
    for j, sw in enumerate(sws):
        running, pending, sx_prev, sw_prev = carry
        cols = pl.ds(j * GROUP, GROUP)

        def mma(acc_ref, running=running, pending=pending, sx_prev=sx_prev, sw_prev=sw_prev,
                cols=cols):  # fmt: skip
            plgpu.wgmma(acc_ref, x_smem.at[wg_rows, cols], w_smem.at[:, cols].T)
            promoted = _promote_pending(running, pending, sx_prev, sw_prev)  # under the wgmma
            plgpu.wgmma_wait(0)
            return promoted, acc_ref[...]

        running, product = pl.run_scoped(mma, plgpu.ACC(running.shape, jnp.float32))
        carry = running, product, sxs[j], sw
    return carry
