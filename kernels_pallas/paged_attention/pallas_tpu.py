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
or 512 slots: lane-dense score rows and scale blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.decode_attention import common
from kernels_pallas.decode_attention import pallas_tpu as dense
from kernels_pallas.paged_attention.common import PagedBlocks

PAGE_SIZES = dense._BLOCK_S  # noqa: SLF001  (the dense kernel's proven tiles)
_LANES = 128


def _kernel(starts, lengths, lo, cnt, table, *refs, st):
    del table  # read by the index maps only
    return dense._kernel(starts, lengths, lo, cnt, *refs, st=st)  # noqa: SLF001


def _specs(st, n_kv: int, group: int, c: int, width: int):
    def page(b, j, t, starts, lengths, lo, cnt, table):
        del starts, lengths
        bj = b * st.splits + j
        return table[b * width + lo[bj] + jnp.minimum(t, jnp.maximum(cnt[bj] - 1, 0))]

    kv = pl.BlockSpec((1, st.bs, n_kv, c), lambda b, j, t, *r: (page(b, j, t, *r), 0, 0, 0))
    in_specs = [pl.BlockSpec((1, n_kv, group, c), lambda b, j, t, *_: (b, 0, 0, 0)), kv, kv]
    if st.dynamic:
        sc = pl.BlockSpec((1, n_kv, st.bs), lambda b, j, t, *r: (page(b, j, t, *r), 0, 0))
        in_specs += [sc, sc]
    out_specs = [pl.BlockSpec((1, 1, n_kv, group, c), lambda b, j, t, *_: (b, j, 0, 0, 0))]
    if st.splits > 1:
        out_specs.append(
            pl.BlockSpec((1, 1, n_kv, group, _LANES), lambda b, j, t, *_: (b, j, 0, 0, 0))
        )
    return in_specs, out_specs


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "interpret"))
def paged_attention_tpu(
    q_BHC, k_pages_XYKC, v_pages_XYKC, lengths_B, page_table_BW, *, k_scale=None, v_scale=None,
    sm_scale, num_splits: int = 1, interpret=False,
):  # fmt: skip
    """Mosaic TPU paged decode attention; same contract as ``paged_attention_reference``."""
    b, h, c = q_BHC.shape
    _, y, n_kv, _ = k_pages_XYKC.shape
    w = page_table_BW.shape[1]
    group, splits = h // n_kv, max(1, min(num_splits, w))
    is_dyn = k_scale is not None and jnp.ndim(k_scale) == 3
    st = dense._Static(  # noqa: SLF001
        bs=y, n_kv=n_kv, splits=splits, steps=common.cdiv(w, splits),
        mma_dtype=dense.mma_dtype(k_pages_XYKC.dtype), dynamic=is_dyn,
        score_scale=float(sm_scale) * common.LOG2E,
    )  # fmt: skip
    starts_B = jnp.zeros((b,), jnp.int32)
    lengths_B = lengths_B.astype(jnp.int32)
    lo, cnt = common.split_ranges(starts_B, lengths_B, block_s=y, num_splits=splits, num_tiles=w)
    q = q_BHC.astype(jnp.float32).reshape(b, n_kv, group, c)
    if k_scale is not None and not is_dyn:
        q = q * common.per_kv_head(k_scale, n_kv)[None, :, None, None]
    inputs = [q.astype(st.mma_dtype), k_pages_XYKC, v_pages_XYKC]
    if is_dyn:
        inputs += [jnp.asarray(x, jnp.float32) for x in (k_scale, v_scale)]
    in_specs, out_specs = _specs(st, n_kv, group, c, w)
    out_shape = [jax.ShapeDtypeStruct((b, splits, n_kv, group, c), jnp.float32)]
    if splits > 1:
        out_shape.append(jax.ShapeDtypeStruct((b, splits, n_kv, group, _LANES), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_kernel, st=st),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(b, splits, st.steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((n_kv, group, _LANES), jnp.float32),
                pltpu.VMEM((n_kv, group, _LANES), jnp.float32),
                pltpu.VMEM((n_kv, group, c), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(
        starts_B, lengths_B, lo.reshape(-1), cnt.reshape(-1),
        page_table_BW.astype(jnp.int32).reshape(-1), *inputs,
    )  # fmt: skip
    o_BJHC = outs[0].reshape(b, splits, h, c)
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
