"""The Hopper decode kernels' static parameters and SMEM tile transforms (shared by the dense and
paged kernels, unswapped and swap-AB)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
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
    hw: bool  # the hardware path (P in registers); False in interpret mode


def transforms(minor: int, dtype):
    """SMEM tiling and swizzle of a tile whose minor dimension is ``minor`` elements of ``dtype``
    (what TMA writes and wgmma reads)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
