"""The XLA implementation of ``grouped_fp8_matmul``: row tiles as a batch dimension.

``jax.lax.ragged_dot`` on XLA:GPU expands into E zero-padded dense dots (E times the FLOPs,
openxla/xla#45996). Here the sorted rows are cut into the tiles of ``tiles.py`` (at most
``cdiv(M, tm) + min(E, M) - 1``), each tile's x rows and its expert's weight are gathered, and
one batched dot over the tiles runs: ``~(M + E·tm)·N·K`` multiply-adds instead of ``E·M·N·K``,
at the price of gathering each live tile's weight (``T·N·K`` FP8 bytes; chunks of
``tiles_per_step`` tiles bound that memory). The per-tile product has three methods, as in
``fp8_matmul``'s XLA path:

  * ``f32``: both operands dequantized to f32 and multiplied at HIGHEST precision: the
    reference's numerics up to f32 summation order (the default off GPU);
  * ``kblock_fp8``: the FP8 ``dot_general`` with (tile, K block) as batch dimensions, f32 out,
    then ``Σ_kb p[kb] · s_x · s_w`` (an FP8 tensor-core GEMM; its f32 intermediate is
    ``tile_m/32`` times the gathered weight bytes, so GPU ``auto`` takes it for ``tm <= 32``);
  * ``dequant_bf16``: both operands dequantized to BF16 (one rounding, <= 2^-9 relative, per
    element), one batched BF16 GEMM with f32 accumulation (GPU ``auto`` for larger tiles).

``reference`` (``ragged_dot`` of the dequantized operands) is kept as a method for comparisons.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas.grouped_fp8_matmul.reference import grouped_fp8_matmul_reference, stacks
from kernels_pallas.grouped_fp8_matmul.tiles import gather_rows, make_tile_map, num_tiles
from kernels_pallas.qarray import QArray, expand_scales

METHODS = ("auto", "reference", "f32", "kblock_fp8", "dequant_bf16")
_STEP_BYTES = 512 * 2**20  # auto tiles_per_step: gathered weights per step (in the method's dtype)


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """How the XLA implementation computes the product (a static argument)."""

    method: str = "auto"  # one of METHODS; auto: f32 off GPU, by tile_m on GPU (module doc)
    tile_m: int | None = None  # rows per tile; None: pow2 near M / E, clipped to [8, 256]
    tiles_per_step: int | None = None  # tiles per batched dot; None: ~512 MiB of weights a step
    kblock_max_tile_m: int = 32  # auto on GPU: kblock_fp8 for tile_m <= this, dequant_bf16 above

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"XlaConfig.method must be one of {METHODS}, got {self.method!r}")
        if self.tile_m is not None and self.tile_m < 1:
            raise ValueError(f"XlaConfig.tile_m must be >= 1, got {self.tile_m}")


def default_tile_m(m: int, num_groups: int) -> int:
    """A power of two near the mean group size ``M / E``, in [8, 256]: fewer tiles (less weight
    gathered) against fewer wasted rows per tile."""
    mean = max(m // max(num_groups, 1), 1)
    return min(max(1 << (mean.bit_length() - 1), 8), 256)


def choose_method(tile_m: int, cfg: XlaConfig, platform: str) -> str:
    """The method ``cfg`` resolves to for tiles of ``tile_m`` rows on ``platform``."""
    if cfg.method != "auto":
        return cfg.method
    if platform != "gpu":
        return "f32"
    return "kblock_fp8" if tile_m <= cfg.kblock_max_tile_m else "dequant_bf16"


def _tile_product_f32(x_q: QArray, w_q: QArray, precision) -> jax.Array:
    """[C, tm, K] x [C, N, K] -> [C, tm, N] f32, operands dequantized to ``precision``'s dtype."""
    dt = jnp.float32 if precision == jax.lax.Precision.HIGHEST else jnp.bfloat16
    x = x_q.values.astype(jnp.float32) * expand_scales(x_q.scales, x_q.shape, x_q.block_shape)
    w = w_q.values.astype(jnp.float32) * expand_scales(w_q.scales, w_q.shape, w_q.block_shape)
    return jax.lax.dot_general(
        x.astype(dt), w.astype(dt), (((2,), (2,)), ((0,), (0,))),
        precision=precision, preferred_element_type=jnp.float32,
    )  # fmt: skip


