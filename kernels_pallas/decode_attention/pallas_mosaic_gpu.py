"""Decode attention on Hopper (Mosaic GPU): one CTA per (KV head, row), tiles over cache slots.

The query group of a KV head (``group`` rows, zero-padded to the 64-row wgmma tile) attends over
the row's slots in tiles of ``block_s``: a pipeline streams K/V tiles GMEM -> SMEM with TMA, the
kernel upcasts FP8 tiles to BF16 in registers (into a second SMEM buffer), runs
``S = Q Kᵀ`` and ``O += P V`` on the tensor cores with an online softmax in float32. Scales are
applied outside the matmuls: ``s = (q·K̂) · kmul[s] + bias[s]``, ``p̃ = p · vmul[s]`` where
``kmul = sm_scale · s_K`` and ``vmul = s_V`` are per slot (static scales broadcast, dynamic ones
as stored) and ``bias`` is 0 / -inf from the valid mask. That costs 12 bytes of f32 per
(slot, KV head) next to the C bytes of an FP8 vector (~9% at C = 128): the simple, uniform
choice; a static-scale specialization can fold them into q and the output instead.

Requirements: head dim C a multiple of 64, ``block_s`` a multiple of 64, group <= 64.
Tested on CPU in Mosaic GPU interpret mode (which runs a single grid block); not yet compiled on
a Hopper machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.decode_attention.common import DEFAULT_BLOCKS, DecodeBlocks, pad_slots

_TILE_M = 64  # wgmma M: the query group is padded to this many rows


def _transforms(minor: int, dtype):
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def _slot_multipliers(q_BHC, k_BSKC, valid_BS, k_scale, v_scale, sm_scale):
    """kmul, vmul [B, K, S] f32 and bias [B, S] f32 (see the module docstring)."""
    b, s, n_kv, _ = k_BSKC.shape

    def per_slot(scale):
        if scale is None:
            return jnp.ones((b, n_kv, s), jnp.float32)
        scale = jnp.asarray(scale, jnp.float32)
        if scale.ndim == 3:  # dynamic [B, S, K]
            return jnp.transpose(scale, (0, 2, 1))
        return jnp.broadcast_to(jnp.broadcast_to(scale, (n_kv,))[None, :, None], (b, n_kv, s))

    bias = jnp.where(valid_BS, 0.0, -jnp.inf).astype(jnp.float32)
    return per_slot(k_scale) * sm_scale, per_slot(v_scale), bias


def _body(q_gmem, k_gmem, v_gmem, kmul_gmem, vmul_gmem, bias_gmem, o_gmem, *, bs, n_tiles):
    kh, row = lax.axis_index("kv"), lax.axis_index("row")
    c = q_gmem.shape[-1]
    bf16 = jnp.bfloat16

    def scoped(q_smem, kb_smem, vb_smem, p_smem, o_smem, q_barrier):
        plgpu.copy_gmem_to_smem(q_gmem.at[row, kh], q_smem, q_barrier)
        plgpu.barrier_wait(q_barrier)

        def tile(_, k_smem, v_smem, kmul_smem, vmul_smem, bias_smem, carry):
            acc, m_i, l_i = carry
            kb_smem[...] = k_smem[...].astype(bf16)  # FP8 -> BF16 upcast in registers
            vb_smem[...] = v_smem[...].astype(bf16)
            plgpu.commit_smem()

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, kb_smem.transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((_TILE_M, bs), jnp.float32))
            col = lambda x_ref: lax.broadcast_in_dim(x_ref[...], (_TILE_M, bs), [1])
            s = s * col(kmul_smem) + col(bias_smem)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m_i - m_safe)
            p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            # P goes through SMEM: the GPU interpreter only takes wgmma operands from SMEM.
            p_smem[...] = (p * col(vmul_smem)).astype(bf16)
            plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, vb_smem)
                return acc_ref[...]

            pv_MC = pl.run_scoped(pv, plgpu.ACC((_TILE_M, c), jnp.float32))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_MC
            return acc, m_new, l_i

        kv_spec = plgpu.BlockSpec((bs, c), lambda i: (i, 0))
        vec_spec = plgpu.BlockSpec((bs,), lambda i: (i,))
        init = (
            jnp.zeros((_TILE_M, c), jnp.float32),
            jnp.full((_TILE_M,), -jnp.inf, jnp.float32),
            jnp.zeros((_TILE_M,), jnp.float32),
        )
        acc, _, l_i = plgpu.emit_pipeline(
            tile,
            grid=(n_tiles,),
            in_specs=[kv_spec, kv_spec, vec_spec, vec_spec, vec_spec],
            max_concurrent_steps=2,
            init_carry=init,
        )(
            k_gmem.at[row, :, kh],
            v_gmem.at[row, :, kh],
            kmul_gmem.at[row, kh],
            vmul_gmem.at[row, kh],
            bias_gmem.at[row],
        )
        l_i = jnp.where(l_i > 0, l_i, 1.0)
        o_smem[...] = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[row, kh])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((_TILE_M, c), bf16, transforms=_transforms(c, bf16)),
        plgpu.SMEM((bs, c), bf16, transforms=_transforms(c, bf16)),
        plgpu.SMEM((bs, c), bf16, transforms=_transforms(c, bf16)),
        plgpu.SMEM((_TILE_M, bs), bf16, transforms=_transforms(bs, bf16)),
        plgpu.SMEM((_TILE_M, c), jnp.float32),
        plgpu.Barrier(num_barriers=1),
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "interpret"))
def decode_attention_mgpu(
    q_BHC, k_BSKC, v_BSKC, valid_BS, *, k_scale=None, v_scale=None, sm_scale,
    blocks: DecodeBlocks = DEFAULT_BLOCKS, interpret=False,
):  # fmt: skip
    """Mosaic GPU decode attention; same contract as ``decode_attention_reference``."""
    b, h, c = q_BHC.shape
    _, s, n_kv, _ = k_BSKC.shape
    group = h // n_kv
    if c % 64 or group > _TILE_M or blocks.block_s % 64:
        raise ValueError(
            f"decode_attention_mgpu: needs head dim % 64 == 0 (got {c}), group <= 64 (got "
            f"{group}) and block_s % 64 == 0 (got {blocks.block_s})"
        )
    kmul, vmul, bias = _slot_multipliers(q_BHC, k_BSKC, valid_BS, k_scale, v_scale, sm_scale)
    bs = blocks.block_s
    s_pad = -s % bs
    k_BSKC, v_BSKC = pad_slots(k_BSKC, s_pad), pad_slots(v_BSKC, s_pad)
    kmul, vmul = (jnp.pad(x, ((0, 0), (0, 0), (0, s_pad)), constant_values=1) for x in (kmul, vmul))
    bias = pad_slots(bias, s_pad, value=-jnp.inf)
    q_BKMC = q_BHC.astype(jnp.bfloat16).reshape(b, n_kv, group, c)
    q_BKMC = jnp.pad(q_BKMC, ((0, 0), (0, 0), (0, _TILE_M - group), (0, 0)))
    out = plgpu.kernel(
        functools.partial(_body, bs=bs, n_tiles=(s + s_pad) // bs),
        out_type=jax.ShapeDtypeStruct((b, n_kv, _TILE_M, c), jnp.float32),
        grid=(n_kv, b),
        grid_names=("kv", "row"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q_BKMC, k_BSKC, v_BSKC, kmul, vmul, bias)
    return out[:, :, :group].reshape(b, h, c).astype(q_BHC.dtype)
