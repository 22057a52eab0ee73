"""Paged decode attention on Hopper (Mosaic GPU): the dense decode kernel over a page pool.

One CTA per (KV head, row, chunk of the row's page-table entries); the body is the dense
kernels' tile step: by default ``decode_attention.mgpu_swap``'s (swap-AB: the page as the wgmma
M side, the query group as N), with ``PagedBlocks(swap_ab=False)`` the unswapped one of
``decode_attention.pallas_mosaic_gpu`` (wgmma QKᵀ and PV in f16/bf16, FP8 pages
upcast to f16 in registers, online softmax in base 2, a static K scale folded into the softmax
scale (not into q before its f16 cast) and a static V scale on the output). Only the TMA
pipeline's source changes: the pool viewed as
``[X·Y, K, C]`` (a free reshape), head kh's ``[X·Y, C]`` slice, and the index map of step i
``page_table[row, lo + i]`` (a page is one ``Y``-row tile). The pipeline's grid is the chunk's
live page count, so only the pages a row holds are read. Dynamic (per-slot) page scales are
not supported yet (their per-head view ``[X, Y]`` is not a 1-D TMA source).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.decode_attention import common, mgpu_swap, mgpu_tile
from kernels_pallas.decode_attention import pallas_mosaic_gpu as dense
from kernels_pallas.dependent_launch import dependent_launch
from kernels_pallas.paged_attention.common import PagedBlocks

_TILE_M = dense._TILE_M  # noqa: SLF001
# The dense kernel's block sizes (a tile is one page); 128-slot FP8 pages take the swap-AB kernel
# with a query group of at most 16 (``dense.block_sizes``: the support check says per call).
PAGE_SIZES = (64, 128)
_STAGES = dense._STAGES  # noqa: SLF001


def _kernel(lengths, lo, cnt, table, k_scale, q_gmem, k_gmem, v_gmem, *outs, st):
    dependent_launch(interpret=not st.hw)  # before the first read: the row's pages, lengths
    kh, row, j = jax.lax.axis_index("kv"), jax.lax.axis_index("row"), jax.lax.axis_index("split")
    c, bs, dt = q_gmem.shape[-1], st.bs, st.mma_dtype
    bounds = (lo[row, j], 0, lengths[row], st.score_scale * k_scale[kh])
    q0 = pl.multiple_of((kh * st.group) // 8 * 8, 8)
    off = kh * st.group - q0

    def compute(q_smem, kb_smem, vb_smem, p_smem, q_barrier):
        plgpu.copy_gmem_to_smem(q_gmem.at[row, pl.ds(q0, _TILE_M)], q_smem, q_barrier)
        plgpu.barrier_wait(q_barrier)
        kv_spec = plgpu.BlockSpec(
            (bs, c), lambda i: (table[row, bounds[0] + i], 0),
            transforms=dense._transforms(c, k_gmem.dtype),  # noqa: SLF001
        )  # fmt: skip
        init = (
            plgpu.layout_cast(jnp.zeros((_TILE_M, c), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(
                jnp.full((_TILE_M,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
            ),
            plgpu.layout_cast(jnp.zeros((_TILE_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        step = functools.partial(
            dense._tile_step,
            st,
            q_smem,
            kb_smem,
            vb_smem,
            p_smem,
            bounds,  # noqa: SLF001
        )
        return plgpu.emit_pipeline(
            step, grid=(cnt[row, j],), in_specs=[kv_spec, kv_spec],
            max_concurrent_steps=st.stages, init_carry=init,
        )(k_gmem.at[:, kh], v_gmem.at[:, kh])  # fmt: skip

    tf = dense._transforms  # noqa: SLF001
    kv_buf = plgpu.SMEM((bs, c), dt, transforms=tf(c, dt)) if st.fp8 else None
    acc, m_i, l_i = pl.run_scoped(
        compute,
        plgpu.SMEM((_TILE_M, c), dt, transforms=tf(c, dt)),
        kv_buf,
        kv_buf,
        None if st.hw else plgpu.SMEM((_TILE_M, bs), dt, transforms=tf(bs, dt)),
        plgpu.Barrier(num_barriers=1),
    )
    dense._write_out(st, outs, acc, m_i, l_i, (row, kh, j, off))  # noqa: SLF001


def _kernel_swap(lengths, lo, cnt, table, k_scale, q_gmem, k_gmem, v_gmem, *outs, st):
    """The swap-AB kernel (``mgpu_swap``) over the page pool."""
    dependent_launch(interpret=not st.hw)
    kh, row, j = jax.lax.axis_index("kv"), jax.lax.axis_index("row"), jax.lax.axis_index("split")
    c, bs = q_gmem.shape[-1], st.bs
    bounds = (lo[row, j], 0, lengths[row], st.score_scale * k_scale[kh])
    kv_spec = plgpu.BlockSpec(
        (bs, c), lambda i: (table[row, bounds[0] + i], 0),
        transforms=mgpu_tile.transforms(c, k_gmem.dtype),
    )  # fmt: skip
    srcs = [k_gmem.at[:, kh], v_gmem.at[:, kh]]
    acc, m_i, l_i = mgpu_swap.attend(
        st, q_gmem.at[row, kh], [kv_spec, kv_spec], srcs, bounds, cnt[row, j], c
    )
    mgpu_swap.write(st, outs, acc, m_i, l_i, (row, j, kh))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "num_splits", "stages", "quant_out", "interpret", "swap_ab"),
)
def paged_attention_mgpu(
    q_BHC, k_pages_XYKC, v_pages_XYKC, lengths_B, page_table_BW, *, k_scale=None, v_scale=None,
    sm_scale, num_splits: int = 1, stages: int = 2, quant_out=None, interpret=False,
    swap_ab: bool = True,
):  # fmt: skip
    """Mosaic GPU paged decode attention; same contract as ``paged_attention_reference``
    (static or no scales). ``quant_out``: the output quantized for the o_proj
    (``decode_attention.pallas_mosaic_gpu.output``); ``swap_ab``: the swap-AB kernel."""
    b, h, c = q_BHC.shape
    x, y, n_kv, _ = k_pages_XYKC.shape
    w = page_table_BW.shape[1]
    group, splits = h // n_kv, max(1, min(num_splits, w))
    dt = dense.mma_dtype(k_pages_XYKC.dtype)
    lengths_B = lengths_B.astype(jnp.int32)
    lo, cnt = common.split_ranges(
        jnp.zeros_like(lengths_B), lengths_B, block_s=y, num_splits=splits, num_tiles=w
    )
    if swap_ab:
        q = mgpu_swap.queries(q_BHC, n_kv, dt)
    else:
        q = jnp.pad(q_BHC.astype(dt), ((0, 0), (0, dense._q_rows(n_kv, group) - h), (0, 0)))  # noqa: SLF001
    k_scale_K = dense.static_k_scale(k_scale, n_kv)
    st = dense._Static(  # noqa: SLF001
        bs=y, group=group, splits=splits, stages=stages, mma_dtype=dt,
        fp8=jnp.dtype(k_pages_XYKC.dtype).itemsize == 1, dynamic=False,
        score_scale=float(sm_scale) * common.LOG2E, hw=not interpret,
    )  # fmt: skip
    out_type = dense.out_types(b, splits, n_kv, c, group, swap_ab)
    k_flat = k_pages_XYKC.reshape(x * y, n_kv, c)
    v_flat = v_pages_XYKC.reshape(x * y, n_kv, c)
    outs = plgpu.kernel(
        functools.partial(_kernel_swap if swap_ab else _kernel, st=st),
        out_type=out_type,
        grid=(n_kv, b, splits),
        grid_names=("kv", "row", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(lengths_B, lo, cnt, page_table_BW.astype(jnp.int32), k_scale_K, q, k_flat, v_flat)
    return dense.output(outs, v_scale, n_kv=n_kv, group=group, out_dtype=q_BHC.dtype,
                        quant_out=quant_out, interpret=interpret)  # fmt: skip


def default_splits(b: int, num_pages: int, n_kv: int) -> int:
    """Chunks per row when the config leaves ``num_splits`` unset: as many as fill one wave of
    2 CTAs x 132 SMs over the B x K (row, KV head) pairs, at least 4 pages per chunk (the dense
    kernel's rule, ``common.resolve_splits``): B=1 gets 33 chunks, B >= 32 (K = 8) gets 1."""
    units = dense.NUM_SMS * dense._CTAS_PER_SM  # noqa: SLF001
    return common.resolve_splits(None, b * n_kv, units, num_pages)


def supports(q_BHC, k_pages, v_pages, lengths_B, page_table_BW, *, k_scale, v_scale, sm_scale,
             config, interpret) -> str | None:  # fmt: skip
    """None if the Mosaic GPU kernel compiles for these operands (proven shapes), else why not."""
    del lengths_B, page_table_BW, v_scale, sm_scale
    from kernels_pallas.backend import device_reason

    if (reason := device_reason("gpu", interpret)) is not None:
        return reason
    y, n_kv, c = k_pages.shape[1:]
    if k_pages.dtype not in dense._KV_DTYPES or v_pages.dtype != k_pages.dtype:  # noqa: SLF001
        return f"page dtype {k_pages.dtype}/{v_pages.dtype} not supported"
    if q_BHC.dtype not in dense._Q_DTYPES:  # noqa: SLF001
        return f"q dtype {q_BHC.dtype} not supported"
    if c not in dense._HEAD_DIMS:  # noqa: SLF001
        return f"head_dim {c} not in {dense._HEAD_DIMS}"  # noqa: SLF001
    swap, group = common.swap_ab_on(config), q_BHC.shape[1] // n_kv
    if (reason := dense.group_reason(n_kv, group, swap)) is not None:
        return reason
    if y not in (sizes := dense.block_sizes(k_pages.dtype, swap, group)):
        kernel = f"{'swap-AB' if swap else 'unswapped'} kernel on {k_pages.dtype} pages"
        return (
            f"page_size {y} is not a kernel block size {sizes} (a tile is one page; {kernel}, "
            f"query group {group})"
        )
    if k_scale is not None and jnp.ndim(k_scale) == 3:
        return "dynamic (per-slot) page scales are not supported by the Mosaic GPU kernel yet"
    stages = (config or PagedBlocks()).num_stages or dense.default_stages(k_pages.dtype, swap)
    if stages not in _STAGES:
        return f"num_stages {stages} not in {_STAGES}"
    tile = common.DecodeBlocks(block_s=y, num_splits=1, num_stages=stages, swap_ab=swap)
    if (n := dense.smem_bytes(tile, c, k_pages.dtype, False, group)) > 227 * 1024:
        return f"SMEM {n} B over the 227 KiB budget (pages of {y}, {stages} stages)"
    return None


def run(q, k, v, lengths_B, table, *, config: PagedBlocks | None, interpret, quant_out=None,
        **kw):  # fmt: skip
    config = config or PagedBlocks()
    splits = config.num_splits or default_splits(q.shape[0], table.shape[1], k.shape[2])
    return paged_attention_mgpu(
        q, k, v, lengths_B, table, **kw, num_splits=splits,
        stages=config.num_stages or dense.default_stages(k.dtype, common.swap_ab_on(config)),
        quant_out=quant_out, interpret=interpret, swap_ab=common.swap_ab_on(config),
    )  # fmt: skip
