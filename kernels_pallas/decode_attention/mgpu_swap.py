"""Swap-AB decode attention on Hopper: the KV tile is the wgmma M side, the query group its N.

The unswapped kernel (``pallas_mosaic_gpu``) runs ``S = Q Kᵀ`` with the query group padded to a
64-row M tile: at GQA 4 that is 94% of every MMA and of the softmax's registers and instructions
spent on padding rows. Here each tile computes ``Sᵀ = K Qᵀ`` [block_s, N] with N the group padded
to a multiple of 8 (``swap_n``: Qwen3-8B's 4 -> 8), the online softmax runs down the columns
(one max and sum per query head across the tile's slots: a cross-warp reduction), ``Pᵀ`` goes
to SMEM as the K-major B operand (a transposed store: a [N, block_s] f16 tile) and
``Oᵀ += Vᵀ Pᵀ`` [C, N] accumulates in registers (V as a transposed f16 A operand, which 16-bit
wgmma allows). FP8 tiles are upcast to f16 (exact; 8-bit wgmma would need an FP8 query and
both operands K-major): K in registers, fed to wgmma as the A operand, so it never goes back
to SMEM; V through one SMEM buffer, because its transpose is the A operand and Mosaic GPU has no
register layout for a transposed 8-bit tile that wgmma takes. Scales, masks, chunks and
outputs mean the same as unswapped. Interpret mode upcasts K through SMEM as well (the GPU
interpreter takes wgmma operands from SMEM only; same values).

The kernel writes ``Oᵀ`` [B, J, K, C, N] (f32: Mosaic GPU has no transposed 32-bit store) and
the per-column lse [B, J, K, N]; ``outputs`` gives them the unswapped kernel's form for
``pallas_mosaic_gpu.output``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.decode_attention import common
from kernels_pallas.decode_attention.mgpu_tile import (
    Static,
    dense_sources,
    transforms,
    write_chunk,
)
from kernels_pallas.dependent_launch import dependent_launch

MAX_N = 64  # the widest query group compiled (``aot_cases``): Oᵀ [128, 64] f32 is 64 registers


def swap_n(group: int) -> int:
    """The wgmma N: the query group padded to a multiple of 8."""
    return common.cdiv(group, 8) * 8


def queries(q_BHC, n_kv: int, dtype) -> jax.Array:
    """q [B, H, C] -> [B, K, N, C] in the MMA type: each KV head's group padded to N rows."""
    b, h, c = q_BHC.shape
    group = h // n_kv
    q = q_BHC.astype(dtype).reshape(b, n_kv, group, c)
    return jnp.pad(q, ((0, 0), (0, 0), (0, swap_n(group) - group), (0, 0)))


def out_types(b: int, splits: int, n_kv: int, c: int, group: int) -> list:
    """``Oᵀ`` chunks [B, J, K, C, N] and, when split, their lse [B, J, K, N] (f32)."""
    n = swap_n(group)
    out = [jax.ShapeDtypeStruct((b, splits, n_kv, c, n), jnp.float32)]
    if splits > 1:
        out.append(jax.ShapeDtypeStruct((b, splits, n_kv, n), jnp.float32))
    return out


def _row(x_ref, shape):
    """A [block_s] SMEM vector broadcast over the query columns of a transposed score tile."""
    return lax.broadcast_in_dim(x_ref[...], shape, [0])


def _tile_step(st: Static, q_smem, kb_smem, vb_smem, p_smem, bounds, idx, k_smem, v_smem, *rest):
    """One tile of the online softmax, transposed: returns the new (``Oᵀ``, m, l)."""
    *scales, (acc, m_i, l_i) = rest
    t_lo, start, length, qk_scale = bounds
    bs, dt = st.bs, st.mma_dtype
    shape = (bs, q_smem.shape[0])
    k_op = k_smem  # 16-bit caches: straight from the pipeline buffer
    if st.fp8 and st.hw:  # FP8 -> f16 in registers as the A operand: no SMEM round trip
        k_op = plgpu.load(k_smem, layout=plgpu.Layout.WGMMA, optimized=False).astype(dt)
    elif st.fp8:  # interpret mode: the GPU interpreter takes wgmma operands from SMEM only
        kb_smem[...] = k_smem[...].astype(dt)
        plgpu.commit_smem()
        k_op = kb_smem

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, k_op, q_smem.T)
        if st.fp8:  # overlaps the QK wgmma
            vb_smem[...] = v_smem[...].astype(dt)
        return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32)) * qk_scale
    v_smem = vb_smem if st.fp8 else v_smem
    if st.dynamic:
        s = s * _row(scales[0], shape)
    slot = (t_lo + idx[0]) * bs + plgpu.broadcasted_iota(
        jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA
    )
    s = jnp.where((slot >= start) & (slot < length), s, -jnp.inf)
    # Every live tile holds a live slot, so m_new is finite and alpha = 0 on the first tile.
    m_new = jnp.maximum(m_i, s.max(axis=0))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [1]))
    # l stays a [block_s, N] tile of partial sums (``attend`` sums its rows once, at the end):
    # a column sum per tile would cross the warpgroup's four warps (SMEM and a barrier), on the
    # tile's serial path; the max above must (P's columns share one scale across all slots).
    l_i = l_i * lax.broadcast_in_dim(alpha, shape, [1]) + p
    if st.dynamic:
        p = p * _row(scales[1], shape)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
    p_smem.T[...] = p.astype(dt)  # Pᵀ stored as P [N, block_s]: the K-major B operand
    plgpu.commit_smem()  # also fences the upcast V buffer

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, v_smem.T, p_smem.T)

    if st.hw:  # Oᵀ accumulated in place
        return pl.run_state(pv)(plgpu.ACC.init(acc)), m_new, l_i
    # Interpret mode: the GPU interpreter takes a fresh run_scoped accumulator only.
    return acc + pl.run_scoped(lambda r: (pv(r), r[...])[1], plgpu.ACC(acc.shape)), m_new, l_i


