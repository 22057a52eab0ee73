"""Blockwise FP8 W8A8 matmul for TPU with Pallas Mosaic TPU.

Grid (m, n, k) over output tiles [block_m, block_n] and K tiles of ``block_k`` (a multiple of the
128 scale group). FP8 tiles travel HBM -> VMEM as one byte per value (halving weight traffic vs
BF16), are upcast in VMEM to ``compute_dtype`` (BF16 holds every E4M3 and E5M2 value exactly, so
the upcast is lossless) and multiplied per 128-wide K group with f32 accumulation; each group's
partial product is promoted into an f32 VMEM accumulator with its scales:
``acc += (x̂_g · ŵ_gᵀ) * s_x[:, g] * s_w[j, g]``. The weight is ``[N, K]`` (the QArray weight
convention), so both operands contract on their lane (last) axis: ``dot_general`` (((1,), (1,))).

Operand layout prepared by ``fp8_matmul_tpu``, chosen for the TPU block rule (the last two block
dims divisible by (8, 128) or equal to the array's; kernels_wave2 §0 #4):
  * ``s_x``: [K/block_k, M_pad, block_k/128] f32, blocks ``(None, block_m, G)`` in VMEM (the
    minor dim is the full extent);
  * ``s_w``: [N/128, 1, K/128] f32 (a free reshape of the QArray's scales), blocks
    ``(None, 1, K/128)`` in SMEM: the tile's whole row of block scales, read as scalars. The block
    index only changes with the N tile, so it is fetched once per tile and SMEM use is
    ``4 K/128`` bytes whatever the weight size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.qarray import QArray

GROUP = 128  # K group of activation scales, and both block dims of weight scales
VMEM_BYTES = 12 * 2**20  # tile budget, under the 16 MiB default scoped VMEM limit of v5e


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Tile configuration of the TPU kernel (a static argument)."""

    block_m: int = 256  # rows per tile, a multiple of 32 (rounded down to the padded M)
    block_n: int = 128  # must equal the weight N block: one weight scale per (K group, tile)
    block_k: int = 512  # K per grid step, a multiple of 128 (128 is used when K % block_k)
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
        w_g = w_ref[:, cols].astype(compute_dtype)
        part = jax.lax.dot_general(
            x_g, w_g, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        acc = acc + part * (sx_ref[:, g : g + 1] * sw_ref[0, k * n_groups + g])
    acc_ref[...] = acc

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tiles(m: int, k: int, n: int, cfg: TpuConfig) -> tuple[int, int] | str:
    """(block_m, block_k) for this problem, or why the kernel cannot take it."""
    if cfg.block_n != GROUP:
        return f"block_n must be {GROUP} (one weight scale per tile), got {cfg.block_n}"
    if cfg.block_m % 32 or cfg.block_m <= 0:
        return f"block_m={cfg.block_m} must be a positive multiple of 32 (8-bit sublane tiles)"
    if cfg.block_k % GROUP or cfg.block_k <= 0:
        return f"block_k={cfg.block_k} must be a positive multiple of {GROUP}"
    if cfg.compute_dtype not in ("bfloat16", "float32"):
        return f"compute_dtype must be bfloat16 or float32, got {cfg.compute_dtype!r}"
    if k % GROUP or k == 0:
        return f"K={k} must be a positive multiple of {GROUP}"
    if n % cfg.block_n:
        return f"N={n} must be a multiple of {cfg.block_n}"
    if m < 1:
        return "M must be >= 1"
    block_k = cfg.block_k if k % cfg.block_k == 0 else GROUP
    # 8-bit tiles need rows in multiples of 32 on TPU; small M (decode) gets a single short tile.
    block_m = min(cfg.block_m, pl.cdiv(m, 32) * 32)
    if (used := vmem_bytes(block_m, cfg.block_n, block_k)) > VMEM_BYTES:
        return f"tiles need ~{used} B of VMEM > {VMEM_BYTES} B (smaller block_m or block_k)"
    return block_m, block_k


def vmem_bytes(block_m: int, block_n: int, block_k: int) -> int:
    """VMEM of one grid step, generously: double-buffered x, w, s_x (lanes padded to 128) and
    f32-sized output blocks, plus the f32 accumulator."""
    ins = block_m * block_k + block_n * block_k + block_m * 128 * 4
    return 2 * ins + 2 * block_m * block_n * 4 + block_m * block_n * 4


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def fp8_matmul_tpu(
    x_q: QArray,
    w_q: QArray,
    *,
    out_dtype=jnp.bfloat16,
    interpret: bool | pltpu.InterpretParams = False,
    config: TpuConfig | None = None,
) -> jax.Array:
    """``y = Σ_g s_x[:, g] s_w[:, g] (x̂[:, g] · ŵ[:, g]ᵀ)`` with an f32 VMEM accumulator.

    ``x_q``: QArray [M, K] with (128,) groups; ``w_q``: QArray [N, K] with (128, 128) blocks.
    Needs K % 128 == 0 and N % 128 == 0; M is padded to the row tile here.
    """
    cfg = config or TpuConfig()
    if tuple(w_q.block_shape) != (GROUP, GROUP) or tuple(x_q.block_shape) != (GROUP,):
        raise ValueError(
            f"fp8_matmul_tpu: needs ({GROUP},) activation groups and ({GROUP}, {GROUP}) weight "
            f"blocks, got {x_q.block_shape} and {w_q.block_shape}"
        )
    (m, k), n = x_q.shape, w_q.shape[0]
    t = tiles(m, k, n, cfg)
    if isinstance(t, str):
        raise ValueError(f"fp8_matmul_tpu: {t}")
    block_m, block_k = t
    m_pad = pl.cdiv(m, block_m) * block_m
    n_groups = block_k // GROUP
    x = jnp.pad(x_q.values, ((0, m_pad - m), (0, 0)))
    # [M, K/128] -> [K/block_k, M_pad, G]: one (block_m, G) scale tile per grid step.
    sx = jnp.pad(x_q.scales, ((0, m_pad - m), (0, 0)))
    sx = sx.reshape(m_pad, k // block_k, n_groups).transpose(1, 0, 2)
    sw = w_q.scales.reshape(n // GROUP, 1, k // GROUP)
    grid = (m_pad // block_m, n // cfg.block_n, k // block_k)
    y = pl.pallas_call(
        functools.partial(_kernel, n_groups=n_groups, compute_dtype=jnp.dtype(cfg.compute_dtype)),
        grid=grid,
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((None, block_m, n_groups), lambda i, j, kk: (kk, i, 0)),
            pl.BlockSpec((cfg.block_n, block_k), lambda i, j, kk: (j, kk)),
            pl.BlockSpec(
                (None, 1, k // GROUP), lambda i, j, kk: (j, 0, 0), memory_space=pltpu.SMEM
            ),
        ],
        out_specs=pl.BlockSpec((block_m, cfg.block_n), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), jnp.dtype(out_dtype)),
        scratch_shapes=[pltpu.VMEM((block_m, cfg.block_n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(x, sx, w_q.values, sw)
    return y[:m]
