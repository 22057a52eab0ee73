"""Grouped blockwise FP8 W8A8 matmul for Hopper (sm_90) with Pallas Mosaic GPU.

The dense kernel of ``fp8_matmul/pallas_mosaic_gpu.py`` (DeepGEMM ``sm90_fp8_gemm_1d2d``
structure: a TMA warpgroup streams 128-wide K slices into an SMEM ring, one or two compute
warpgroups run one FP8 wgmma per slice into a fresh f32 accumulator and promote it,
``acc += acc_k · s_x[m, kb] · s_w[e, nb, kb]``), with one CTA per (row tile, N tile) of the
tile map (``tiles.py``, the grouped analogue of jax ``ragged_dot_mgpu``'s ``GroupInfo``). A
CTA reads its tile's expert and row block from GMEM and multiplies the row block of ``x`` by
``w[expert]`` (``[E, N, K]`` K-major: the wgmma B operand is ``w_smem.T``); dead tiles return
at once. Prefill tiles (128x128, or the dense kernel's wide 128x256 / 256x128 with two 64x128
sub-tiles per warpgroup, ``k_step_wide``) store only their group's rows, straight into ``y``
(``tiles.ragged_meta``, ``mgpu_rows``: a 64-row sub-tile wholly in its group as one TMA box
from a swizzled SMEM tile, one a group boundary cuts as its row count's binary digits from the
same bytes unswizzled); the tiles of the rows past Σ sizes store zeros; ``y`` is written once
and never gathered (before: every tile's rows into a tile buffer of ``T·tm`` rows and an XLA
gather: 20-35% of the predicted call at 65,536 rows).

Decode-sized groups (a few rows per expert) use swap-AB as the dense kernel does:
``yᵀ = w[e] · xᵀ`` with 64 weight rows per compute warpgroup and the tile's rows as the wgmma N
(16..64), so a tile of 16 rows is not padded to 64. The kernel then writes the whole tile into
its slot of the tile outputs ``[N, T·tm]``, and the wrapper gathers each row from its group's
tile (``tiles.gather_cols``).

Several weight stacks sharing the rows (gate and up) run as one launch: the N tiles run over the
stacks' concatenation and each CTA runs the pipeline of its stack (one ``pl.when`` branch per
stack), so the weights are never concatenated in memory.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# The dense kernel's building blocks: same tiles, same SMEM buffers, same K step.
from kernels_pallas.fp8_matmul.mgpu_config import (
    _MAX_GRID,
    _WGMMA_M,
    _WIDE_SUB_N,
    GROUP,
    SMEM_BYTES,
    SWAP_ROW_ALIGN,
    MgpuConfig,
    scale_stages_refuse,
    smem_bytes,
)
from kernels_pallas.fp8_matmul.mgpu_k_step import (
    k_step,
    k_step_wide,
    pipeline_operands,
    smem_transforms,
)
from kernels_pallas.grouped_fp8_matmul import mgpu_rows
from kernels_pallas.grouped_fp8_matmul.reference import stacks
from kernels_pallas.grouped_fp8_matmul.tiles import (
    gather_cols,
    make_tile_map,
    num_tiles,
    ragged_meta,
)
from kernels_pallas.qarray import QArray

_MAX_STACKS = 2  # gate and up; more stacks were never compiled
_MAX_STAGES_STACKED = 5  # deepest ring that compiled without spills for two stacks

__all__ = ["GROUP", "SMEM_BYTES", "MgpuConfig", "default_config", "grouped_fp8_matmul_mgpu"]


def default_config(m: int, ns: tuple[int, ...], k: int, num_groups: int, *, out_itemsize: int = 2):
    """Untuned defaults by the mean group size ``M / E``. Below 64 rows per group (decode):
    swap-AB tiles of a power of two >= twice the mean, in [32, 64] (32: the smallest
    swap-AB tile, ``mgpu_config.SWAP_ROW_ALIGN``), so that most groups fit one
    or two tiles (a group spread over more tiles streams its weights once per tile), with 128
    weight rows per CTA (two compute warpgroups) where every stack's N % 128 == 0, else 64. Two
    warpgroups, as the dense decode default: 168 registers instead of one warpgroup's 255, so
    two CTAs share an SM and each streams twice the weight bytes per step; the performance model
    predicts Qwen3-30B-A3B's decode experts 1.0-1.8x faster on H100/H200 than with 64
    (``perf_model.gpu_grouped``; same K loop, SASS profiles ``gfp8_swap_*``). Above (prefill):
    the dense kernel's wide 128x256 tiles where every N % 256 == 0 and they fit the SMEM budget
    (3/4 of a 128x128 tile's L2 -> SMEM bytes per FLOP; with the ragged row stores predicted
    1.27-1.73x faster than 128x128 tiles gathered, at 65,536 rows: ``perf_model.gpu_grouped``
    ``design_changes``), else 128x128 (128x64). The ring is as deep as fits the
    SMEM budget (<= 4 stages). ``ns``: N of each weight stack."""
    mean = m / max(num_groups, 1)
    if mean < 64:
        bm = min(max(SWAP_ROW_ALIGN, 1 << max(int(2 * mean) - 1, 1).bit_length()), 64)
        bn = 64 if any(n % 128 for n in ns) else 128
        tiles = [MgpuConfig(block_m=bm, block_n=bn, swap_ab=True)]
    else:
        tiles = [MgpuConfig(block_m=128, block_n=bn) for bn in (256, 128, 64)
                 if not any(n % bn for n in ns)]  # fmt: skip
    for cfg in tiles:
        for stages in range(cfg.max_concurrent_steps, 1, -1):
            cfg = dataclasses.replace(cfg, max_concurrent_steps=stages)
            if smem_bytes(cfg, k, 1, out_itemsize, False) <= SMEM_BYTES:
                return cfg
    return cfg  # nothing fits: supports() says why


def supports(m: int, k: int, ns: tuple[int, ...], num_groups: int, cfg: MgpuConfig, *,
             out_itemsize: int) -> str | None:  # fmt: skip
    """None if the kernel compiles for these shapes and this tile configuration, else why not
    (``ns``: N of each weight stack)."""
    if (bad := cfg.invalid()) is not None:
        return bad
    if (bad := scale_stages_refuse(cfg)) is not None:  # FP8 x: the ring carries its scales
        return bad
    if cfg.cluster_m > 1:  # its CTAs' tiles follow the routed groups: no pair shares a weight
        return f"cluster_m={cfg.cluster_m}: 2-CTA clusters are a fp8_matmul (dense) option"
    if cfg.persistent:
        return "persistent grids are a fp8_matmul (dense) option; the grouped kernel has none"
    if cfg.overlap or cfg.k_slices > 1:  # its K step is one 128-K slice
        return "overlap / k_slices (several 128-K slices per step) are fp8_matmul (dense) " \
               "options; the grouped kernel takes one slice per step"  # fmt: skip
    if cfg.pdl:  # its weight tiles follow the routed groups: no first ring to prefetch
        return "pdl (dependent launch) is an fp8_matmul (dense) option"
    if len(ns) > _MAX_STACKS:
        return f"at most {_MAX_STACKS} weight stacks per launch, got {len(ns)}"
    if len(ns) > 1 and cfg.max_concurrent_steps > _MAX_STAGES_STACKED:
        # One pipeline per stack in the kernel: 6 stages spill registers (ptxas, H100).
        steps = cfg.max_concurrent_steps
        return f"with {len(ns)} weight stacks max_concurrent_steps must be <= 5, got {steps}"
    if k % GROUP or k == 0:
        return f"K={k} must be a positive multiple of {GROUP}"
    if any(n % cfg.block_n for n in ns):
        return f"N={'+'.join(map(str, ns))} must be multiples of block_n={cfg.block_n}"
    if cfg.split_k != 1:
        return "split_k is a fp8_matmul (dense) option; the grouped kernel runs unsplit"
    if m < 1:
        return "M must be >= 1"
    # ragged stores (not swapped): the rows past Σ sizes are one more group
    t = num_tiles(m, num_groups + (not cfg.swap_ab), cfg.block_m)
    n_tiles = sum(ns) // cfg.block_n
    if max(t, n_tiles) > _MAX_GRID:
        return f"the CTA grid ({t} tiles x {n_tiles}) exceeds {_MAX_GRID}"
    used = smem_bytes(cfg, k, 1, out_itemsize, False)
    if used > SMEM_BYTES:
        return f"tiles need {used} B of SMEM > {SMEM_BYTES} B (fewer stages or smaller tiles)"
    return None


def _pipeline(in_specs, cfg: MgpuConfig, k_steps: int):
    """``(body, compute_context) -> pipeline``: the dense kernel's warp-specialized K loop."""
    return functools.partial(
        plgpu.emit_pipeline_warp_specialized,
        grid=(k_steps,),
        memory_registers=40,
        in_specs=in_specs,
        wg_axis="wg",
        num_compute_wgs=cfg.num_compute_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps,
    )


