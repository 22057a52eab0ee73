"""Grouped blockwise FP8 W8A8 matmul for TPU with Pallas Mosaic TPU (megablox-style tiling).

Grid ``(tile, n, k)`` over the tile map of ``tiles.py`` (megablox ``gmm``'s ``group_ids`` /
``m_tile_ids``), the N tiles and the K tiles; the (group, row block, live) triples arrive by
scalar prefetch, so the index maps pick the row block of ``x`` and the expert of ``w``. The math
per grid step is the dense TPU kernel's (``fp8_matmul/pallas_tpu.py``): one MXU product per
128-wide K group (FP8 straight into the MXU on v6e+, upcast in VMEM to BF16 elsewhere: lossless)
promoted into an f32 accumulator per 128-column weight-scale block,
``acc[:, c] += (x̂_g · ŵ_{c,g}ᵀ) * s_x[:, g] * s_w[e, c, g]``; or, for row tiles of >= 256 on
v6e (``dequant_bf16``, the dense kernel's), both operands dequantized to BF16 in VMEM and one
``block_k``-deep dot per step. Each tile writes its own output tile
(``[T·tm, N]``); the wrapper gathers rows from their group's tile.

Dead tiles (past the live ones) skip the math and clamp their block indices to the last grid
step of the last live tile, so no DMA is issued for them (Pallas fetches a block only when its
index changes between consecutive steps). Several weight stacks (gate and up) run in one call:
the N tiles run over their concatenation, each stack is its own operand, and outside its N
tiles a stack's block index stays put (no DMA) while the kernel accumulates from the active one.

By default (``plan``) each weight stack is one (N, K) block: consecutive tiles of an expert keep
its block index, so its weights cross HBM once, not once per row tile (``weight_reuse``).

Layouts as in the dense kernel: ``s_x`` as ``[K/block_k, M_pad, block_k/128]`` in VMEM, ``s_w``
as ``[E, N/block_n, 1, (block_n/128)(K/128)]`` in SMEM (the N tile's block scales, read as
scalars), so ``block_n`` is any multiple of 128 dividing every stack's N (up to 1024).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.fp8_matmul.pallas_tpu import (
    COMPUTE_DTYPES,
    GROUP,
    MAX_GROUPS,
    PACK_DEQUANT,
    VMEM_BYTES,
    VMEM_LIMIT_BYTES,
    Plan,
    accumulate_tile,
    block_diagonal_pairs,
    compute_mode,
    largest_divisor,
    target_has_fp8_mxu,
    vmem_bytes,
)
from kernels_pallas.grouped_fp8_matmul.reference import stacks
from kernels_pallas.grouped_fp8_matmul.tiles import gather_rows, make_tile_map, num_tiles
from kernels_pallas.qarray import QArray


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Tile configuration of the TPU kernel (a static argument)."""

    block_m: int | None = None  # rows per tile, a multiple of 32; None: ``tile_m``
    block_n: int | None = None  # a multiple of 128 dividing every N; None: see ``plan``
    block_k: int | None = None  # K per grid step, a multiple of 128 (the largest one <= it
    # dividing K); None: see ``plan``
    # "native": FP8 straight into the MXU (v6e+); "bfloat16" / "float32": upcast in VMEM first
    # (lossless); None: native where the chip has an FP8 MXU, else bfloat16.
    compute_dtype: str | None = None
    # K groups per MXU dot (1 or 2, as the dense kernel's ``pack``); None: 2 for native FP8
    # tiles of <= 128 rows (decode), else 1.
    pack: int | None = None


# Default row tile: a power of two >= this many times the mean group size, in [32, 512]
TILE_PER_MEAN_GROUP = 4
# Row tile cap when every expert's weights stay in VMEM across its tiles (``plan``), on a chip
# without an FP8 MXU: the upcast MXU work binds there, and a wider tile multiplies more rows of
# other groups at each group boundary
REUSE_TILE_CAP_UPCAST = 128
REUSE_MAX_N = 2048  # the widest stack taken as one block (its f32 accumulator: bm x N x 4 B)


