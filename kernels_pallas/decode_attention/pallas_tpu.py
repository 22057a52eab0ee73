"""Decode attention on TPU (Mosaic TPU): live tiles only, by scalar prefetch.

Grid ``(B, J, T)``: row b, sequence chunk j, tile step t (T = the most tiles a chunk can hold).
The chunk bounds ``lo``/``count`` (``common.split_ranges``) and the rows' ``starts``/``lengths``
are scalar-prefetched into SMEM. The K/V index map clamps step t to the chunk's last live tile,
so steps past it keep the same block index and Pallas issues no DMA for them, and the body skips
their compute (``pl.when``): HBM traffic is the live tiles, not the allocation. The live mask
is ``start <= slot < length`` from an iota (no mask array).

One program sees all KV heads of a row's tile (the trailing ``[K, C]`` block dims are whole, as
Mosaic requires) and loops over them in units of two (``head_pairs``): a unit's K (and V) tiles
side by side along the lanes, ``[bs, 2C]``, against a block-diagonal query ``[2G, 2C]``, so one
``[2G, 2C] x [2C, bs]`` MXU dot scores both heads (a 128-deep head alone fills half of a 256x256
v6e MXU) and one ``[2G, bs] x [bs, 2C]`` dot gives both heads' ``P V`` (plus two cross-head
blocks, dropped by the wrapper). FP8 tiles are upcast to bf16 (exact for E4M3/E5M2); BF16
caches run bf16 x bf16, F32 caches f32 (``precision=highest``), all accumulating in f32 with an
online softmax in base 2. m / l scratch is ``[K / 2, 2G, 128]`` (lane-replicated, RPA style:
every slice is a whole tile row).
Static scales: K folded into q, V multiplying the output; dynamic scales ``[B, K, S]`` arrive as
``(K, bs)`` blocks that scale the scores' and probabilities' columns.

Paging (a later issue) plugs in at ``kv_tile``: with a page table scalar-prefetched beside the
chunk bounds, the K/V index map returns ``page_table[b, tile]`` into a page pool.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.decode_attention import common

_LANES = 128


@dataclasses.dataclass(frozen=True)
class _Static:
    bs: int  # block_s
    n_kv: int
    splits: int
    steps: int  # T: tile steps per chunk
    mma_dtype: jnp.dtype
    dynamic: bool
    score_scale: float  # sm_scale · log2(e)
    pair: int = 1  # KV heads per MXU dot (``head_pairs``)
    group: int = 1  # G: query heads per KV head

    @property
    def units(self) -> int:
        return self.n_kv // self.pair


def head_pairs(n_kv: int) -> int:
    """KV heads one MXU dot takes: 2 where the count is even. A 128-deep head fills half of a
    256x256 v6e MXU: two heads side by side along the contraction, against a block-diagonal
    query ``[2G, 2C]`` (each head's query rows zero over the other head's half), fill it, so the
    scores and ``P V`` of two heads take the systolic passes of one (``perf_model.tpu_attention``:
    v6e from MXU-bound to HBM-bound). ``P V`` then also computes the two cross-head blocks,
    which the wrapper drops. On v5e (128x128 MXUs) the passes are the same either way."""
    return 2 if n_kv % 2 == 0 else 1


def _side_by_side(ref, u: int, st: _Static, dt):
    """The ``[bs, pair · C]`` tile of unit ``u``'s KV heads, side by side along the lanes."""
    parts = [ref[0, :, u * st.pair + i, :].astype(dt) for i in range(st.pair)]
    return parts[0] if st.pair == 1 else jnp.concatenate(parts, axis=1)


def _rows_of_heads(ref, u: int, st: _Static, n_rows: int):
    """Per-slot scales ``[pair · G, bs]`` of unit ``u``: each query row takes its head's row."""
    rows = [ref[0, u * st.pair + i : u * st.pair + i + 1, :] for i in range(st.pair)]
    if st.pair == 1:
        return rows[0]
    head_R1 = lax.broadcasted_iota(jnp.int32, (n_rows, 1), 0) // st.group
    out = rows[0]
    for i in range(1, st.pair):
        out = jnp.where(head_R1 == i, rows[i], out)
    return out


