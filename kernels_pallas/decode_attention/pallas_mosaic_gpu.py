"""Decode attention on Hopper (Mosaic GPU): one CTA per (KV head, row, sequence chunk).

Two kernels share this entry point, the support check and the output path: by default the
swap-AB kernel (``mgpu_swap``: the KV tile as the wgmma M side, the query group as its N, no
64-row padding); with ``DecodeBlocks(swap_ab=False)`` the kernel below, whose query group
is padded to a 64-row M tile. Both read the same tiles and compute the same softmax.

The query group of KV head ``kh`` (``group`` rows, read as a 64-row window of q starting at row
``kh · group``: rows past the group belong to other heads or to zero padding, and their outputs
are dropped) attends over the live tiles of its chunk only: the pipeline's grid is the chunk's
dynamic tile count, so tiles outside ``[start, length)`` are never read. Per tile of ``block_s``
slots a TMA pipeline brings K/V (and dynamic scales) into SMEM; the scores ``S = Q Kᵀ`` and
``O += P V`` run on the tensor cores in f16 (FP8 caches: tiles upcast FP8 -> f16 in registers,
exact for E4M3/E5M2, into one SMEM buffer each; ptxas 12.9 cannot convert FP8 -> BF16) or bf16
(BF16 caches, fed straight from the pipeline buffers), with f32 accumulation and an online
softmax in base 2. Scales: a static K scale (per KV head, read as a scalar in the CTA) is
folded into the softmax scale that multiplies the f32 scores, never into q before its f16 cast
(which would overflow above 65,504 and lose precision below 6e-5); a static V scale multiplies
the output (outside); dynamic ones multiply the scores' and probabilities' columns.

Output per chunk: ``o / l`` (f32) and, when the row is split, ``lse = m + log2 l`` for
``common.combine_splits``. On hardware P stays in registers (wgmma A operand) and O accumulates
in place; interpret mode passes P through SMEM and uses a scoped accumulator, the only forms the
GPU interpreter runs (same math).

Paging (a later issue) plugs in at the pipeline's index map: tile ``lo + i`` of a row becomes
``page_table[row, lo + i]`` of a page pool; lengths, chunks and masks stay as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.act_quantize import fused
from kernels_pallas.decode_attention import common, mgpu_swap, mgpu_tile
from kernels_pallas.dependent_launch import dependent_launch

_TILE_M = 64  # wgmma M: the query group is a 64-row window


_Static = mgpu_tile.Static
_transforms = mgpu_tile.transforms


def _col(x_ref, bs):
    """A [bs] SMEM vector broadcast over the 64 rows of a score tile."""
    return lax.broadcast_in_dim(x_ref[...], (_TILE_M, bs), [1])


def _tile_step(st: _Static, q_smem, kb_smem, vb_smem, p_smem, bounds, idx, k_smem, v_smem, *rest):
    """One tile of the online softmax: returns the new (acc, m, l)."""
    *scales, (acc, m_i, l_i) = rest
    t_lo, start, length, qk_scale = bounds
    bs, dt = st.bs, st.mma_dtype
    if st.fp8:  # FP8 -> f16 in registers, into the wgmma-ready buffer
        kb_smem[...] = k_smem[...].astype(dt)
        plgpu.commit_smem()

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, (kb_smem if st.fp8 else k_smem).T)
        if st.fp8:  # overlaps the QK wgmma
            vb_smem[...] = v_smem[...].astype(dt)
        return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((_TILE_M, bs), jnp.float32)) * qk_scale
    v_smem = vb_smem if st.fp8 else v_smem
    if st.dynamic:
        s = s * _col(scales[0], bs)
    slot = (t_lo + idx[0]) * bs + plgpu.broadcasted_iota(
        jnp.int32, (_TILE_M, bs), 1, layout=plgpu.Layout.WGMMA
    )
    s = jnp.where((slot >= start) & (slot < length), s, -jnp.inf)
    # Every live tile holds a live slot, so m_new is finite and alpha = 0 on the first tile.
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    if st.dynamic:
        p = p * _col(scales[1], bs)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return _add_pv(st, acc, p.astype(dt), v_smem, p_smem), m_new, l_i


def _add_pv(st: _Static, acc, p16, v_smem, p_smem):
    """``acc + P V`` on the tensor cores (the fences cover the upcast V buffer too)."""
    if st.hw:  # P from registers, O accumulated in place (~70 fewer registers)
        if st.fp8:
            plgpu.commit_smem()
        return pl.run_state(lambda o_ref: plgpu.wgmma(o_ref, p16, v_smem))(plgpu.ACC.init(acc))
    # Interpret mode: the GPU interpreter takes wgmma operands from SMEM only, and a fresh
    # run_scoped accumulator.
    p_smem[...] = p16
    plgpu.commit_smem()

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_smem)
        return acc_ref[...]

    return acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))


def _kernel(starts, lengths, lo, cnt, k_scale, q_gmem, k_gmem, v_gmem, *rest, st: _Static):
    dependent_launch(interpret=not st.hw)  # before the first read (the row's new slot, q)
    scales, outs = (rest[:2], rest[2:]) if st.dynamic else ((), rest)
    kh, row, j = lax.axis_index("kv"), lax.axis_index("row"), lax.axis_index("split")
    c, bs, dt = q_gmem.shape[-1], st.bs, st.mma_dtype
    bounds = (lo[row, j], starts[row], lengths[row], st.score_scale * k_scale[kh])
    n_tiles = cnt[row, j]
    # The q window starts at a multiple of 8 rows (TMA into the tiled buffer); the group sits
    # at row offset ``off`` inside it.
    q0 = pl.multiple_of((kh * st.group) // 8 * 8, 8)
    off = kh * st.group - q0

    def compute(q_smem, kb_smem, vb_smem, p_smem, q_barrier):
        plgpu.copy_gmem_to_smem(q_gmem.at[row, pl.ds(q0, _TILE_M)], q_smem, q_barrier)
        plgpu.barrier_wait(q_barrier)
        specs, srcs = mgpu_tile.dense_sources(st, k_gmem, v_gmem, scales, row, kh, bounds[0], c)
        init = (
            plgpu.layout_cast(jnp.zeros((_TILE_M, c), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(
                jnp.full((_TILE_M,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
            ),
            plgpu.layout_cast(jnp.zeros((_TILE_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        step = functools.partial(_tile_step, st, q_smem, kb_smem, vb_smem, p_smem, bounds)
        return plgpu.emit_pipeline(
            step, grid=(n_tiles,), in_specs=specs, max_concurrent_steps=st.stages, init_carry=init
        )(*srcs)

    # 16-bit caches feed wgmma straight from the pipeline buffers: no upcast copies.
    kv_buf = plgpu.SMEM((bs, c), dt, transforms=_transforms(c, dt)) if st.fp8 else None
    acc, m_i, l_i = pl.run_scoped(
        compute,
        plgpu.SMEM((_TILE_M, c), dt, transforms=_transforms(c, dt)),
        kv_buf,
        kv_buf,
        None if st.hw else plgpu.SMEM((_TILE_M, bs), dt, transforms=_transforms(bs, dt)),
        plgpu.Barrier(num_barriers=1),
    )
    _write_out(st, outs, acc, m_i, l_i, (row, kh, j, off))


def _write_out(st: _Static, outs, acc, m_i, l_i, where):
    """o / l of the group's rows (and lse when split) -> GMEM, through SMEM."""
    row, kh, j, off = where
    g = st.group
    mgpu_tile.write_chunk(
        acc, m_i, l_i, l_dim=0, o_dst=outs[0].at[row, j, pl.ds(kh * g, g)],
        lse_dst=outs[1].at[row, j, kh] if st.splits > 1 else None,
        o_part=lambda o_smem: o_smem.at[pl.ds(off, g)],
    )  # fmt: skip


