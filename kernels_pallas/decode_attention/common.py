"""Shared pieces of the decode-attention kernels: block sizes, live tile ranges, split combine.

Every kernel reads, for row ``b``, only the cache tiles that overlap the row's live slots
``[starts_B[b], lengths_B[b])`` (tiles of ``block_s`` slots). With ``num_splits = J > 1`` the live
tiles of a row are cut into J contiguous chunks (flash-decoding): each chunk yields a normalized
partial output and its log-sum-exp, and ``combine_splits`` merges them. The chunk bounds are
computed here once (``split_ranges``) and handed to the kernels as int32 arrays, so a kernel's
inner loop is "for i in range(count): tile lo + i" -- the place where a page table lookup
(tile -> page) goes for a paged cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.qarray import QArray
from kernels_pallas.quantize import quantize_activations

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """Static tiling of a decode kernel; ``None`` fields take the per-shape default."""

    block_s: int | None = None  # cache slots per tile of the online softmax
    num_splits: int | None = None  # chunks of the sequence axis per row (flash-decoding)
    num_stages: int | None = None  # Mosaic GPU: K/V tiles in flight (TPU: unused)
    # Mosaic GPU: swap-AB, the KV tile as the wgmma M side and the query group as its N (None:
    # on); False: the query group padded to a 64-row M tile (TPU: unused)
    swap_ab: bool | None = None

    def __post_init__(self):
        for name in ("block_s", "num_splits", "num_stages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"DecodeBlocks.{name} must be a positive int or None, got {v!r}")
        check_swap_ab("DecodeBlocks", self.swap_ab)


def swap_ab_on(config) -> bool:
    """Whether a Hopper kernel config (``DecodeBlocks``, ``PagedBlocks`` or None) runs swap-AB:
    the default, unless ``swap_ab=False``."""
    return config is None or config.swap_ab is not False


def check_swap_ab(owner: str, v) -> None:
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"{owner}.swap_ab must be a bool or None, got {v!r}")


def cdiv(a, b):
    return -(-a // b)


def resolve_splits(num_splits: int | None, parallel: int, units: int, num_tiles: int) -> int:
    """``num_splits`` or, when None, as many chunks as keep ``parallel`` x chunks within
    ``units`` (e.g. 2 CTAs per SM: one wave), at least 4 tiles per chunk of a full row."""
    if num_splits is None:
        num_splits = min(units // parallel, num_tiles // 4)
    return max(1, min(num_splits, num_tiles))


def split_ranges(starts_B, lengths_B, *, block_s: int, num_splits: int, num_tiles: int):
    """(lo_BJ, count_BJ) int32: chunk j of row b covers tiles ``lo .. lo + count - 1``.

    The live tiles of row b are ``start // bs .. cdiv(length, bs) - 1`` (none when the row is
    empty); chunk j takes ``per = cdiv(n, J)`` of them. An empty chunk (``count == 0``, skipped
    by the kernels) names the row's last live tile, the block the TPU pipeline already holds, so
    it costs no DMA; an empty row names its start tile (clamped into the allocation).
    """
    s = num_tiles * block_s
    start = jnp.clip(starts_B.astype(jnp.int32), 0, s)
    length = jnp.clip(lengths_B.astype(jnp.int32), 0, s)
    t0 = start // block_s
    n = jnp.where(length > start, cdiv(length, block_s) - t0, 0)
    per = cdiv(n, num_splits)
    j = jnp.arange(num_splits, dtype=jnp.int32)[None, :]
    lo_BJ = t0[:, None] + j * per[:, None]
    count_BJ = jnp.clip(t0[:, None] + n[:, None] - lo_BJ, 0, per[:, None])
    last_B1 = (t0 + jnp.maximum(n - 1, 0))[:, None]
    lo_BJ = jnp.minimum(jnp.where(count_BJ > 0, lo_BJ, last_B1), num_tiles - 1)
    return lo_BJ.astype(jnp.int32), count_BJ.astype(jnp.int32)


def default_starts(starts_B, lengths_B):
    """``starts_B`` as int32, zeros when None."""
    if starts_B is None:
        return jnp.zeros_like(lengths_B, dtype=jnp.int32)
    return starts_B.astype(jnp.int32)


def combine_splits(o_BJHC: jax.Array, lse_BJH: jax.Array) -> jax.Array:
    """Merges chunk outputs: ``o = Σ_j 2^(lse_j - M) o_j / Σ_j 2^(lse_j - M)`` (lse in log2 units).

    ``o_j`` is chunk j's normalized output, ``lse_j = log2 Σ_{s in chunk} 2^(score_s)`` (``-inf``
    for an empty chunk), ``M = max_j lse_j``. A row whose chunks are all empty gives zeros.
    """
    m_BH = jnp.max(lse_BJH, axis=1)
    m_BH = jnp.where(jnp.isfinite(m_BH), m_BH, 0.0)
    w_BJH = jnp.exp2(lse_BJH - m_BH[:, None])
    den_BH = jnp.sum(w_BJH, axis=1)
    o_BHC = jnp.einsum("bjh,bjhc->bhc", w_BJH, o_BJHC, precision="highest")
    return o_BHC / jnp.where(den_BH > 0, den_BH, 1.0)[..., None]


def quantize_output(o_BHC: jax.Array, quant_out) -> jax.Array | QArray:
    """The output as the o_proj GEMM reads it: ``o`` itself (``quant_out`` None) or a QArray
    ``[B, H·C]`` quantized per token in 1x128 groups to ``quant_out`` (an FP8 dtype)."""
    if quant_out is None:
        return o_BHC
    return quantize_activations(o_BHC.reshape(o_BHC.shape[0], -1), 128, quant_out)


def is_slot_scale(scale) -> bool:
    """True for a dynamic scale (one per cached vector, [B, K, S])."""
    return scale is not None and jnp.ndim(scale) == 3


def per_kv_head(scale, n_kv: int) -> jax.Array:
    """A static scale ([] or [K]) as f32 [K]."""
    return jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (n_kv,))