def unit_queries(q_BKGC, pair: int):
    """``[B, K, G, C]`` queries as ``[B, K / pair, pair · G, pair · C]``, block-diagonal per unit:
    row ``i · G + g`` is head ``u · pair + i``'s query ``g`` over columns ``i · C ...``, zero
    elsewhere (so it scores only its own head's half of a side-by-side K tile)."""
    b, n_kv, group, c = q_BKGC.shape
    q = q_BKGC.reshape(b, n_kv // pair, pair, group, c)
    q = jnp.einsum("bupgc,pq->bupgqc", q, jnp.eye(pair, dtype=q.dtype))
    return q.reshape(b, n_kv // pair, pair * group, pair * c)


def heads_of_units(o_BJURW, pair: int, group: int, c: int):
    """The kernel's ``[B, J, units, pair · G, pair · C]`` output as ``[B, J, H, C]``: each head's
    diagonal block (its rows over its own V columns); the cross-head blocks are dropped."""
    b, j, units = o_BJURW.shape[:3]
    o = o_BJURW.reshape(b, j, units, pair, group, pair, c)
    return jnp.stack([o[:, :, :, i, :, i] for i in range(pair)], axis=3).reshape(b, j, -1, c)


def unit_blocks(st: _Static, group: int, c: int):
    """(rows, width, scratch) of a unit: m / l ``[units, rows, 128]`` (lane-replicated) and the
    accumulator ``[units, rows, width]``."""
    rows, width = st.pair * group, st.pair * c
    scratch = [pltpu.VMEM((st.units, rows, _LANES), jnp.float32),
               pltpu.VMEM((st.units, rows, _LANES), jnp.float32),
               pltpu.VMEM((st.units, rows, width), jnp.float32)]  # fmt: skip
    return rows, width, scratch


def _head(st: _Static, u, q_ref, k_ref, v_ref, scales, live_1S, m_sc, l_sc, acc_sc):
    """The online-softmax update of unit ``u`` (``st.pair`` KV heads) over this tile."""
    dt = st.mma_dtype
    prec = lax.Precision.HIGHEST if dt == jnp.float32 else None
    k_SW = _side_by_side(k_ref, u, st, dt)
    q_RW = q_ref[0, u]
    s_RS = lax.dot_general(
        q_RW, k_SW, (((1,), (1,)), ((), ())), precision=prec,
        preferred_element_type=jnp.float32,
    ) * st.score_scale  # fmt: skip
    if st.dynamic:
        s_RS = s_RS * _rows_of_heads(scales[0], u, st, q_RW.shape[0])
    s_RS = jnp.where(live_1S, s_RS, -jnp.inf)
    m_prev = m_sc[u]
    # Every live tile holds a live slot: m_new is finite, alpha = 0 on the first tile.
    m_new = jnp.maximum(m_prev, jnp.max(s_RS, axis=1, keepdims=True))
    alpha = jnp.exp2(m_prev - m_new)
    p_RS = jnp.exp2(s_RS - m_new[:, :1])
    l_sc[u] = alpha * l_sc[u] + jnp.sum(p_RS, axis=1, keepdims=True)
    if st.dynamic:
        p_RS = p_RS * _rows_of_heads(scales[1], u, st, q_RW.shape[0])
    v_SW = _side_by_side(v_ref, u, st, dt)
    pv_RW = jnp.dot(p_RS.astype(dt), v_SW, precision=prec, preferred_element_type=jnp.float32)
    acc_sc[u] = acc_sc[u] * alpha[:, :1] + pv_RW
    m_sc[u] = m_new


def _kernel(starts, lengths, lo, cnt, q_ref, k_ref, v_ref, *rest, st: _Static):
    n_in = 2 if st.dynamic else 0
    scales, outs = rest[:n_in], rest[n_in : len(rest) - 3]
    m_sc, l_sc, acc_sc = rest[len(rest) - 3 :]
    b, j, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bj = b * st.splits + j

    @pl.when(t == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(t < cnt[bj])
    def _tile():
        slot_1S = (lo[bj] + t) * st.bs + lax.broadcasted_iota(jnp.int32, (1, st.bs), 1)
        live_1S = (slot_1S >= starts[b]) & (slot_1S < lengths[b])
        for u in range(st.units):
            _head(st, u, q_ref, k_ref, v_ref, scales, live_1S, m_sc, l_sc, acc_sc)

    @pl.when(t == st.steps - 1)
    def _finish():
        l = l_sc[...]
        outs[0][0, 0] = acc_sc[...] / jnp.where(l > 0, l, 1.0)[..., :1]
        if len(outs) > 1:
            outs[1][0, 0] = m_sc[...] + jnp.log2(l)


def _specs(st: _Static, n_kv: int, group: int, c: int):
    """BlockSpecs of (q, k, v[, k_scale, v_scale]) and the outputs, over the grid (B, J, T):
    q and the outputs per unit of ``st.pair`` heads (rows ``pair · G``, width ``pair · C``)."""
    units, (rows, width, _) = st.units, unit_blocks(st, group, c)

    def kv_tile(b, j, t, starts, lengths, lo, cnt):
        del starts, lengths
        bj = b * st.splits + j
        return lo[bj] + jnp.minimum(t, jnp.maximum(cnt[bj] - 1, 0))

    in_specs = [
        pl.BlockSpec((1, units, rows, width), lambda b, j, t, *_: (b, 0, 0, 0)),
        pl.BlockSpec((1, st.bs, n_kv, c), lambda b, j, t, *r: (b, kv_tile(b, j, t, *r), 0, 0)),
        pl.BlockSpec((1, st.bs, n_kv, c), lambda b, j, t, *r: (b, kv_tile(b, j, t, *r), 0, 0)),
    ]
    if st.dynamic:
        sc = pl.BlockSpec((1, n_kv, st.bs), lambda b, j, t, *r: (b, 0, kv_tile(b, j, t, *r)))
        in_specs += [sc, sc]
    out_specs = [pl.BlockSpec((1, 1, units, rows, width), lambda b, j, t, *_: (b, j, 0, 0, 0))]
    if st.splits > 1:
        out_specs.append(
            pl.BlockSpec((1, 1, units, rows, _LANES), lambda b, j, t, *_: (b, j, 0, 0, 0))
        )
    return in_specs, out_specs


def mma_dtype(kv_dtype) -> jnp.dtype:
    """The MXU input type for a cache dtype: f32 for F32, bf16 otherwise (FP8 upcast exactly)."""
    return jnp.dtype(jnp.float32 if jnp.dtype(kv_dtype) == jnp.float32 else jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "interpret"))
def decode_attention_tpu(
    q_BHC, k_BSKC, v_BSKC, lengths_B, *, starts_B=None, k_scale=None, v_scale=None, sm_scale,
    blocks: common.DecodeBlocks, interpret=False,
):  # fmt: skip
    """Mosaic TPU decode attention; same contract as ``decode_attention_reference``.

    ``blocks`` must be resolved (``block_s`` and ``num_splits`` set); operands must pass
    ``supports``.
    """
    b, h, c = q_BHC.shape
    _, s, n_kv, _ = k_BSKC.shape
    group, bs, splits = h // n_kv, blocks.block_s, blocks.num_splits
    dynamic = common.is_slot_scale(k_scale)
    st = _Static(
        bs=bs, n_kv=n_kv, splits=splits, steps=common.cdiv(s // bs, splits),
        mma_dtype=mma_dtype(k_BSKC.dtype), dynamic=dynamic,
        score_scale=float(sm_scale) * common.LOG2E, pair=head_pairs(n_kv), group=group,
    )  # fmt: skip
    units, pair = st.units, st.pair  # KV heads side by side in one MXU dot (head_pairs)
    starts_B = common.default_starts(starts_B, lengths_B)
    lo, cnt = common.split_ranges(
        starts_B, lengths_B, block_s=bs, num_splits=splits, num_tiles=s // bs
    )
    q = q_BHC.astype(jnp.float32).reshape(b, n_kv, group, c)
    if k_scale is not None and not dynamic:
        q = q * common.per_kv_head(k_scale, n_kv)[None, :, None, None]
    inputs = [unit_queries(q, pair).astype(st.mma_dtype), k_BSKC, v_BSKC]
    if dynamic:
        inputs += [jnp.asarray(x, jnp.float32) for x in (k_scale, v_scale)]
    in_specs, out_specs = _specs(st, n_kv, group, c)
    rows, width, scratch = unit_blocks(st, group, c)
    out_shape = [jax.ShapeDtypeStruct((b, splits, units, rows, width), jnp.float32)]
    if splits > 1:
        out_shape.append(jax.ShapeDtypeStruct((b, splits, units, rows, _LANES), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_kernel, st=st),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(b, splits, st.steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(starts_B, lengths_B.astype(jnp.int32), lo.reshape(-1), cnt.reshape(-1), *inputs)
    o_BJHC = heads_of_units(outs[0], pair, group, c)
    if splits > 1:
        o_BHC = common.combine_splits(o_BJHC, outs[1][..., 0].reshape(b, splits, h))
    else:
        o_BHC = o_BJHC[:, 0]
    if v_scale is not None and not dynamic:
        o_BHC = o_BHC * jnp.repeat(common.per_kv_head(v_scale, n_kv), group)[None, :, None]
    return o_BHC.astype(q_BHC.dtype)


_KV_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2)))
_Q_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float32)))
_HEAD_DIMS = (128,)  # proven by aot_cases.py
_BLOCK_S = (128, 256, 512)


