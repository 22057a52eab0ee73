"""The Hopper decode kernels' static parameters and SMEM tile transforms (shared by the dense and
paged kernels, unswapped and swap-AB)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


@dataclasses.dataclass(frozen=True)
class Static:
    """What a decode kernel's trace is specialised on (one compile per value)."""

    bs: int  # block_s
    group: int
    splits: int
    stages: int
    mma_dtype: jnp.dtype
    fp8: bool  # K/V tiles need the FP8 -> f16 upcast
    dynamic: bool  # per-slot scales [B, K, S]
    score_scale: float  # sm_scale · log2(e): scores in base 2
    hw: bool  # the hardware path (register wgmma operands: P, or swapped FP8 K); False: interpret


def transforms(minor: int, dtype):
    """SMEM tiling and swizzle of a tile whose minor dimension is ``minor`` elements of ``dtype``
    (what TMA writes and wgmma reads)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def write_chunk(acc, m_i, l_i, *, l_dim: int, o_dst, lse_dst=None, o_part=lambda r: r) -> None:
    """A chunk's ``acc / l`` (``l`` along ``acc``'s dimension ``l_dim``) and, with ``lse_dst``,
    ``lse = m + log2 l`` -> GMEM through SMEM: ``o_part`` of the SMEM tile to ``o_dst``."""
    l_safe = jnp.where(l_i > 0, l_i, 1.0)  # an empty chunk: acc = 0, l = 0 -> o = 0

    def body(o_smem, lse_smem):
        o_smem[...] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [l_dim])
        if lse_smem is not None:
            lse_smem[...] = m_i + jnp.log2(l_i)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_part(o_smem), o_dst)
        if lse_smem is not None:
            plgpu.copy_smem_to_gmem(lse_smem, lse_dst)
        plgpu.wait_smem_to_gmem(0)

    lse_type = None if lse_dst is None else plgpu.SMEM(l_i.shape, jnp.float32)
    pl.run_scoped(body, plgpu.SMEM(acc.shape, jnp.float32), lse_type)


def dense_sources(st: Static, k_gmem, v_gmem, scale_gmems, row, kh, t_lo, c: int):
    """Block specs and sources of the TMA pipeline over one dense cache row and KV head: K and V
    tiles of ``block_s`` slots from tile ``t_lo`` on, and the dynamic scales' [block_s] slices
    (``scale_gmems``: none, or the K and V scales [B, K, S])."""
    kv_spec = plgpu.BlockSpec(
        (st.bs, c), lambda i: (t_lo + i, 0), transforms=transforms(c, k_gmem.dtype)
    )
    specs, srcs = [kv_spec, kv_spec], [k_gmem.at[row, :, kh], v_gmem.at[row, :, kh]]
    for sc in scale_gmems:
        specs.append(plgpu.BlockSpec((st.bs,), lambda i: (t_lo + i,)))
        srcs.append(sc.at[row, kh])
    return specs, srcs
