"""Blockwise FP8 W8A8 matmul for TPU with Pallas Mosaic TPU.

Grid (m, n, k) over output tiles [block_m, block_n] and K tiles of ``block_k`` (a multiple of the
128 scale group). FP8 tiles travel HBM -> VMEM as one byte per value (halving weight traffic vs
BF16), are upcast in VMEM to ``compute_dtype`` (BF16 holds every E4M3 and E5M2 value exactly, so
the upcast is lossless) and multiplied per 128-wide K group with f32 accumulation; each group's
partial product is promoted into an f32 VMEM accumulator with its scales:
``acc += (x̂_g @ ŵ_g) * s_x[:, g] * s_w[g, j]``.

Operand layout prepared by ``fp8_matmul_tpu``:
  * ``s_x``: [K/block_k, M_pad, block_k/128] f32 (blocks ``(None, block_m, G)``: the minor dim is
    the full extent, which Mosaic accepts for any size);
  * ``s_w``: [K/128, N/128] f32, one [G, 1] block per grid step in SMEM (scalar reads; with
    block_n == 128 one weight scale covers a whole tile per K group), so SMEM use does not grow
    with the weight size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.qarray import QArray

GROUP = 128  # K group of activation scales and K block of weight scales


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Tile configuration of the TPU kernel (a static argument)."""

    block_m: int = 256  # rows per tile (rounded down to the padded M for small M)
    block_n: int = 128  # must equal the weight N block: one weight scale per (K group, tile)
    block_k: int = 512  # K per grid step, a multiple of 128 (K % block_k == 0 is required)
    compute_dtype: str = "bfloat16"  # dtype FP8 tiles are upcast to for the MXU (lossless)


def _kernel(x_ref, sx_ref, w_ref, sw_ref, out_ref, acc_ref, *, n_groups: int, compute_dtype):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc = acc_ref[...]
    for g in range(n_groups):  # static unroll over the 128-wide scale groups of this K tile
        cols = slice(g * GROUP, (g + 1) * GROUP)
        x_g = x_ref[:, cols].astype(compute_dtype)
        w_g = w_ref[cols, :].astype(compute_dtype)
        part = jnp.dot(x_g, w_g, preferred_element_type=jnp.float32)
        acc = acc + part * (sx_ref[:, g : g + 1] * sw_ref[g, 0])
    acc_ref[...] = acc

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _tiles(m: int, k: int, n: int, cfg: TpuConfig) -> tuple[int, int]:
    """(block_m, block_k) for this problem, with clear errors for shapes the kernel cannot take."""
    if cfg.block_n != GROUP:
        raise ValueError(f"fp8_matmul_tpu: block_n must be {GROUP} (one weight scale per tile)")
    if k % GROUP or n % cfg.block_n:
        raise ValueError(f"fp8_matmul_tpu: K={k} and N={n} must be multiples of {GROUP}")
    if cfg.block_k % GROUP or cfg.block_k <= 0:
        raise ValueError(f"fp8_matmul_tpu: block_k={cfg.block_k} must be a multiple of {GROUP}")
    block_k = cfg.block_k if k % cfg.block_k == 0 else GROUP
    # 8-bit tiles need rows in multiples of 32 on TPU; small M (decode) gets a single short tile.
    block_m = min(cfg.block_m, pl.cdiv(m, 32) * 32)
    if block_m % 32:
        raise ValueError(f"fp8_matmul_tpu: block_m={cfg.block_m} must be a multiple of 32")
    return block_m, block_k


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def fp8_matmul_tpu(
    x_q: QArray,
    w_q: QArray,
    *,
    out_dtype=jnp.bfloat16,
    interpret: bool | pltpu.InterpretParams = False,
    config: TpuConfig | None = None,
) -> jax.Array:
    """``y = Σ_g s_x[:, g] s_w[g, :] (x̂[:, g] @ ŵ[g, :])`` with an f32 VMEM accumulator.

    ``x_q``: QArray [M, K] with (128,) groups; ``w_q``: QArray [K, N] with (128, 128) blocks.
    Needs K % 128 == 0 and N % 128 == 0; M is padded to the row tile here.
    """
    cfg = config or TpuConfig()
    if tuple(w_q.block_shape) != (GROUP, GROUP) or tuple(x_q.block_shape) != (GROUP,):
        raise ValueError(
            f"fp8_matmul_tpu: needs ({GROUP},) activation groups and ({GROUP}, {GROUP}) weight "
            f"blocks, got {x_q.block_shape} and {w_q.block_shape}"
        )
    (m, k), n = x_q.shape, w_q.shape[1]
    block_m, block_k = _tiles(m, k, n, cfg)
    m_pad = pl.cdiv(m, block_m) * block_m
    n_groups = block_k // GROUP
    x = jnp.pad(x_q.values, ((0, m_pad - m), (0, 0)))
    # [M, K/128] -> [K/block_k, M_pad, G]: one (block_m, G) scale tile per grid step.
    sx = jnp.pad(x_q.scales, ((0, m_pad - m), (0, 0)))
    sx = sx.reshape(m_pad, k // block_k, n_groups).transpose(1, 0, 2)
    grid = (m_pad // block_m, n // cfg.block_n, k // block_k)
    y = pl.pallas_call(
        functools.partial(_kernel, n_groups=n_groups, compute_dtype=jnp.dtype(cfg.compute_dtype)),
        grid=grid,
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((None, block_m, n_groups), lambda i, j, kk: (kk, i, 0)),
            pl.BlockSpec((block_k, cfg.block_n), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((n_groups, 1), lambda i, j, kk: (kk, j), memory_space=pltpu.SMEM),
        ],
        out_specs=pl.BlockSpec((block_m, cfg.block_n), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), jnp.dtype(out_dtype)),
        scratch_shapes=[pltpu.VMEM((block_m, cfg.block_n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(x, sx, w_q.values, w_q.scales)
    return y[:m]