def _q_rows(n_kv: int, group: int) -> int:
    """Rows of the padded q: the last head's window ends at its 8-aligned start + 64."""
    return common.cdiv((n_kv - 1) * group // 8 * 8 + _TILE_M, 8) * 8


def _lse_rows(n_kv: int, group: int) -> np.ndarray:
    """Index of head h's row in the flattened [K, 64] lse tiles."""
    h = np.arange(n_kv * group)
    return h // group * _TILE_M + fused.lse_row(h, group)


def static_k_scale(k_scale, n_kv: int) -> jax.Array:
    """[K] f32: the static per-KV-head K scale the kernel folds into its score scale (ones when
    there is none or it is per slot)."""
    if k_scale is None or common.is_slot_scale(k_scale):
        return jnp.ones((n_kv,), jnp.float32)
    return common.per_kv_head(k_scale, n_kv).astype(jnp.float32)


def mma_dtype(kv_dtype) -> jnp.dtype:
    """The tensor-core input type for a cache dtype: bf16 for BF16, f16 otherwise (FP8, F16)."""
    return jnp.dtype(jnp.bfloat16 if jnp.dtype(kv_dtype) == jnp.bfloat16 else jnp.float16)


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "quant_out", "interpret"))
def decode_attention_mgpu(
    q_BHC, k_BSKC, v_BSKC, lengths_B, *, starts_B=None, k_scale=None, v_scale=None, sm_scale,
    blocks: common.DecodeBlocks, quant_out=None, interpret=False,
):  # fmt: skip
    """Mosaic GPU decode attention; same contract as ``decode_attention_reference``.

    ``blocks`` must be resolved (``block_s``, ``num_splits``, ``swap_ab`` set: ``swap_ab`` runs
    ``mgpu_swap``'s kernel); operands must pass ``supports``. ``quant_out`` (an FP8 dtype):
    the output as a QArray ``[B, H·C]`` in 1x128 groups (``api.decode_attention``), the
    chunks' combine, V scale, cast and quantization in one Triton launch where it takes the
    shape (head_dim 128, B a multiple of 16).
    """
    b, h, c = q_BHC.shape
    _, s, n_kv, _ = k_BSKC.shape
    group, bs, splits = h // n_kv, blocks.block_s, blocks.num_splits
    dt = mma_dtype(k_BSKC.dtype)
    starts_B = common.default_starts(starts_B, lengths_B)
    lo, cnt = common.split_ranges(
        starts_B, lengths_B, block_s=bs, num_splits=splits, num_tiles=s // bs
    )
    swap = blocks.swap_ab
    if swap:
        q = mgpu_swap.queries(q_BHC, n_kv, dt)
    else:  # The last head's 64-row window reads past H: zero rows, whose outputs are dropped.
        q = jnp.pad(q_BHC.astype(dt), ((0, 0), (0, _q_rows(n_kv, group) - h), (0, 0)))
    k_scale_K = static_k_scale(k_scale, n_kv)
    dynamic = common.is_slot_scale(k_scale)
    st = _Static(
        bs=bs, group=group, splits=splits, stages=blocks.num_stages, mma_dtype=dt,
        fp8=jnp.dtype(k_BSKC.dtype).itemsize == 1, dynamic=dynamic,
        score_scale=float(sm_scale) * common.LOG2E, hw=not interpret,
    )  # fmt: skip
    scales = []
    if dynamic:
        scales = [jnp.asarray(x, jnp.float32) for x in (k_scale, v_scale)]
    out_type = out_types(b, splits, n_kv, c, group, swap)
    outs = plgpu.kernel(
        functools.partial(mgpu_swap.kernel if swap else _kernel, st=st),
        out_type=out_type,
        grid=(n_kv, b, splits),
        grid_names=("kv", "row", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),  # fast exp2 / log2
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(starts_B, lengths_B.astype(jnp.int32), lo, cnt, k_scale_K, q, k_BSKC, v_BSKC, *scales)
    static_v = None if common.is_slot_scale(v_scale) else v_scale  # dynamic: in the kernel
    return output(outs, static_v, n_kv=n_kv, group=group, out_dtype=q_BHC.dtype,
                  quant_out=quant_out, interpret=interpret)  # fmt: skip


def out_types(b: int, splits: int, n_kv: int, c: int, group: int, swap: bool) -> list:
    """The kernel's chunk outputs: o [B, J, H, C] and, when split, the 64-row lse tiles
    [B, J, K, 64] (f32); swapped, ``mgpu_swap.out_types``."""
    if swap:
        return mgpu_swap.out_types(b, splits, n_kv, c, group)
    out = [jax.ShapeDtypeStruct((b, splits, n_kv * group, c), jnp.float32)]
    if splits > 1:
        out.append(jax.ShapeDtypeStruct((b, splits, n_kv, _TILE_M), jnp.float32))
    return out


def output(outs, v_scale, *, n_kv: int, group: int, out_dtype, quant_out=None,
           interpret=False):  # fmt: skip
    """The kernel's chunk outputs (``out_types``: ``[B, J, H, C]`` f32 and, when J > 1, the raw
    lse tiles, or the swap-AB kernel's transposed ones) -> ``o`` [B, H, C] in ``out_dtype``: the
    chunks combined, times the static ``v_scale`` ([] or [K], or None). With ``quant_out`` (an
    FP8 dtype) a QArray ``[B, H·C]`` of ``o`` in 1x128 groups, computed in one Triton launch
    where it takes the shape (dense and paged kernels, either layout)."""
    splits = outs[0].shape[1]
    if quant_out is not None and fused.combine_supports(outs[0].shape, out_dtype) is None:
        v_K = jnp.ones(n_kv, jnp.float32) if v_scale is None else common.per_kv_head(v_scale, n_kv)
        return fused.combine_quantize_triton(
            outs[0], outs[1] if splits > 1 else None, v_K, group=group, out_dtype=out_dtype,
            dtype=quant_out, interpret=interpret,
        )  # fmt: skip
    if outs[0].ndim == 5:  # swap-AB: transposed chunks
        o_BHC = mgpu_swap.combine(outs, group)
    elif splits > 1:
        b = outs[0].shape[0]
        lse_BJH = outs[1].reshape(b, splits, n_kv * _TILE_M)[:, :, _lse_rows(n_kv, group)]
        o_BHC = common.combine_splits(outs[0], lse_BJH)
    else:
        o_BHC = outs[0][:, 0]
    if v_scale is not None:
        o_BHC = o_BHC * jnp.repeat(common.per_kv_head(v_scale, n_kv), group)[None, :, None]
    return common.quantize_output(o_BHC.astype(out_dtype), quant_out)


_KV_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)))
_Q_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float32)))
# What aot_cases.py proves to compile without spills (head_dim 256: a 128-register f32 acc).
_HEAD_DIMS = (64, 128)
# Registers (aot_cases, H100): swap-AB <= 128 (FP8) and <= 72 (16-bit) up to a group of 8, 242 at
# the widest group (N = 64); unswapped <= 185 at 64 and at 128 (16-bit caches).
_BLOCK_S = (64, 128)
_BLOCK_S_FP8 = (64,)  # unswapped FP8 at 128 (upcast tiles in registers): 244-255, the spill edge
# Swap-AB FP8 at 128 slots (twice the bytes per serial tile step, one CTA per SM): K's upcast
# [128, 128] f16 tile is 64 registers, so only narrow query groups fit (wgmma N <= 16).
_BLOCK_S_FP8_SWAP = (64, 128)
_SWAP_N_FP8_WIDE = 16
# Pipeline depths: the default (``default_stages``) and the others the autotuner times. The first
# H200 run measured the FP8 kernel at 3 stages (2 x 16 KB of loads in flight per CTA while it
# computes on the third, two CTAs per SM) at 58-68% of HBM: its tile steps took (load round trip +
# the step) / 3 with one round trip of ~3.5 us, as the BF16 kernel's at 2 stages did
# (``perf_model.calibration.attention_latency``), which the BF16 kernel's 32 KB tiles turned into
# 83-91% of HBM. At 5 stages the same round trip allows ~1.7x the FP8 kernel's measured rate, past
# the HBM bound (the performance model: 84-88% of an H200's HBM at B x K >= 64, from 62-64%), in
# ~101 KB of SMEM per CTA (still two per SM; 0 spills, 114-123 registers, both jax versions).
_STAGES = (2, 3, 4, 5)
NUM_SMS = 132  # H100 SXM / H200
_CTAS_PER_SM = 2  # SMEM <= ~113 KiB and <= 255 registers x 128 threads allow two