def tile_m(m: int, num_groups: int, cfg: TpuConfig, cap: int = 512) -> int:
    """Rows per tile: ``cfg.block_m``, else a power of two >= ``TILE_PER_MEAN_GROUP`` x the mean
    group size, in [32, ``cap``]. Every group boundary inside a row tile adds a tile, and every
    tile streams its expert's weights (unless they stay in VMEM: ``plan``), so tiles of a
    group's size stream most groups' weights twice; four times it (the performance model,
    ``tpu.grouped_fp8_matmul_predict``, at Qwen3-30B-A3B's experts: 16-32 rows per expert)
    streams them ~1.25 times, at MXU work the memory-bound tiles hide (v5e 1.12-1.38x faster at
    2,048-4,096 rows, v6e 1.13-1.34x)."""
    if cfg.block_m is not None:
        return cfg.block_m
    mean = max(-(-m // max(num_groups, 1)), 1)
    return min(max(1 << (TILE_PER_MEAN_GROUP * mean - 1).bit_length(), 32), cap)


def weight_reuse(p: Plan, k: int, ns: tuple[int, ...]) -> bool:
    """True if every stack's weight is one (N, K) block of the plan: consecutive tiles of one
    expert then keep its block index, and Pallas fetches nothing for them (the weights cross
    HBM once per expert, not once per row tile)."""
    return p.block_k == k and all(n == p.block_n for n in ns)


def plan(m: int, k: int, ns: tuple[int, ...], num_groups: int, cfg: TpuConfig | None, *,
         fp8_mxu: bool, interpret: bool = False) -> Plan | str:  # fmt: skip
    """The block shapes for this problem (``ns``: N of each weight stack), or why the kernel
    cannot take it. ``fp8_mxu``: the target's MXU takes FP8 (``compute_mode`` picks the default)."""
    cfg = cfg or TpuConfig()
    if cfg.block_k is not None and (cfg.block_k % GROUP or cfg.block_k <= 0):
        return f"block_k={cfg.block_k} must be a positive multiple of {GROUP}"
    if cfg.compute_dtype not in (None, *COMPUTE_DTYPES):
        return f"compute_dtype must be one of {COMPUTE_DTYPES}, got {cfg.compute_dtype!r}"
    if k % GROUP or k == 0:
        return f"K={k} must be a positive multiple of {GROUP}"
    if any(n % GROUP for n in ns):
        return f"N={'+'.join(map(str, ns))} must be multiples of {GROUP}"
    if m < 1:
        return "M must be >= 1"
    if cfg.block_n is not None and (cfg.block_n % GROUP or any(n % cfg.block_n for n in ns)):
        return f"block_n={cfg.block_n} must be a multiple of {GROUP} dividing every N"
    # Weight reuse (the default where it fits): each stack's whole (N, K) weight as one block,
    # so an expert's weights stay in VMEM across its consecutive row tiles (``weight_reuse``);
    # the performance model predicts 1.06-1.50x faster at Qwen3-30B-A3B's experts on v5e/v6e
    # (``tpu_table.grouped_rows``). Else N tiles of <= 1024 and K steps of ``block_k`` (1024).
    if cfg.block_n is None and cfg.block_k is None and len(set(ns)) == 1 and \
            ns[0] <= REUSE_MAX_N and k <= MAX_GROUPS * GROUP:  # fmt: skip
        cap = 512 if fp8_mxu else REUSE_TILE_CAP_UPCAST
        p = _plan(m, k, ns, num_groups, dataclasses.replace(cfg, block_n=ns[0], block_k=k),
                  fp8_mxu=fp8_mxu, interpret=interpret, cap=cap)  # fmt: skip
        if not isinstance(p, str):
            return p
    return _plan(m, k, ns, num_groups, cfg, fp8_mxu=fp8_mxu, interpret=interpret)


def _plan(m: int, k: int, ns: tuple[int, ...], num_groups: int, cfg: TpuConfig, *,
          fp8_mxu: bool, interpret: bool, cap: int = 512) -> Plan | str:  # fmt: skip
    bm = tile_m(m, num_groups, cfg, cap)
    if bm % 32 or bm <= 0:
        return f"block_m={bm} must be a positive multiple of 32 (8-bit sublane tiles)"
    bn = cfg.block_n or min(largest_divisor(n, 1024) for n in ns)
    while any(n % bn for n in ns):  # the largest common divisor of every stack's N
        bn -= GROUP
    block_k = largest_divisor(k, min(cfg.block_k or 1024, MAX_GROUPS * GROUP))
    compute = compute_mode(cfg.compute_dtype, fp8_mxu, bm)  # v6e prefill: dequant_bf16
    if compute == "dequant_bf16" and (cfg.pack or 1) != 1:
        return PACK_DEQUANT
    if compute == "native" and not (fp8_mxu or interpret):
        return "compute_dtype='native' needs a chip with an FP8 MXU (v6e or later)"
    few_rows = bm <= 2 * GROUP and block_k % (2 * GROUP) == 0
    pack = cfg.pack or (2 if compute == "native" and few_rows else 1)
    if pack not in (1, 2) or (pack == 2 and block_k % (2 * GROUP)):
        return f"pack={pack} must be 1, or 2 with block_k % 256 == 0"
    p = Plan(bm, bn, block_k, compute, pack)
    if (used := vmem_bytes(p)) > VMEM_BYTES:
        return f"tiles need ~{used} B of VMEM > {VMEM_BYTES} B (smaller block_m or block_k)"
    return p


def tiles(m: int, k: int, ns: tuple[int, ...], num_groups: int, cfg: TpuConfig | None,
          interpret: bool = False) -> Plan | str:  # fmt: skip
    """``plan`` for the target device (the support check's half that reads shapes)."""
    return plan(m, k, ns, num_groups, cfg, fp8_mxu=target_has_fp8_mxu(), interpret=interpret)


def _kernel(meta_ref, x_ref, sx_ref, *refs, stack_tiles, **static):
    n_scratch = 2 if static["dequant"] else 0  # accumulate_dequant's BF16 tiles
    *w_refs, out_ref, acc_ref = refs[: len(refs) - n_scratch]
    scratch = refs[len(refs) - n_scratch :]
    t, j, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def tile(w_ref, sw_ref):
        accumulate_tile(x_ref, sx_ref, w_ref, sw_ref, acc_ref, scratch, k, **static)

    lo = 0
    for s, hi in enumerate(itertools.accumulate(stack_tiles)):  # the stack of this N tile
        cond = (meta_ref[2, t] != 0) & (j >= lo) & (j < hi)
        pl.when(cond)(functools.partial(tile, w_refs[2 * s], w_refs[2 * s + 1]))
        lo = hi

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _index_maps(stack_tiles: tuple[int, ...], nk: int):
    """Block index maps over (tile, n, k, meta). Outside its N tiles a stack's weight stays on
    the block it needs next (its first before them, its last after them); dead tiles stay on the
    last live step's blocks. Either way the index does not change, so nothing is fetched."""

    def k_eff(t, kk, meta):
        live = meta[2, t]
        return kk * live + (nk - 1) * (1 - live)

    def x_map(t, j, kk, meta):
        return meta[1, t], k_eff(t, kk, meta)

    def sx_map(t, j, kk, meta):
        return k_eff(t, kk, meta), meta[1, t], 0

    def stack_maps(lo: int, n_s: int):
        def local(t, j, kk, meta):
            live = meta[2, t]
            after = jnp.where(j >= lo + n_s, 1, 0) * live + (1 - live)  # past it, or dead
            active = jnp.where((j >= lo) & (j < lo + n_s), 1, 0) * live
            j_loc = (j - lo) * active + (n_s - 1) * after
            return j_loc, kk * active + (nk - 1) * after

        def w_map(t, j, kk, meta):
            return (meta[0, t], *local(t, j, kk, meta))

        def sw_map(t, j, kk, meta):
            return meta[0, t], local(t, j, kk, meta)[0], 0, 0

        return w_map, sw_map

    los = [0, *itertools.accumulate(stack_tiles)][:-1]
    return x_map, sx_map, [stack_maps(lo, n_s) for lo, n_s in zip(los, stack_tiles, strict=True)]


def _call(meta, x, sx, ws: tuple[QArray, ...], t: int, p: Plan, out_dtype, interpret):
    (e, _, k), bm, bn, block_k = ws[0].shape, p.block_m, p.block_n, p.block_k
    n_groups, n, k_groups = block_k // GROUP, sum(w.shape[1] for w in ws), k // GROUP
    stack_tiles = tuple(w.shape[1] // bn for w in ws)
    x_map, sx_map, maps = _index_maps(stack_tiles, k // block_k)
    w_specs, w_args = [], []
    for w, (w_map, sw_map) in zip(ws, maps, strict=True):
        sw = w.scales.reshape(e, w.shape[1] // bn, 1, (bn // GROUP) * k_groups)
        w_specs += [
            pl.BlockSpec((None, bn, block_k), w_map),
            pl.BlockSpec((None, None, 1, sw.shape[3]), sw_map, memory_space=pltpu.SMEM),
        ]
        w_args += [w.values, sw]
    if p.pack > 1:  # x as [M_pad/bm, K/256, 2 bm, 256] block-diagonal pairs per row block
        x_spec = pl.BlockSpec((None, block_k // (2 * GROUP), 2 * bm, 2 * GROUP),
                              lambda *a: (*x_map(*a), 0, 0))  # fmt: skip
    else:
        x_spec = pl.BlockSpec((bm, block_k), x_map)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(t, n // bn, k // block_k),
        in_specs=[
            x_spec,
            pl.BlockSpec((None, bm, n_groups), sx_map),
            *w_specs,
        ],  # fmt: skip
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk, meta: (i, j)),
        scratch_shapes=[
            pltpu.VMEM((bm, bn), jnp.float32),
            *(
                [pltpu.VMEM((bm, block_k), jnp.bfloat16), pltpu.VMEM((bn, block_k), jnp.bfloat16)]
                if p.dequant
                else []
            ),
        ],  # fmt: skip
    )
    compute = None if (p.fp8_mxu or p.dequant) else jnp.dtype(p.compute_dtype)
    kernel = functools.partial(_kernel, n_groups=n_groups, n_cols=bn // GROUP, k_groups=k_groups,
                               compute_dtype=compute, stack_tiles=stack_tiles,
                               pack=p.pack, dequant=p.dequant)  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t * bm, n), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES,
        ),
        interpret=interpret,
    )(meta, x, sx, *w_args)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def grouped_fp8_matmul_tpu(
    x_q: QArray, w_q, group_sizes_E: jax.Array, *, out_dtype=jnp.bfloat16,
    interpret: bool | pltpu.InterpretParams = False, config: TpuConfig | None = None,
) -> jax.Array:  # fmt: skip
    """``y_m = Σ_g s_x[m, g] s_w[e(m), :, g] (x̂_m,g · ŵ_e(m),gᵀ)`` with an f32 VMEM accumulator.

    ``x_q``: QArray [M, K] with (128,) groups, rows sorted by group; ``w_q``: QArray [E, N, K]
    with (128, 128) blocks, or a tuple of them (one call over their concatenation along N);
    ``group_sizes_E``: int [E]. Needs K % 128 == 0 and every N % 128 == 0.
    """
    ws = stacks(w_q)
    if tuple(ws[0].block_shape) != (GROUP, GROUP) or tuple(x_q.block_shape) != (GROUP,):
        raise ValueError(
            f"grouped_fp8_matmul_tpu: needs ({GROUP},) activation groups and ({GROUP}, {GROUP}) "
            f"weight blocks, got {x_q.block_shape} and {ws[0].block_shape}"
        )
    (m, k), e = x_q.shape, ws[0].shape[0]
    p = tiles(m, k, tuple(w.shape[1] for w in ws), e, config, interpret=bool(interpret))
    if isinstance(p, str):
        raise ValueError(f"grouped_fp8_matmul_tpu: {p}")
    bm, block_k = p.block_m, p.block_k
    tmap = make_tile_map(group_sizes_E, m, bm)
    t = num_tiles(m, e, bm)
    m_pad = pl.cdiv(m, bm) * bm
    x = jnp.pad(x_q.values, ((0, m_pad - m), (0, 0)))
    if p.pack > 1:
        x = jax.vmap(block_diagonal_pairs)(x.reshape(m_pad // bm, bm, k))
    # [M, K/128] -> [K/block_k, M_pad, G]: one (block_m, G) scale tile per grid step.
    sx = jnp.pad(x_q.scales, ((0, m_pad - m), (0, 0)))
    sx = sx.reshape(m_pad, k // block_k, block_k // GROUP).transpose(1, 0, 2)
    out = _call(tmap.meta_3T, x, sx, ws, t, p, jnp.dtype(out_dtype), interpret)
    return gather_rows(out, tmap, out_dtype)
