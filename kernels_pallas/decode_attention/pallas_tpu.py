"""Decode attention on TPU (Mosaic TPU): tiles over cache slots with an online softmax.

Grid ``(B, S / block_s)``; one program sees all KV heads of one row's slot tile (the trailing
``[K, C]`` block dims are full, as Mosaic TPU requires) and loops over KV heads, handling each
head's query group as one ``[group, C] x [C, block_s]`` matmul. FP8 K/V tiles are upcast in the
kernel; static scales are folded into q and the output, dynamic (per slot) scales multiply the
scores and the probabilities. Not yet run on TPU hardware; tested in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.decode_attention.common import (
    DEFAULT_BLOCKS,
    DecodeBlocks,
    fold_static_scales,
    pad_slots,
)


def _kernel(q_ref, k_ref, v_ref, valid_ref, *rest, n_kv, group, sm_scale, slot_scales):
    if slot_scales:
        ks_ref, vs_ref, o_ref, m_sc, l_sc, acc_sc = rest
    else:
        o_ref, m_sc, l_sc, acc_sc = rest
    s_idx = pl.program_id(1)

    @pl.when(s_idx == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    valid_1S = valid_ref[...] != 0
    for kh in range(n_kv):
        rows = pl.ds(kh * group, group)
        q_GC = q_ref[0, rows, :]
        k_SC = k_ref[0, :, kh, :].astype(jnp.float32)
        s_GS = lax.dot_general(q_GC, k_SC, (((1,), (1,)), ((), ())), precision="highest")
        s_GS = s_GS * sm_scale
        if slot_scales:
            s_GS = s_GS * ks_ref[0, :, kh][None, :]
        s_GS = jnp.where(valid_1S, s_GS, -jnp.inf)
        m_prev = m_sc[rows, :]
        m_new = jnp.maximum(m_prev, jnp.max(s_GS, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all slots so far masked
        alpha = jnp.exp(m_prev - m_safe)
        p_GS = jnp.exp(s_GS - m_safe)
        l_sc[rows, :] = alpha * l_sc[rows, :] + jnp.sum(p_GS, axis=1, keepdims=True)
        if slot_scales:
            p_GS = p_GS * vs_ref[0, :, kh][None, :]
        v_SC = v_ref[0, :, kh, :].astype(jnp.float32)
        pv_GC = jnp.dot(p_GS, v_SC, precision="highest")
        acc_sc[rows, :] = alpha * acc_sc[rows, :] + pv_GC
        m_sc[rows, :] = m_new

    @pl.when(s_idx == pl.num_programs(1) - 1)
    def _finish():
        l = l_sc[...]
        o_ref[0] = (acc_sc[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "interpret"))
def decode_attention_tpu(
    q_BHC, k_BSKC, v_BSKC, valid_BS, *, k_scale=None, v_scale=None, sm_scale,
    blocks: DecodeBlocks = DEFAULT_BLOCKS, interpret=False,
):  # fmt: skip
    """Mosaic TPU decode attention; same contract as ``decode_attention_reference``."""
    b, h, c = q_BHC.shape
    _, s, n_kv, _ = k_BSKC.shape
    q, k_slot, v_slot, out_scale = fold_static_scales(q_BHC, k_scale, v_scale, n_kv)
    bs = min(blocks.block_s, s)
    s_pad = -s % bs
    k_BSKC, v_BSKC = pad_slots(k_BSKC, s_pad), pad_slots(v_BSKC, s_pad)
    valid = pad_slots(valid_BS.astype(jnp.int32), s_pad)
    slot_scales = k_slot is not None or v_slot is not None
    inputs = [q, k_BSKC, v_BSKC, valid]
    kv_spec = pl.BlockSpec((1, bs, n_kv, c), lambda i, j: (i, j, 0, 0))
    in_specs = [
        pl.BlockSpec((1, h, c), lambda i, j: (i, 0, 0)),
        kv_spec,
        kv_spec,
        pl.BlockSpec((1, bs), lambda i, j: (i, j)),
    ]
    if slot_scales:
        ones = jnp.ones(k_BSKC.shape[:3], jnp.float32)
        for sc in (k_slot, v_slot):
            inputs.append(ones if sc is None else pad_slots(sc.astype(jnp.float32), s_pad))
            in_specs.append(pl.BlockSpec((1, bs, n_kv), lambda i, j: (i, j, 0)))
    kernel = functools.partial(
        _kernel, n_kv=n_kv, group=h // n_kv, sm_scale=sm_scale, slot_scales=slot_scales
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, h, c), jnp.float32),
        grid=(b, (s + s_pad) // bs),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, h, c), lambda i, j: (i, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((h, 1), jnp.float32),
            pltpu.VMEM((h, 1), jnp.float32),
            pltpu.VMEM((h, c), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(*inputs)
    if out_scale is not None:
        out = out * out_scale
    return out.astype(q_BHC.dtype)