def smem_bytes(blocks: common.DecodeBlocks, c: int, kv_dtype, dynamic: bool, group: int) -> int:
    """Dynamic SMEM of one CTA: the larger of the main-loop scope and the output scope."""
    kv = jnp.dtype(kv_dtype).itemsize
    bs = blocks.block_s
    stage = 2 * bs * c * kv + (2 * bs * 4 if dynamic else 0)
    rows = mgpu_swap.swap_n(group) if blocks.swap_ab else _TILE_M  # q rows (and P's)
    loop = blocks.num_stages * stage + rows * c * 2 + rows * bs * 2  # + q, P (interpret/swapped)
    if kv == 1:  # the f16 upcast buffers: K and V, swapped V only (K upcast in registers)
        loop += (1 if blocks.swap_ab else 2) * bs * c * 2
    out = rows * c * 4 + rows * 4
    return max(loop, out) + 1024  # barriers and alignment


def default_stages(kv_dtype, swap_ab: bool = True) -> int:
    """K/V tiles in flight when a config leaves ``num_stages`` unset (dense and paged kernels): 5
    on an FP8 cache (the swap-AB kernel; 3 unswapped, whose 64-row tiles take more SMEM and
    which the device measured slower), 2 on a 16-bit one (83-91% of HBM measured); each keeps
    SMEM within two CTAs per SM."""
    if jnp.dtype(kv_dtype).itemsize == 1:
        return 5 if swap_ab else 3
    return 2