def resolve_blocks(config: common.DecodeBlocks | None, q_BHC, k_BSKC) -> common.DecodeBlocks:
    """``config`` with its None fields set: the largest block_s in (512, 256, 128) dividing S,
    one chunk per row (v5e / v6e have one TensorCore: splitting a row buys no parallelism)."""
    del q_BHC
    config = config or common.DecodeBlocks()
    s = k_BSKC.shape[1]
    bs = config.block_s or next((x for x in reversed(_BLOCK_S) if s % x == 0), _BLOCK_S[0])
    splits = max(1, min(config.num_splits or 1, s // bs))
    return common.DecodeBlocks(block_s=bs, num_splits=splits, num_stages=config.num_stages)


def supports(q_BHC, k_BSKC, v_BSKC, lengths_B, *, starts_B, k_scale, v_scale, sm_scale, config,
             interpret) -> str | None:  # fmt: skip
    """None if the Mosaic TPU kernel compiles for these operands (proven shapes), else why not."""
    del lengths_B, starts_B, k_scale, v_scale, sm_scale
    from kernels_pallas.backend import device_reason

    if (reason := device_reason("tpu", interpret)) is not None:
        return reason
    s, c = k_BSKC.shape[1], k_BSKC.shape[3]
    if k_BSKC.dtype not in _KV_DTYPES or v_BSKC.dtype != k_BSKC.dtype:
        return f"cache dtype {k_BSKC.dtype}/{v_BSKC.dtype} not in {[d.name for d in _KV_DTYPES]}"
    if q_BHC.dtype not in _Q_DTYPES:
        return f"q dtype {q_BHC.dtype} not in {[d.name for d in _Q_DTYPES]}"
    if c not in _HEAD_DIMS:
        return f"head_dim {c} not in {_HEAD_DIMS}"
    blocks = resolve_blocks(config, q_BHC, k_BSKC)
    if blocks.block_s not in _BLOCK_S or s % blocks.block_s:
        return f"cache length {s} needs a block_s in {_BLOCK_S} dividing it (got {blocks.block_s})"
    return None
