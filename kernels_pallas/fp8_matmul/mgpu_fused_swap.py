"""The fused (BF16/F16 x) decode step of the Hopper FP8 matmul (``pallas_mosaic_gpu.py``): a
swap-AB tile whose compute warpgroups quantize the tile's x rows per 128-K slice in-kernel.

A decode GEMM (M <= 64) is bound by its weight bytes; its x slice is a few KiB. Quantizing x
inside the GEMM saves the ``act_quantize`` launch before it (and at M = 16 the padding to the
32-row tile that FP8 x needs: ``mgpu_config.FUSED_ROW_ALIGN``), if the quantization's
instructions fit under the step's weight bytes. So the work is split, not repeated: every x
row of every slice is quantized once per CTA (both compute warpgroups use the whole x tile as
their wgmma B operand):

  * with two compute warpgroups and two or more slices a step, warpgroup ``w`` quantizes the
    slices ``j = w, w + 2, ...``; with one slice a step, the two halves of its rows;
  * the FP8 tile goes to SMEM (the wgmma operand), its per-row scales to SMEM too, read back
    in the accumulator's column layout (the row amax comes out one per x row in the layout of
    x's rows; the promotion needs one per accumulator column);
  * the warpgroups then meet at an mbarrier (one arrival each) before their wgmmas read the
    tile. Two buffers alternate by step parity: a warpgroup writes buffer ``p`` again only
    after the barrier of the step between, which the other warpgroup reaches only once its
    wgmmas of step ``p`` (waited for in ``promote``) have read it.

The arithmetic is ``quantize_activations``' (``mgpu_k_step.quantize_rows``, shared with the
prefill fused kernel: ``s = max(amax, tiny) / fp8_max``, ``x̂ = cast(x · (fp8_max / max(amax,
tiny)))``, no clip; one division per row, not per element). In interpret mode the kernel
equals the quantize-once kernel bit for bit. On a GPU the per-row ``fp8_max / den`` is an IEEE
division, XLA's is ``div.full.f32`` (<= 2 ulp apart: ``act_quantize.div_xla``), so a value on a
rounding boundary may land one FP8 step away; the device tests' tolerance covers it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.fp8_matmul.mgpu_config import _WGMMA_M, GROUP, MgpuConfig, fused_unit_rows
from kernels_pallas.fp8_matmul.mgpu_k_step import promote, quantize_rows


def _rows_layout(rows: int):
    """A register layout of a [rows, 128] BF16 tile whose row amax Mosaic GPU can take (its
    layout inference finds none below 64 rows; 64-row multiples take the WGMMA layout).
    32 rows: the WGMMA layout's arrangement with 8 rows per warp instead of 16 (each row's 128
    elements over 4 lanes x 16 column tiles of 2: 32 per thread). 16 rows: 4 rows per warp, each
    row's 128 elements over 8 lanes x 8 column tiles of 2 (16 per thread)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    if rows == 32:
        tiling = fa.Tiling(((32, 8), (8, 8), (2,)))
        return plgpu.Layout.TILED(tiling, warp_dims=(-5,), lane_dims=(-3, -2), vector_dim=-1)
    tiling = fa.Tiling(((16, 128), (4, 16), (2,)))
    return plgpu.Layout.TILED(tiling, warp_dims=(-5,), lane_dims=(-3, -2), vector_dim=-1)


def _quantize(x_ref, wdt):
    """(FP8 values, f32 scale per row) of the [rows, 128] x slice in SMEM."""
    rows = x_ref.shape[0]
    x = x_ref[...] if rows % _WGMMA_M == 0 else plgpu.load(x_ref, layout=_rows_layout(rows))
    return quantize_rows(x, wdt)


def shared(cfg: MgpuConfig, interpret: bool) -> bool:
    """Whether the compute warpgroups split the quantization (else each quantizes every slice
    into its own buffer: one warpgroup, or GPU interpret mode with in-cluster split-K, whose
    emulated cluster deadlocks on the warpgroups' barrier; the step's arithmetic is the same)."""
    return cfg.num_compute_wgs > 1 and not (interpret and cfg.cluster_k)


def _units(cfg: MgpuConfig, wg, share: bool) -> tuple[list, int]:
    """(the (slice, first row) of each unit compute warpgroup ``wg`` quantizes per step, the
    rows of a unit): every slice alone; shared, its slices, or its half of one
    (``fused_unit_rows``)."""
    nwg, ks = cfg.num_compute_wgs, cfg.k_slices
    if not share:
        return [(j, 0) for j in range(ks)], cfg.block_m
    rows = fused_unit_rows(cfg)
    if ks >= nwg:
        return [(t * nwg + wg, 0) for t in range(ks // nwg)], rows
    return [(0, wg * rows)], rows


def scratch(cfg: MgpuConfig, wdt, transforms, interpret: bool = False):
    """SMEM of the fused swap-AB step: FP8 x tiles and scales, [buffers, k_slices, block_m(, 128)]
    (a buffer per compute warpgroup: by step parity where they share the work, ``shared``, else
    its own), and the shared buffers' mbarrier pair."""
    bufs = cfg.num_compute_wgs
    xq = plgpu.SMEM((bufs, cfg.k_slices, cfg.block_m, GROUP), wdt, transforms=transforms)
    sq = plgpu.SMEM((bufs, cfg.k_slices, cfg.block_m), jnp.float32)
    share = shared(cfg, interpret)
    bar = plgpu.Barrier(num_arrivals=cfg.num_compute_wgs, num_barriers=2) if share else None
    return xq, sq, bar


def step(x_smem, w_smem, acc, sws, scratch_refs, idx, *, cfg: MgpuConfig, wdt):
    """Pipeline step ``idx`` of one compute warpgroup: quantize its share of the step's x
    slices, meet the other warpgroup, then per slice (``sws``: their weight scales) the wgmma
    of its 64 weight rows against the whole FP8 x tile and the promotion."""
    xq_smem, sq_smem, bar = scratch_refs
    wg = lax.axis_index("wg")
    share = bar is not None
    buf = lax.rem(idx, 2) if share else wg
    units, rows = _units(cfg, wg, share)
    for j, r0 in units:
        xq, s = _quantize(x_smem.at[pl.ds(r0, rows), pl.ds(j * GROUP, GROUP)], wdt)
        xq_smem[buf, j, pl.ds(r0, rows)] = xq
        sq_smem[buf, j, pl.ds(r0, rows)] = s
    plgpu.commit_smem()  # visible to the wgmmas (async proxy) and this warpgroup's threads
    if share:  # and to the other warpgroup
        plgpu.barrier_arrive(bar.at[buf])
        plgpu.barrier_wait(bar.at[buf])
    w_rows = pl.ds(wg * _WGMMA_M, _WGMMA_M)
    for j, sw in enumerate(sws):
        sx = sq_smem[buf, j]  # read before the wgmma: its reads are done once the wgmma is issued
        acc = promote(acc, w_smem.at[w_rows, pl.ds(j * GROUP, GROUP)], xq_smem.at[buf, j].T,
                      sx, sw, True)  # fmt: skip
    return acc