def resolve_blocks(config: common.DecodeBlocks | None, q_BHC, k_BSKC) -> common.DecodeBlocks:
    """``config`` with its None fields set: block_s 64, ``default_stages``, chunks to fill one
    wave of 2 x 132 CTAs, swap-AB."""
    del q_BHC
    config = config or common.DecodeBlocks()
    b, s, n_kv, _ = k_BSKC.shape
    bs = config.block_s or 64
    swap = common.swap_ab_on(config)
    stages = config.num_stages or default_stages(k_BSKC.dtype, swap)
    splits = common.resolve_splits(config.num_splits, b * n_kv, NUM_SMS * _CTAS_PER_SM, s // bs)
    return common.DecodeBlocks(block_s=bs, num_splits=splits, num_stages=stages, swap_ab=swap)


def _window_fits(n_kv: int, group: int) -> bool:
    """Each head's group fits its 64-row q window (which starts at a multiple of 8)."""
    return all((kh * group) % 8 + group <= _TILE_M for kh in range(n_kv))


def block_sizes(kv_dtype, swap: bool, group: int) -> tuple[int, ...]:
    """The ``block_s`` values proven to compile for a cache dtype, kernel and query group."""
    if jnp.dtype(kv_dtype).itemsize > 1:
        return _BLOCK_S
    if swap and mgpu_swap.swap_n(group) <= _SWAP_N_FP8_WIDE:
        return _BLOCK_S_FP8_SWAP
    return _BLOCK_S_FP8


def group_reason(n_kv: int, group: int, swap: bool) -> str | None:
    """Why the query group does not fit the kernel's MMA tile (None: it does)."""
    if swap and mgpu_swap.swap_n(group) > mgpu_swap.MAX_N:
        return f"query group {group} over the swap-AB kernel's wgmma N {mgpu_swap.MAX_N}"
    if not swap and not _window_fits(n_kv, group):
        return f"query group {group} does not fit a {_TILE_M}-row window"
    return None


def supports(q_BHC, k_BSKC, v_BSKC, lengths_B, *, starts_B, k_scale, v_scale, sm_scale, config,
             interpret) -> str | None:  # fmt: skip
    """None if the Mosaic GPU kernel compiles for these operands (proven shapes), else why not."""
    del lengths_B, starts_B, v_scale, sm_scale
    from kernels_pallas.backend import device_reason

    if (reason := device_reason("gpu", interpret)) is not None:
        return reason
    b, s, n_kv, c = k_BSKC.shape
    if k_BSKC.dtype not in _KV_DTYPES or v_BSKC.dtype != k_BSKC.dtype:
        return f"cache dtype {k_BSKC.dtype}/{v_BSKC.dtype} not in {[d.name for d in _KV_DTYPES]}"
    if q_BHC.dtype not in _Q_DTYPES:
        return f"q dtype {q_BHC.dtype} not in {[d.name for d in _Q_DTYPES]}"
    if c not in _HEAD_DIMS:
        return f"head_dim {c} not in {_HEAD_DIMS}"
    group = q_BHC.shape[1] // n_kv
    bl = resolve_blocks(config, q_BHC, k_BSKC)
    if (reason := group_reason(n_kv, group, bl.swap_ab)) is not None:
        return reason
    block_s = block_sizes(k_BSKC.dtype, bl.swap_ab, group)
    if bl.block_s not in block_s or bl.num_stages not in _STAGES:
        return f"block_s {bl.block_s}, num_stages {bl.num_stages} not in {block_s}, {_STAGES}"
    if s % bl.block_s:
        return f"cache length {s} not a multiple of block_s {bl.block_s}"
    if (n := smem_bytes(bl, c, k_BSKC.dtype, common.is_slot_scale(k_scale), group)) > 227 * 1024:
        return f"SMEM {n} B over the 227 KiB budget"
    return None
