"""Paged decode attention on TPU (Mosaic TPU): the dense decode kernel over a page pool.

The body is ``decode_attention.pallas_tpu``'s (online softmax per KV head, FP8 upcast to bf16 in
VMEM, static scales folded into q / the output, dynamic scales as ``(1, K, Y)`` blocks); only
the K/V index maps change. Grid ``(B, J, T)``: row b, chunk j of its page-table entries, step t.
Scalar-prefetched into SMEM: starts (0), lengths, the chunk bounds ``lo``/``count`` in pages
(``split_ranges`` over the W table entries), and the flattened page table ``[B·W]``. Step t
reads page ``table[b, lo + min(t, count - 1)]``: steps past a chunk's last live page repeat its
block index, so Pallas issues no DMA for them and the body skips them (``pl.when``). HBM traffic
is the pages a row holds, as in jax's ``paged_attention`` and ragged paged attention.

A tile is one page, so the page size must be a block size the dense kernel supports (128, 256
or 512 slots: lane-dense score rows and scale blocks). Each grid step takes ``P`` pages (default:
512 slots a step), as P separate K and V operands whose index maps name pages ``t·P + i``: a
128-slot FP8 page of 8 KV heads is 256 KiB of K+V, ~0.16 us of v6e HBM time against the ~0.35 us
a grid step costs, so one page a step is overhead-bound (RPA v3 likewise fetches several pages
per step). An operand past the chunk's live pages keeps its last live page (no DMA, no compute).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.decode_attention import common
from kernels_pallas.decode_attention import pallas_tpu as dense
from kernels_pallas.paged_attention.common import PagedBlocks

PAGE_SIZES = dense._BLOCK_S  # noqa: SLF001  (the dense kernel's proven tiles)
STEP_SLOTS = 512  # cache slots a grid step takes (several pages when pages are smaller)
_LANES = 128


def _kernel(starts, lengths, lo, cnt, table, q_ref, *refs, st, pages: int):
    """The dense kernel's online softmax over the ``pages`` pages of this step."""
    del starts, table  # rows start at slot 0; the table is read by the index maps only
    n_in = (4 if st.dynamic else 2) * pages
    kv, outs = refs[:n_in], refs[n_in : len(refs) - 3]
    m_sc, l_sc, acc_sc = refs[len(refs) - 3 :]
    b, j, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bj = b * st.splits + j

    @pl.when(t == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    for i in range(pages):
        k_ref, v_ref = kv[i], kv[pages + i]
        scales = (kv[2 * pages + i], kv[3 * pages + i]) if st.dynamic else ()

        @pl.when(t * pages + i < cnt[bj])
        def _page(k_ref=k_ref, v_ref=v_ref, scales=scales, i=i):
            first = (lo[bj] + t * pages + i) * st.bs
            live_1S = first + lax.broadcasted_iota(jnp.int32, (1, st.bs), 1) < lengths[b]
            for u in range(st.units):
                dense._head(st, u, q_ref, k_ref, v_ref, scales, live_1S, m_sc, l_sc, acc_sc)  # noqa: SLF001

    @pl.when(t == st.steps - 1)
    def _finish():
        l = l_sc[...]
        outs[0][0, 0] = acc_sc[...] / jnp.where(l > 0, l, 1.0)[..., :1]
        if len(outs) > 1:
            outs[1][0, 0] = m_sc[...] + jnp.log2(l)


def _specs(st, n_kv: int, group: int, c: int, width: int, pages: int):
    def page(i, b, j, t, starts, lengths, lo, cnt, table):
        """Operand i's page at step t: entry ``t·P + i`` of the chunk; past the chunk's live
        entries the operand's last live one (unchanged block index: no DMA), or the chunk's last
        live entry when it has none."""
        del starts, lengths
        bj = b * st.splits + j
        n = cnt[bj]
        last_t = jnp.maximum(n - 1 - i, 0) // pages
        entry = jnp.where(n > i, jnp.minimum(t, last_t) * pages + i, jnp.maximum(n - 1, 0))
        return table[b * width + lo[bj] + entry]

    def kv_spec(i):
        return pl.BlockSpec((1, st.bs, n_kv, c), lambda *a: (page(i, *a), 0, 0, 0))

    def scale_spec(i):
        return pl.BlockSpec((1, n_kv, st.bs), lambda *a: (page(i, *a), 0, 0))

    units, (rows, unit_width, _) = st.units, dense.unit_blocks(st, group, c)
    kvs = [kv_spec(i) for i in range(pages)]
    q_spec = pl.BlockSpec((1, units, rows, unit_width), lambda b, j, t, *_: (b, 0, 0, 0))
    in_specs = [q_spec, *kvs, *kvs]
    if st.dynamic:
        scs = [scale_spec(i) for i in range(pages)]
        in_specs += [*scs, *scs]
    out = lambda last: pl.BlockSpec((1, 1, units, rows, last), lambda b, j, t, *_: (b, j, 0, 0, 0))
    out_specs = [out(unit_width)] + ([out(_LANES)] if st.splits > 1 else [])
    return in_specs, out_specs


def pages_per_step(page_size: int, entries_per_chunk: int) -> int:
    """Pages a grid step takes: 512 slots a step (1-4 pages), at most the chunk's entries."""
    return max(1, min(STEP_SLOTS // page_size, entries_per_chunk))


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "interpret"))
def paged_attention_tpu(
    q_BHC, k_pages_XYKC, v_pages_XYKC, lengths_B, page_table_BW, *, k_scale=None, v_scale=None,
    sm_scale, num_splits: int = 1, pages: int | None = None, interpret=False,
):  # fmt: skip
    """Mosaic TPU paged decode attention; same contract as ``paged_attention_reference``."""
    b, h, c = q_BHC.shape
    _, y, n_kv, _ = k_pages_XYKC.shape
    w = page_table_BW.shape[1]
    group, splits = h // n_kv, max(1, min(num_splits, w))
    per_chunk = common.cdiv(w, splits)
    pages = pages or pages_per_step(y, per_chunk)
    is_dyn = k_scale is not None and jnp.ndim(k_scale) == 3
    st = dense._Static(  # noqa: SLF001
        bs=y, n_kv=n_kv, splits=splits, steps=common.cdiv(per_chunk, pages),
        mma_dtype=dense.mma_dtype(k_pages_XYKC.dtype), dynamic=is_dyn,
        score_scale=float(sm_scale) * common.LOG2E, pair=dense.head_pairs(n_kv), group=group,
    )  # fmt: skip
    starts_B = jnp.zeros((b,), jnp.int32)
    lengths_B = lengths_B.astype(jnp.int32)
    lo, cnt = common.split_ranges(starts_B, lengths_B, block_s=y, num_splits=splits, num_tiles=w)
    q = q_BHC.astype(jnp.float32).reshape(b, n_kv, group, c)
    if k_scale is not None and not is_dyn:
        q = q * common.per_kv_head(k_scale, n_kv)[None, :, None, None]
    q = dense.unit_queries(q, st.pair).astype(st.mma_dtype)
    inputs = [q, *[k_pages_XYKC] * pages, *[v_pages_XYKC] * pages]
    if is_dyn:
        for x in (k_scale, v_scale):
            inputs += [jnp.asarray(x, jnp.float32)] * pages
    in_specs, out_specs = _specs(st, n_kv, group, c, w, pages)
    rows, unit_width, scratch = dense.unit_blocks(st, group, c)
    out_shape = [jax.ShapeDtypeStruct((b, splits, st.units, rows, unit_width), jnp.float32)]
    if splits > 1:
        out_shape.append(jax.ShapeDtypeStruct((b, splits, st.units, rows, _LANES), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_kernel, st=st, pages=pages),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(b, splits, st.steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(
        starts_B, lengths_B, lo.reshape(-1), cnt.reshape(-1),
        page_table_BW.astype(jnp.int32).reshape(-1), *inputs,
    )  # fmt: skip
    o_BJHC = dense.heads_of_units(outs[0], st.pair, group, c)
    if splits > 1:
        o_BHC = common.combine_splits(o_BJHC, outs[1][..., 0].reshape(b, splits, h))
    else:
        o_BHC = o_BJHC[:, 0]
    if v_scale is not None and not is_dyn:
        o_BHC = o_BHC * jnp.repeat(common.per_kv_head(v_scale, n_kv), group)[None, :, None]
    return o_BHC.astype(q_BHC.dtype)


def supports(q_BHC, k_pages, v_pages, lengths_B, page_table_BW, *, k_scale, v_scale, sm_scale,
             config, interpret) -> str | None:  # fmt: skip
    """None if the Mosaic TPU kernel compiles for these operands (proven shapes), else why not."""
    del lengths_B, page_table_BW, k_scale, v_scale, sm_scale, config
    from kernels_pallas.backend import device_reason

    if (reason := device_reason("tpu", interpret)) is not None:
        return reason
    y, c = k_pages.shape[1], k_pages.shape[3]
    if k_pages.dtype not in dense._KV_DTYPES or v_pages.dtype != k_pages.dtype:  # noqa: SLF001
        return f"page dtype {k_pages.dtype}/{v_pages.dtype} not supported"
    if q_BHC.dtype not in dense._Q_DTYPES:  # noqa: SLF001
        return f"q dtype {q_BHC.dtype} not supported"
    if c not in dense._HEAD_DIMS:  # noqa: SLF001
        return f"head_dim {c} not in {dense._HEAD_DIMS}"  # noqa: SLF001
    if y not in PAGE_SIZES:
        return f"page_size {y} is not a kernel block size {PAGE_SIZES} (a tile is one page)"
    return None


def run(q, k, v, lengths_B, table, *, config: PagedBlocks | None, interpret, **kw):
    splits = 1 if config is None or config.num_splits is None else config.num_splits
    return paged_attention_tpu(q, k, v, lengths_B, table, **kw, num_splits=splits,
                               interpret=interpret)  # fmt: skip
