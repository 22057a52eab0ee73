"""Blockwise FP8 W8A8 matmul for Hopper (sm_90) with Pallas Mosaic GPU.

DeepGEMM ``sm90_fp8_gemm_1d2d`` structure: a warp-specialized pipeline (one TMA warpgroup, one or
two compute warpgroups) streams 128-wide K slices of ``x`` and ``w`` into an SMEM ring; each
compute warpgroup runs one FP8 wgmma per slice into a fresh f32 accumulator ``acc_k`` and promotes
it in registers, ``acc += acc_k * s_x[m, kb] * s_w[nb, kb]``. Promoting every 128 K keeps the
tensor core's limited-precision FP8 accumulation short (DeepSeek-V3 §3.3.2).

8-bit wgmma takes both operands K-major (``wgmma.py``: "Only f16 WGMMA supports transposes"), so
the weight is stored ``[N, K]`` (the QArray weight convention, ``qarray.py``) and its SMEM tile
``(block_n, 128)`` enters the wgmma as ``w_smem.T``; SMEM transforms key on the 128-byte K row
(tiling (8, 128), swizzle 128). Two tile orders:

  * ``swap_ab=False`` (prefill): ``y[m, n] = x[m, :] · w[n, :]``, A = x rows (64 per compute
    warpgroup), B = ``w_smem.T``;
  * ``swap_ab=True`` (decode: M <= 64, and 65-256 rows where K splits: ``swap_default``):
    ``yᵀ[n, m] = w[n, :] · x[m, :]``, A = 64 weight rows per warpgroup, B = ``x_smem.T``: M becomes
    the wgmma N (8..128, a multiple of 8) instead of being padded to 64 or 128 rows, both operands
    stay K-major (tokamax sm90 swap-AB), and K splits over CTAs (``split_k``). The epilogue stores
    the yᵀ accumulator through a transposed SMEM view, so the kernel writes ``y [M_pad, N]``: no
    transpose after it (one XLA launch fewer at decode, where launches decide). F32 tiles (F32 out,
    split-K partials) have no transposed store: those write ``yᵀ``, transposed by the XLA fusion
    that sums the partials.

Two-slice decode stages (``MgpuConfig.k_slices``, the decode default where 3-4 such stages
fit): each pipeline step of a swap-AB tile brings two (or four) 128-K slices of x and w, 256-512
contiguous bytes of every weight row per TMA, and each compute warpgroup runs the slices'
wgmmas and promotions in turn, each with its own x and weight scales: twice the bytes in flight
per SM on a memory-bound GEMM that runs one CTA per SM (``mgpu_config._DECODE_K_SLICES``).

Dependent launch (``MgpuConfig.pdl``, the decode default: ``kernels_pallas/dependent_launch``):
the grid starts as its predecessor's CTAs exit, prefetches its first ring's weight tiles into
L2 (``_first_weights``: one TMA box per 128-K slice), and waits for the predecessor before its
first load; a decode GEMM's fixed cost per kernel is of the order of its weight bytes' time.

In-cluster split-K (``MgpuConfig.cluster_k``, the decode default at 2 chunks): a tile's K chunks
run as one CTA cluster and are summed over the SM-to-SM network by the CTA that writes the tile
(``mgpu_cluster_k.py``): no f32 partials in HBM, no XLA sum after the kernel.

Scales: ``s_x`` travels as ``[K/128, M_pad]`` f32 (one contiguous TMA row per K step); the weight
scale is one f32 scalar per 128x128 block, read from ``s_w [N/128, K/128]`` in GMEM each step (a
wgmma's <= 128 weight rows never straddle two blocks).

Wide prefill tiles (128x256, 256x128: 3/4 of the L2 -> SMEM bytes per FLOP of 128x128;
see ``MgpuConfig``): each compute warpgroup owns two 64x128 sub-tiles (two 128-column weight blocks
of 64 rows, or 128 rows of one weight block) and runs wgmma, wait and promotion once per sub-tile
per K step, one after the other: a second in-flight 64x128 f32 accumulator (64 registers) would
not fit beside the two running ones in the 232 registers a compute warpgroup gets (DeepGEMM's
1D2D kernel stops at BLOCK_N = 192 for the same reason, keeping a full-width fresh accumulator;
``k_step_wide`` says how ptxas is kept from overlapping them).

Promotions under the wgmmas (``MgpuConfig.overlap``, the prefill default on clustered grids:
``mgpu_k_step.k_pair_overlap``): 128x128 (or 128x64) tiles, two 128-K slices per pipeline step;
per slice each compute warpgroup issues the wgmma, promotes the previous slice's product (carried
with its scales) while it runs, waits, and carries the new product on. The CTA's two compute
warpgroups run their K steps in step (one TMA barrier; the tensor cores interleave their
wgmmas), so with the plain order (wgmma, wait, promote) no MMA runs through either one's wait
and promotion; here the promotion hides under the next MMA. Two slices per step let the fresh
accumulators alternate between two register sets (one slice per step: ptxas copies the carried
product out of the one accumulator first) and each wgmma is waited for inside its step (one in
flight across the loop's back edge makes ptxas serialize them all). The x scales come from GMEM
as registers, a slice before their use: three stages of 128x256 x and w tiles then fit 227 KiB.

2-CTA clusters (``MgpuConfig.cluster_m=2``, prefill): the two CTAs of a cluster take adjacent M
tiles of the same N tile, and the weight BlockSpec is collective over the cluster axis, so each
weight tile is read from L2 once and multicast to both SMs by TMA (jax
``hopper_matmul_mgpu.py``'s ``cluster_dimension``; DeepGEMM's TMA multicast).

Persistent grid (``MgpuConfig.persistent``, prefill): ``persistent`` CTAs (132: one per SM) loop
over the output tiles (``plgpu.nd_loop``) in a snake order (``plgpu.planar_snake``, M-fastest in
bands sized by ``snake_band``), each calling the warp-specialized pipeline on its tile's GMEM
views with one set of SMEM allocations; the epilogue waits for the previous tile's TMA store to
have read the output SMEM tile before overwriting it, so that store overlaps the next tile.

Fused activation quantization (``fp8_matmul_mgpu_fused``): ``x`` arrives in BF16/F16. Prefill
order (opt-in): each compute warpgroup loads its [64, 128] slice, takes the row amax, casts
``x · (fp8_max / max(amax, tiny))`` to FP8 (``mgpu_k_step.quantize_rows``: one division per
row, a multiply per element, the formula of ``quantize_activations``) and stores it into a
private swizzled SMEM tile that feeds the wgmma. Swap-AB (the default for raw x at 16 rows and
where the model picks it at 17-64: ``api.fused_default``): the compute warpgroups split the tile's
x rows per 128-K slice between them and meet at an mbarrier (``mgpu_fused_swap.py``); 16-row
tiles, as the ring carries no x scales.

GPU interpret mode (``InterpretGPUParams``) checks semantics only; the deviceless H100 compile
(``aot_cases.py``) checks the hardware rules (K-major, SMEM budget, registers, spills).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.dependent_launch import dependent_launch
from kernels_pallas.fp8_matmul import mgpu_cluster_k as cluster_k
from kernels_pallas.fp8_matmul import mgpu_fused_swap as fused_swap

# The tile configuration (legality, SMEM count, defaults) lives in mgpu_config; re-exported here.
from kernels_pallas.fp8_matmul.mgpu_config import (  # noqa: F401
    _MAX_GRID,
    _WGMMA_M,
    _WIDE_SUB_N,
    GROUP,
    SMEM_BYTES,
    MgpuConfig,
    decode_config,
    decode_split_k,
    default_config,
    smem_bytes,
    snake_band,
    supports,
    swap_default,
)
from kernels_pallas.fp8_matmul.mgpu_k_step import (
    k_pair_overlap,
    k_step,
    k_step_wide,
    overlap_finish,
    overlap_init,
    overlap_scales,
    pipeline_operands,
    smem_transforms,
)
from kernels_pallas.qarray import QArray

_WGMMA = plgpu.Layout.WGMMA


def _kernel(x_gmem, sx_gmem, w_gmem, sw_gmem, out_gmem, red_gmem=None, *, cfg: MgpuConfig,
            fused: bool, wdt, interpret: bool = False):  # fmt: skip
    """One CTA: one output tile over all K steps, or with ``cfg.persistent`` a loop over output
    tiles (``_persistent_loop``). ``out`` is y [M_pad, N] or yᵀ (``_stores_y``), split-K
    chunks stacked unless summed in the cluster. ``red_gmem`` (``cluster_k`` in GPU interpret
    mode only, which has no DSMEM store): the chunks' accumulators pass through it instead."""
    out_dtype = out_gmem.dtype
    bm, bn, swap, tm = cfg.block_m, cfg.block_n, cfg.swap_ab, _WGMMA_M
    a_blk, b_blk = (bn, bm) if swap else (bm, bn)  # rows of the A and B operand tiles
    k_part = lax.axis_index("s") if cfg.split_k > 1 else 0
    steps = w_gmem.shape[1] // cfg.k_block // cfg.split_k

    def operands(a_idx, b_idx):
        m_idx, n_idx = (b_idx, a_idx) if swap else (a_idx, b_idx)
        return pipeline_operands(
            x_gmem, sx_gmem, w_gmem, pl.ds(m_idx * bm, bm), pl.ds(n_idx * bn, bn), k_part,
            cfg=cfg, fused=fused, wdt=wdt,
        )  # fmt: skip

    in_specs, gmem_in = operands(0, 0)  # every tile's views have the same shapes
    if cfg.pdl:  # launched under the predecessor's drain; the first ring's weights into L2
        dependent_launch(_first_weights(w_gmem, cfg, steps, k_part), leader=("wg", 0),
                         interpret=interpret)  # fmt: skip

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=48 if cfg.persistent else 40,  # see _persistent_loop
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=cfg.num_compute_wgs,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None
    nwg, subs = cfg.num_compute_wgs, cfg.wg_subtiles
    wide = len(subs) > 1
    wg_m, sub_n = a_blk // nwg, _WIDE_SUB_N if wide else b_blk  # a WG's rows, a sub-tile's cols
    # a swapped 16-bit tile is stored transposed (y, not yᵀ): its SMEM tile is [M rows, 64
    # weight rows] (``_stores_y``); f32 partials stay yᵀ for the XLA sum that follows anyway
    flip = swap and _stores_y(cfg, out_dtype)
    out_tile = (sub_n, tm) if flip else (tm, sub_n)
    red = dict(red_smem=None, red_bar=None, sent_bar=None)
    if cfg.cluster_k:  # the received chunks' accumulators and their barriers
        red = cluster_k.scratch(cfg.split_k, nwg, b_blk, smem_transforms(jnp.float32, b_blk),
                                emulate=red_gmem is not None)  # fmt: skip
    scratch = dict(
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(*gmem_in),
        out_smem=plgpu.SMEM(
            (nwg, len(subs), *out_tile),
            out_dtype,
            transforms=smem_transforms(out_dtype, out_tile[1]),
        ),  # fmt: skip
        xq_smem=_quantized_x_scratch(cfg, wdt, interpret) if fused else None,
        **red,
    )  # fmt: skip

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(pipeline_allocs, out_smem, xq_smem, red_smem, red_bar, sent_bar):
        wg = lax.axis_index("wg")

        def tile(a_idx, b_idx):  # the output tile (a_idx, b_idx) of a_blk x b_blk over all K
            # The 128-row weight blocks of this warpgroup's output columns (swap) or of the CTA.
            nb = ((a_idx if swap else b_idx) * bn + (wg * tm if swap else 0)) // GROUP

            def compute_context(eval_pipeline):
                zero = lambda: plgpu.layout_cast(jnp.zeros((tm, sub_n), jnp.float32), _WGMMA)
                if cfg.overlap:  # carries the last step's product and scales too
                    return store((overlap_finish(eval_pipeline(overlap_init(zero()))),), k_part)
                accs = eval_pipeline(tuple(zero() for _ in subs) if wide else zero())
                accs = accs if wide else (accs,)
                if not cfg.cluster_k:
                    return store(accs, k_part)
                red_tile = None if red_gmem is None else red_gmem.at[a_idx, b_idx]
                cluster_k.sum_chunks(
                    accs[0], lambda total: store((total,), 0), k_part=k_part, wg=wg,
                    split=cfg.split_k, red_smem=red_smem, red_bar=red_bar, sent_bar=sent_bar,
                    red_tile=red_tile,
                )  # fmt: skip

            def store(accs, chunk):
                # out rows and columns of this tile; a K chunk's partials below the last's
                r_idx, c_idx, r_blk, c_blk = (b_idx, a_idx, b_blk, a_blk) if flip else \
                    (a_idx, b_idx, a_blk, b_blk)  # fmt: skip
                k_rows = out_gmem.shape[0] // (1 if cfg.cluster_k else cfg.split_k)
                dst = out_gmem.at[pl.ds(chunk * k_rows + r_idx * r_blk, r_blk),
                                  pl.ds(c_idx * c_blk, c_blk)]  # fmt: skip
                if cfg.persistent:  # the previous tile's TMA store must have read out_smem
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for s, acc in enumerate(accs):
                    tile_ref = out_smem.at[wg, s].T if flip else out_smem.at[wg, s]
                    tile_ref[...] = acc.astype(out_dtype)
                plgpu.commit_smem()
                for s, (r, c) in enumerate(subs):
                    if flip:  # this warpgroup's 64 weight rows are 64 columns of y
                        sub = dst.at[:, pl.ds(wg * wg_m, tm)]
                    else:
                        sub = dst.at[pl.ds(wg * wg_m + r, tm), pl.ds(c, sub_n)]
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, s], sub)
                if not cfg.persistent:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            def body(idx, x_smem, w_smem, *rest):
                *sx_ref, acc = rest
                kb = k_part * steps + idx[0]
                sx_ref = sx_ref[0] if sx_ref else None
                if wide:  # scalars issued early: their latency overlaps the first wgmma
                    sws = tuple(sw_gmem[nb + j, kb] for j in range(max(1, bn // GROUP)))
                    return k_step_wide(x_smem, w_smem, sx_ref, acc, sws, cfg=cfg,
                                        chain=not interpret)  # fmt: skip
                if cfg.overlap:  # two 128-K slices per step, x scales from GMEM
                    sws = tuple(sw_gmem[nb, 2 * kb + j] for j in range(2))
                    sxs = overlap_scales(sx_gmem, kb, pl.ds(a_idx * bm + wg * tm, tm))
                    return k_pair_overlap(x_smem, w_smem, sxs, acc, sws)
                ks = cfg.k_slices  # issued early: their latency overlaps
                sw = sw_gmem[nb, kb] if ks == 1 else \
                    tuple(sw_gmem[nb, ks * kb + j] for j in range(ks))  # fmt: skip
                if fused and swap:  # the step's x rows quantized by the warpgroups together
                    sws = sw if ks > 1 else (sw,)
                    return fused_swap.step(x_smem, w_smem, acc, sws, xq_smem, idx[0], cfg=cfg,
                                           wdt=wdt)  # fmt: skip
                step = functools.partial(k_step, cfg=cfg, fused=fused, wdt=wdt)
                return step(x_smem, w_smem, sx_ref, acc, sw, xq_smem)

            pipeline = get_pipeline(body, compute_context)
            pipeline(*operands(a_idx, b_idx)[1], allocations=pipeline_allocs)

        if cfg.persistent:
            a_tiles, b_tiles = out_gmem.shape[0] // a_blk, out_gmem.shape[1] // b_blk
            band = snake_band(cfg, out_gmem.shape[0], w_gmem.shape[1])
            _persistent_loop(tile, a_tiles // cfg.cluster_m, b_tiles, band, cfg.cluster_m)
        else:
            a_idx = lax.axis_index("a")
            if cfg.cluster_m > 1:  # M tiles: cluster-major, the two CTAs of a cluster adjacent
                a_idx = a_idx * cfg.cluster_m + lax.axis_index("c")
            tile(a_idx, lax.axis_index("b"))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _quantized_x_scratch(cfg: MgpuConfig, wdt, interpret: bool):
    """SMEM of the fused (BF16 x) kernel's in-kernel quantization: per compute warpgroup its
    FP8 x tile of 64 rows (the wgmma operand), or on swap-AB tiles ``mgpu_fused_swap.scratch``."""
    if cfg.swap_ab:
        return fused_swap.scratch(cfg, wdt, smem_transforms(wdt, GROUP), interpret)
    nwg = cfg.num_compute_wgs
    return plgpu.SMEM((nwg, _WGMMA_M, GROUP), wdt, transforms=smem_transforms(wdt, GROUP))


def _first_weights(w_gmem, cfg: MgpuConfig, steps: int, k_part) -> list:
    """The weight tiles of this CTA's first ``max_concurrent_steps`` K steps, one [block_n, 128]
    TMA box per 128-K slice (none for a persistent grid, whose first tile the loop picks)."""
    if cfg.persistent:
        return []
    n_idx = lax.axis_index("a" if cfg.swap_ab else "b")
    k0 = k_part * steps * cfg.k_block
    slices = min(cfg.max_concurrent_steps, steps) * cfg.k_block // GROUP
    rows = pl.ds(n_idx * cfg.block_n, cfg.block_n)
    return [w_gmem.at[rows, pl.ds(k0 + j * GROUP, GROUP)] for j in range(slices)]


def _persistent_loop(tile, m_tiles: int, n_tiles: int, band: int, cluster_m: int) -> None:
    """Runs ``tile(m_idx, n_idx)`` for every output tile, spread over the persistent grid "p":
    at loop step ``i`` grid program ``p`` takes the ``i · |p| + p``-th (cluster) tile of the
    snake order over (``m_tiles``, ``n_tiles``) (M-fastest in bands of ``band`` M tiles), so
    the CTAs running at once share x rows and weight tiles in L2 (jax ``hopper_matmul_mgpu``).
    The CTAs of a 2-CTA cluster take the two M halves of one cluster tile. The TMA warpgroup
    starts a tile's loads once the compute warpgroups have consumed the previous tile's last
    K step, so they overlap its epilogue."""

    @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="p")
    def _loop(info):
        (lin,) = info.index
        if band == m_tiles:  # one band: plain M-fastest order (no branch, fewer registers)
            m_idx, n_idx = lax.rem(lin, m_tiles), lax.div(lin, m_tiles)
        else:
            m_idx, n_idx = plgpu.planar_snake(lin, (m_tiles, n_tiles), 0, band)
        if cluster_m > 1:
            m_idx = m_idx * cluster_m + lax.axis_index("c")
        tile(m_idx, n_idx)


def _check(m, k, n, cfg, *, fused, x_itemsize, out_dtype) -> None:
    reason = supports(m, k, n, cfg, fused=fused, x_itemsize=x_itemsize,
                      out_itemsize=jnp.dtype(out_dtype).itemsize)  # fmt: skip
    if reason is not None:
        raise ValueError(f"fp8_matmul_mgpu: {reason}")


def _check_weight(w_q: QArray) -> None:
    if tuple(w_q.block_shape) != (GROUP, GROUP):
        raise ValueError(
            f"fp8_matmul_mgpu: weight blocks must be ({GROUP}, {GROUP}), got {w_q.block_shape}"
        )
    if w_q.ndim != 2:
        raise ValueError(f"fp8_matmul_mgpu: w_q must be rank 2 [N, K], got shape {w_q.shape}")


def _stores_y(cfg: MgpuConfig, out_dtype) -> bool:
    """Whether the kernel writes y [M_pad, N] (every config but a swap-AB one with F32 out or
    f32 split-K partials, which writes yᵀ: Mosaic GPU has no transposed store of 32-bit tiles)."""
    whole = cfg.split_k == 1 or cfg.cluster_k  # the kernel writes the finished tile
    return not cfg.swap_ab or (whole and jnp.dtype(out_dtype).itemsize == 2)


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    return a if a.shape[0] == rows else jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


def _call(x, sx_t, w_q: QArray, *, out_dtype, cfg: MgpuConfig, fused: bool, interpret: bool):
    """Runs the kernel on padded operands; returns y [M_pad, N]."""
    m_pad, n = x.shape[0], w_q.shape[0]
    a_rows, b_rows = (n, m_pad) if cfg.swap_ab else (m_pad, n)
    a_blk, b_blk = (cfg.block_n, cfg.block_m) if cfg.swap_ab else (cfg.block_m, cfg.block_n)
    split = cfg.split_k
    grid, names = (a_rows // a_blk // cfg.cluster_m, b_rows // b_blk), ("a", "b")
    cluster = dict(cluster=(cfg.cluster_m,), cluster_names=("c",)) if cfg.cluster_m > 1 else {}
    if cfg.cluster_k:  # K chunks: one cluster per tile, summed inside it (mgpu_cluster_k)
        cluster = dict(cluster=(split,), cluster_names=("s",))
        split = 1
    elif split > 1:  # K chunks: f32 partials [split · M_pad, N], summed below
        grid, names = (*grid, split), ("a", "b", "s")
    if cfg.persistent:  # never more CTAs than (cluster) tiles: every CTA loops at least once
        grid, names = (min(cfg.persistent // cfg.cluster_m, grid[0] * grid[1]),), ("p",)
    rows, cols = (m_pad, n) if _stores_y(cfg, out_dtype) else (a_rows, b_rows)
    out_type = jax.ShapeDtypeStruct((split * rows, cols), jnp.float32 if split > 1 else out_dtype)
    emulate = interpret and cfg.cluster_k  # no DSMEM store in interpret mode: chunks via GMEM
    if emulate:
        red = cluster_k.emulation_buffer(a_rows // a_blk, b_rows // b_blk, cfg.split_k,
                                         cfg.num_compute_wgs, b_blk)  # fmt: skip
        out_type = (out_type, red)
    kern = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, fused=fused, wdt=w_q.values.dtype, interpret=interpret),
        out_type=out_type,
        grid=grid,
        grid_names=names,
        num_threads=cfg.num_compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **cluster,
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )
    y = kern(x, sx_t, w_q.values, w_q.scales)
    y = y[0] if emulate else y  # (y, the chunks' GMEM stand-in)
    if split > 1:
        y = y.reshape(split, rows, cols).sum(0).astype(out_dtype)
    return y.T if cfg.swap_ab and not _stores_y(cfg, out_dtype) else y


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def fp8_matmul_mgpu(
    x_q: QArray, w_q: QArray, *, out_dtype=jnp.bfloat16, interpret: bool = False, config=None
) -> jax.Array:
    """``y = Σ_kb s_x[:, kb] s_w[nb, kb] (x̂[:, kb] · ŵ[:, kb]ᵀ)`` on Hopper (module docstring).

    ``x_q``: QArray [M, K] with (128,) groups; ``w_q``: QArray [N, K] with (128, 128) blocks.
    Needs K % 128 == 0 and N % block_n == 0; M is padded to ``block_m`` here.
    """
    _check_weight(w_q)
    if tuple(x_q.block_shape) != (GROUP,) or x_q.ndim != 2:
        raise ValueError(
            f"fp8_matmul_mgpu: x_q must be [M, K] with ({GROUP},) groups, got {x_q.block_shape}"
        )
    if x_q.values.dtype != w_q.values.dtype:
        raise ValueError(
            f"fp8_matmul_mgpu: x and w FP8 formats differ ({x_q.values.dtype} vs "
            f"{w_q.values.dtype}); quantize x to the weight's format"
        )
    (m, k), n = x_q.shape, w_q.shape[0]
    cfg = config or default_config(m, n, k, out_itemsize=jnp.dtype(out_dtype).itemsize)
    _check(m, k, n, cfg, fused=False, x_itemsize=1, out_dtype=out_dtype)
    m_pad = pl.cdiv(m, cfg.block_m * cfg.cluster_m) * cfg.block_m * cfg.cluster_m
    sx_t = _pad_rows(x_q.scales, m_pad).T  # padded rows: zero values and zero scales
    y = _call(_pad_rows(x_q.values, m_pad), sx_t, w_q, out_dtype=jnp.dtype(out_dtype), cfg=cfg,
              fused=False, interpret=interpret)  # fmt: skip
    return y[:m]


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def fp8_matmul_mgpu_fused(
    x: jax.Array, w_q: QArray, *, out_dtype=jnp.bfloat16, interpret: bool = False, config=None
) -> jax.Array:
    """As ``fp8_matmul_mgpu`` with raw BF16/F16 ``x`` [M, K] quantized per 1x128 group in-kernel."""
    _check_weight(w_q)
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"fp8_matmul_mgpu_fused: x must be a 2-D BF16/F16 array (F32 tiles would not fit "
            f"the SMEM ring), got {x.shape} {x.dtype}"
        )
    (m, k), n = x.shape, w_q.shape[0]
    if k != w_q.shape[1]:
        raise ValueError(f"fp8_matmul_mgpu_fused: contracting dims differ: {k} vs {w_q.shape[1]}")
    cfg = config or default_config(m, n, k, fused=True, out_itemsize=jnp.dtype(out_dtype).itemsize)
    _check(m, k, n, cfg, fused=True, x_itemsize=2, out_dtype=out_dtype)
    m_pad = pl.cdiv(m, cfg.block_m) * cfg.block_m
    y = _call(_pad_rows(x, m_pad), None, w_q, out_dtype=jnp.dtype(out_dtype), cfg=cfg,
              fused=True, interpret=interpret)  # fmt: skip
    return y[:m]