def _stack_body(sw_gmem, group, nb, *, cfg: MgpuConfig, wdt, chain: bool):
    """The pipeline body of one weight stack: a 128-K step promoted with its block scale (one
    per 128-column weight block of a wide tile: ``k_step_wide``)."""

    def body(idx, x_smem, w_smem, sx_ref, acc):
        if len(cfg.wg_subtiles) > 1:  # issued before the wgmmas: their latency overlaps
            sws = tuple(sw_gmem[group, nb + j, idx[0]] for j in range(cfg.block_n // GROUP))
            return k_step_wide(x_smem, w_smem, sx_ref, acc, sws, cfg=cfg, chain=chain)
        sw = sw_gmem[group, nb, idx[0]]
        return k_step(x_smem, w_smem, sx_ref, acc, sw, None, cfg=cfg, fused=False, wdt=wdt)

    return body


def _kernel(meta_gmem, x_gmem, sx_gmem, *refs, cfg: MgpuConfig, wdt, stack_tiles,
            interpret: bool):  # fmt: skip
    """One CTA: tile t of the tile map times one N tile of its expert, over all K steps. The N
    tiles run over the weight stacks in order (``stack_tiles`` N tiles each); a CTA runs the
    pipeline of the one stack its N tile is in. Swap-AB tiles write their whole tile into their
    slot of the tile outputs; the others store their group's rows into ``y`` (``mgpu_rows``)."""
    *w_refs, out_gmem = refs
    out_dtype = out_gmem.dtype
    bm, bn, swap, tm = cfg.block_m, cfg.block_n, cfg.swap_ab, _WGMMA_M
    subs = cfg.wg_subtiles
    wide = len(subs) > 1
    a_blk, b_blk = (bn, bm) if swap else (bm, bn)
    sub_n = _WIDE_SUB_N if wide else b_blk
    a_idx, b_idx = lax.axis_index("a"), lax.axis_index("b")
    t_idx, n_idx = (b_idx, a_idx) if swap else (a_idx, b_idx)
    group, block, mode = meta_gmem[0, t_idx], meta_gmem[1, t_idx], meta_gmem[2, t_idx]
    m_slice = pl.ds(block * bm, bm)
    operands = functools.partial(pipeline_operands, x_gmem, sx_gmem, cfg=cfg, fused=False, wdt=wdt)
    in_specs, gmem0 = operands(w_refs[0].at[group], m_slice, pl.ds(0, bn))  # same for every stack
    pipeline = _pipeline(in_specs, cfg, x_gmem.shape[1] // GROUP)
    ignore = lambda *_, **__: None
    if swap:
        out_smem = plgpu.SMEM((cfg.num_compute_wgs, tm, b_blk), out_dtype,
                              transforms=smem_transforms(out_dtype, b_blk))  # fmt: skip
    else:  # swizzled and plain views of the same bytes: the ragged stores (mgpu_rows)
        out_smem = mgpu_rows.scratch((cfg.num_compute_wgs, len(subs)), sub_n, out_dtype)
    scratch = dict(
        pipeline_allocs=pipeline(ignore, compute_context=ignore).get_allocations(*gmem0),
        out_smem=out_smem,
    )

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(pipeline_allocs, out_smem):
        wg = lax.axis_index("wg")
        zero = lambda: plgpu.layout_cast(jnp.zeros((tm, sub_n), jnp.float32), plgpu.Layout.WGMMA)

        def store_tile(acc):  # swap-AB: the whole tile, into the tile outputs
            out_smem[wg] = acc.astype(out_dtype)
            plgpu.commit_smem()
            dst = out_gmem.at[pl.ds(a_idx * a_blk, a_blk), pl.ds(b_idx * b_blk, b_blk)]
            plgpu.copy_smem_to_gmem(out_smem.at[wg], dst.at[pl.ds(wg * tm, tm)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def store_rows(accs):  # the group's rows of each sub-tile, into y
            first, count = meta_gmem[3, t_idx], meta_gmem[4, t_idx]
            for s, (acc, (r, c)) in enumerate(zip(accs, subs, strict=True)):
                row0 = wg * (bm // cfg.num_compute_wgs) + r  # the sub-tile's first row in the block
                views = tuple(v.at[wg, s] for v in out_smem)
                dst = out_gmem.at[:, pl.ds(n_idx * bn + c, sub_n)]
                mgpu_rows.store(views, acc, dst, block * bm + row0, first - row0, count)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def compute_context(eval_pipeline):
            if swap:
                return store_tile(eval_pipeline(zero()))
            accs = eval_pipeline(tuple(zero() for _ in subs) if wide else zero())
            store_rows(accs if wide else (accs,))

        lo = 0
        for s, hi in enumerate(itertools.accumulate(stack_tiles)):
            n_loc = n_idx - lo
            nb = (n_loc * bn + (wg * tm if swap else 0)) // GROUP
            _, gmem_in = operands(w_refs[2 * s].at[group], m_slice, pl.ds(n_loc * bn, bn))
            body = _stack_body(w_refs[2 * s + 1], group, nb, cfg=cfg, wdt=wdt, chain=not interpret)
            run = pipeline(body, compute_context=compute_context)
            # Dead tiles and other stacks' N tiles: every warpgroup skips the pipeline alike.
            cond = (mode == 1) & (n_idx >= lo) & (n_idx < hi)
            pl.when(cond)(functools.partial(run, *gmem_in, allocations=pipeline_allocs))
            lo = hi
        if not swap:  # the rows past Σ sizes, by the compute warpgroups (not the TMA one)
            zeros = lambda: store_rows(tuple(zero() for _ in subs))
            pl.when((mode == 2) & (wg < cfg.num_compute_wgs))(zeros)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _call(meta, x, sx_t, ws: tuple[QArray, ...], t: int, m: int, *, out_dtype, cfg: MgpuConfig,
          interpret: bool):  # fmt: skip
    """Runs the kernel; returns ``y`` [M, N], or on swap-AB tiles the tile outputs [N, T·tm]."""
    n = sum(w.shape[1] for w in ws)
    rows = t * cfg.block_m
    a_rows, b_rows = (n, rows) if cfg.swap_ab else (rows, n)
    a_blk, b_blk = (cfg.block_n, cfg.block_m) if cfg.swap_ab else (cfg.block_m, cfg.block_n)
    stack_tiles = tuple(w.shape[1] // cfg.block_n for w in ws)
    kern = plgpu.kernel(
        functools.partial(
            _kernel, cfg=cfg, wdt=ws[0].values.dtype, stack_tiles=stack_tiles, interpret=interpret
        ),  # fmt: skip
        out_type=jax.ShapeDtypeStruct((n, rows) if cfg.swap_ab else (m, n), out_dtype),
        grid=(a_rows // a_blk, b_rows // b_blk),
        grid_names=("a", "b"),
        num_threads=cfg.num_compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )
    return kern(meta, x, sx_t, *(a for w in ws for a in (w.values, w.scales)))


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def grouped_fp8_matmul_mgpu(
    x_q: QArray, w_q, group_sizes_E: jax.Array, *, out_dtype=jnp.bfloat16,
    interpret: bool = False, config: MgpuConfig | None = None,
) -> jax.Array:  # fmt: skip
    """``y_m = Σ_kb s_x[m, kb] s_w[e(m), nb, kb] (x̂_m,kb · ŵ_e(m),kbᵀ)`` on Hopper (module doc).

    ``x_q``: QArray [M, K] with (128,) groups, rows sorted by group; ``w_q``: QArray [E, N, K]
    with (128, 128) blocks, or a tuple of them (one launch over their concatenation along N);
    ``group_sizes_E``: int [E]. Needs K % 128 == 0 and every N % block_n == 0.
    """
    ws = stacks(w_q)
    if tuple(ws[0].block_shape) != (GROUP, GROUP) or tuple(x_q.block_shape) != (GROUP,):
        raise ValueError(
            f"grouped_fp8_matmul_mgpu: needs ({GROUP},) activation groups and ({GROUP}, {GROUP}) "
            f"weight blocks, got {x_q.block_shape} and {ws[0].block_shape}"
        )
    if x_q.values.dtype != ws[0].values.dtype:
        raise ValueError(
            f"grouped_fp8_matmul_mgpu: x and w FP8 formats differ ({x_q.values.dtype} vs "
            f"{ws[0].values.dtype}); quantize x to the weight's format"
        )
    (m, k), e, ns = x_q.shape, ws[0].shape[0], tuple(w.shape[1] for w in ws)
    out_itemsize = jnp.dtype(out_dtype).itemsize
    cfg = config or default_config(m, ns, k, e, out_itemsize=out_itemsize)
    if (reason := supports(m, k, ns, e, cfg, out_itemsize=out_itemsize)) is not None:
        raise ValueError(f"grouped_fp8_matmul_mgpu: {reason}")
    m_pad = pl.cdiv(m, cfg.block_m) * cfg.block_m
    pad = ((0, m_pad - m), (0, 0))
    x, sx_t = jnp.pad(x_q.values, pad), jnp.pad(x_q.scales, pad).T  # padded rows: zeros
    call = functools.partial(_call, x=x, sx_t=sx_t, ws=ws, m=m, out_dtype=jnp.dtype(out_dtype),
                             cfg=cfg, interpret=interpret)  # fmt: skip
    if not cfg.swap_ab:  # ragged stores straight into y
        return call(ragged_meta(group_sizes_E, m, cfg.block_m), t=num_tiles(m, e + 1, cfg.block_m))
    tiles = make_tile_map(group_sizes_E, m, cfg.block_m)
    out = call(tiles.meta_3T, t=num_tiles(m, e, cfg.block_m))
    return gather_cols(out, tiles, out_dtype)