def _tile_product_kblock(x_q: QArray, w_q: QArray) -> jax.Array:
    """``Σ_kb s_x ⊙ s_w ⊙ (x̂_kb · ŵ_kbᵀ)`` per tile: FP8 dots batched over (tile, K block)."""
    (c, tm, k), n = x_q.shape, w_q.shape[1]
    bk = w_q.block_shape[1]
    kb = -(-k // bk)
    pad = [(0, 0), (0, 0), (0, kb * bk - k)]
    xb = jnp.pad(x_q.values, pad).reshape(c, tm, kb, bk)
    wb = jnp.pad(w_q.values, pad).reshape(c, n, kb, bk)
    p = jax.lax.dot_general(
        xb, wb, (((3,), (3,)), ((0, 2), (0, 2))), preferred_element_type=jnp.float32
    )  # [C, KB, tm, N]
    sw = expand_scales(w_q.scales, (c, n, kb), (w_q.block_shape[0], 1))  # [C, N, KB]
    hi = jax.lax.Precision.HIGHEST
    return jnp.einsum("cbmn,cmb,cnb->cmn", p, x_q.scales, sw, precision=hi)


def _tile_product(x_q: QArray, w_q: QArray, method: str) -> jax.Array:
    if method == "kblock_fp8":
        return _tile_product_kblock(x_q, w_q)
    hi = jax.lax.Precision.HIGHEST if method == "f32" else jax.lax.Precision.DEFAULT
    return _tile_product_f32(x_q, w_q, hi)


def _step_tiles(t: int, n: int, k: int, method: str, cfg: XlaConfig) -> int:
    """Tiles per batched dot: ``tiles_per_step``, or as many as ~512 MiB of gathered weights."""
    if cfg.tiles_per_step is not None:
        return max(min(cfg.tiles_per_step, t), 1)
    per_tile = n * k * {"f32": 4, "dequant_bf16": 2}.get(method, 1)
    return max(min(_STEP_BYTES // per_tile, t), 1)


def _gathered_weights(ws: tuple[QArray, ...], g: jax.Array) -> tuple[QArray, ...]:
    """Each tile's expert weight ``[C, N, K]``; stacks whose N blocks are whole join into one."""
    parts = [QArray(w.values[g], w.scales[g], w.block_shape, w.dtype) for w in ws]
    if len(parts) == 1 or any(w.shape[1] % w.block_shape[0] for w in ws[:-1]):
        return tuple(parts)
    cat = lambda leaves: jnp.concatenate(leaves, axis=1)
    w0 = parts[0]
    joined = QArray(cat([p.values for p in parts]), cat([p.scales for p in parts]),
                    w0.block_shape, w0.dtype)  # fmt: skip
    return (joined,)


def _tiled(x_q: QArray, w_q, group_sizes_E, *, method: str, cfg: XlaConfig, out_dtype):
    ws = stacks(w_q)
    (m, k), e, n = x_q.shape, ws[0].shape[0], sum(w.shape[1] for w in ws)
    tm = cfg.tile_m or default_tile_m(m, e)
    tiles = make_tile_map(group_sizes_E, m, tm)
    t = num_tiles(m, e, tm)
    c = _step_tiles(t, n, k, method, cfg)
    steps = -(-t // c)
    m_pad = -(-m // tm) * tm
    xv = jnp.pad(x_q.values, ((0, m_pad - m), (0, 0))).reshape(m_pad // tm, tm, k)
    xs = jnp.pad(x_q.scales, ((0, m_pad - m), (0, 0))).reshape(m_pad // tm, tm, -1)
    # Pad the tile list to whole steps with copies of the last tile (their rows are never read).
    pad = lambda a: jnp.concatenate([a, jnp.broadcast_to(a[-1:], (steps * c - t,))])
    group, block = pad(tiles.group_T).reshape(steps, c), pad(tiles.block_T).reshape(steps, c)

    def step(gb):
        g, b = gb
        xt = QArray(xv[b], xs[b], x_q.block_shape, x_q.dtype)
        outs = [_tile_product(xt, wt, method) for wt in _gathered_weights(ws, g)]
        return jnp.concatenate(outs, axis=-1).astype(out_dtype)

    # One step: no loop in the program. Several: [steps, C, tm, N], one batched dot each.
    one = steps == 1
    out = step((group[0], block[0])) if one else jax.lax.map(step, (group, block))
    return gather_rows(out.reshape(steps * c * tm, n), tiles, out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "platform"))
def grouped_fp8_matmul_xla(
    x_q: QArray, w_q, group_sizes_E, *, out_dtype=jnp.bfloat16, config=None,
    platform: str = "cpu",
) -> jax.Array:  # fmt: skip
    """``grouped_fp8_matmul`` in plain XLA ops: x [M, K], w [E, N, K] or a tuple of stacks
    (see the module doc)."""
    cfg = config or XlaConfig()
    tm = cfg.tile_m or default_tile_m(x_q.shape[0], stacks(w_q)[0].shape[0])
    method = choose_method(tm, cfg, platform)
    if method == "reference":
        return grouped_fp8_matmul_reference(x_q, w_q, group_sizes_E, out_dtype=out_dtype)
    return _tiled(x_q, w_q, group_sizes_E, method=method, cfg=cfg, out_dtype=out_dtype)