def attend(st: Static, q_src, specs, srcs, bounds, n_tiles, c: int):
    """The chunk's online softmax over its ``n_tiles`` tiles (the TMA pipeline over ``specs``
    of ``srcs``: K, V and the dynamic scales) -> (``Oᵀ`` [C, N], m [N], l [N]), f32. The row
    sums l are carried as a [block_s, N] tile (``_tile_step``) and summed over its rows here."""
    n, bs, dt = q_src.shape[0], st.bs, st.mma_dtype

    def compute(q_smem, kb_smem, vb_smem, p_smem, q_barrier):
        plgpu.copy_gmem_to_smem(q_src, q_smem, q_barrier)
        plgpu.barrier_wait(q_barrier)
        col = plgpu.Layout.WGMMA.reduce(0)
        init = (
            plgpu.layout_cast(jnp.zeros((c, n), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), col),
            plgpu.layout_cast(jnp.zeros((bs, n), jnp.float32), plgpu.Layout.WGMMA),
        )
        step = functools.partial(_tile_step, st, q_smem, kb_smem, vb_smem, p_smem, bounds)
        acc, m_i, l_tile = plgpu.emit_pipeline(
            step, grid=(n_tiles,), in_specs=specs, max_concurrent_steps=st.stages,
            init_carry=init,
        )(*srcs)  # fmt: skip
        return acc, m_i, l_tile.sum(axis=0)

    # 16-bit caches feed wgmma straight from the pipeline buffers: no upcast copies. FP8: V
    # upcast into one buffer (its transpose as the A operand needs SMEM: an 8-bit register
    # transpose has no layout that wgmma takes); K only in interpret mode.
    buf = plgpu.SMEM((bs, c), dt, transforms=transforms(c, dt))
    return pl.run_scoped(
        compute,
        plgpu.SMEM((n, c), dt, transforms=transforms(c, dt)),
        buf if st.fp8 and not st.hw else None,
        buf if st.fp8 else None,
        plgpu.SMEM((n, bs), dt, transforms=transforms(bs, dt)),
        plgpu.Barrier(num_barriers=1),
    )


def write(st: Static, outs, acc, m_i, l_i, where) -> None:
    """``Oᵀ / l`` (and lse = m + log2 l when split) of chunk ``where = (row, j, kh)`` -> GMEM."""
    lse_dst = outs[1].at[where] if st.splits > 1 else None
    write_chunk(acc, m_i, l_i, l_dim=1, o_dst=outs[0].at[where], lse_dst=lse_dst)


def kernel(starts, lengths, lo, cnt, k_scale, q_gmem, k_gmem, v_gmem, *rest, st: Static):
    """The dense cache's kernel: one CTA per (KV head, row, chunk)."""
    dependent_launch(interpret=not st.hw)  # before the first read (the row's new slot, q)
    scales, outs = (rest[:2], rest[2:]) if st.dynamic else ((), rest)
    kh, row, j = lax.axis_index("kv"), lax.axis_index("row"), lax.axis_index("split")
    c = q_gmem.shape[-1]
    bounds = (lo[row, j], starts[row], lengths[row], st.score_scale * k_scale[kh])
    specs, srcs = dense_sources(st, k_gmem, v_gmem, scales, row, kh, bounds[0], c)
    acc, m_i, l_i = attend(st, q_gmem.at[row, kh], specs, srcs, bounds, cnt[row, j], c)
    write(st, outs, acc, m_i, l_i, (row, j, kh))


def combine(outs, group: int) -> jax.Array:
    """The kernel's ``Oᵀ`` [B, J, K, C, N] chunks (and lse [B, J, K, N] when J > 1) combined into
    ``o`` [B, H, C] f32: ``common.combine_splits``'s formula, computed in the transposed layout
    (padded columns dropped) as elementwise products and sums over J, so that XLA fuses the
    weights, the sum and the final transpose into one or two kernels."""
    o = outs[0][..., :group]
    b, splits, n_kv, c, _ = o.shape
    if splits > 1:
        lse = outs[1][..., :group]  # [B, J, K, G]
        m = jnp.max(lse, axis=1, keepdims=True)
        w = jnp.exp2(lse - jnp.where(jnp.isfinite(m), m, 0.0))
        den = jnp.sum(w, axis=1)  # [B, K, G]
        o_BKCG = jnp.sum(w[:, :, :, None, :] * o, axis=1) / jnp.where(den > 0, den, 1.0)[:, :, None]
    else:
        o_BKCG = o[:, 0]
    return jnp.swapaxes(o_BKCG, -1, -2).reshape(b, n_kv * group, c)
