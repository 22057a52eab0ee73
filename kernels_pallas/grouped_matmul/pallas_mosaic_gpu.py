"""BF16 grouped matmul for Hopper (sm_90) with Pallas Mosaic GPU: the MoE experts' training GEMMs.

XLA:GPU lowers ``jax.lax.ragged_dot`` densely: every row times every group's weight, then a
select (a lone ``ragged_dot`` compiled for H100 makes ``bf16[M, E, N]`` in the forward and
``f32[E, M, K]`` in the gradient). For Qwen3-30B-A3B's local dispatch buffer (E/n = 16 experts at
expert = 8, ~1/8 of its rows live) that is ~128x the useful FLOPs. These kernels compute the live
rows only:

  * ``gmm``: ``y = x · w[e]`` (or ``x · w[e]ᵀ``, the input gradient) over the row tiles of
    ``grouped_fp8_matmul``'s tile map (``tiles.py``: one CTA per (tile, N tile), a tile = one
    aligned row block times one group's weight; dead tiles return at once). A TMA warpgroup
    streams (bm, bk) x (bk, bn) BF16 slices into an SMEM ring; one or two compute warpgroups
    (64 rows x <= 256 columns each: 128x256 tiles by default, ``gmm_default``) run one wgmma per
    slice into their accumulators, one in flight, and store their group's rows straight into y
    (``grouped_fp8_matmul/mgpu_rows.py``: no tile outputs, no gather; the rows past ``Σ sizes``
    are one more group whose tiles store zeros). Before: one warpgroup on 128x128 tiles
    (``plgpu.emit_pipeline``, jax ``ragged_dot_mgpu``'s structure) writing whole tiles that XLA
    gathered;
  * ``tgmm``: ``dw_e = Σ_{m ∈ e} x_mᵀ dy_m``: one CTA per (group, K tile, N tile) runs a
    pipeline over the row blocks the group's rows touch, its length read from GMEM at run time
    (as jax ``transposed_ragged_dot_mgpu`` does), with the same warpgroups (128x256 tiles for a
    16-bit dw, ``tgmm_default``): each compute warpgroup takes 64 columns of the x slice,
    transposed in SMEM, as its wgmma A operand; in the group's first and last blocks it zeroes
    the other groups' rows in those columns first. dw goes out in ``out_dtype`` (the training
    pass: the weights' BF16) through swizzled SMEM. Empty groups write zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.fp8_matmul.mgpu_k_step import smem_transforms
from kernels_pallas.grouped_fp8_matmul import mgpu_rows
from kernels_pallas.grouped_fp8_matmul.tiles import group_bounds, num_tiles, ragged_meta

SMEM_BYTES = 227 * 1024  # H100 dynamic shared memory per CTA
_MAX_GRID = 2**31 - 1
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Tiles of both kernels: output ``block_m x block_n`` per CTA, ``block_k`` per pipeline step,
    ``block_m / 64`` compute warpgroups (1 or 2), each owning 64 rows x ``block_n`` (<= 256:
    128 accumulator registers) beside a TMA warpgroup. For ``tgmm`` the output tile is (K tile
    ``block_m``, N tile ``block_n``) and ``block_k`` the row block of the contraction over a
    group's rows."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4

    @property
    def num_compute_wgs(self) -> int:
        """Compute warpgroups: one per 64 rows of the tile."""
        return self.block_m // _WG_ROWS

    def smem_bytes(self, itemsize: int, out_itemsize: int) -> int:
        ring = self.max_concurrent_steps * (self.block_m + self.block_n) * self.block_k * itemsize
        return ring + self.block_m * self.block_n * out_itemsize


_WG_ROWS = 64  # a compute warpgroup's wgmma rows
_MAX_WG_COLS = 256  # 64 x 256 f32: 128 accumulator registers per thread
_SUB_N = 128  # columns per accumulator (a wider wgmma/store of BF16 fails layout inference)
_WIDE = GmmConfig(block_m=128, block_n=256, block_k=64, max_concurrent_steps=3)


def default_config(k: int, n: int) -> GmmConfig:
    """Square tiles where ``gmm_default`` / ``tgmm_default`` cannot take the wide ones: 128-wide
    where K and N allow, else 64 (e.g. a 64-wide expert in tests)."""
    b = 128 if k % 128 == 0 and n % 128 == 0 else 64
    return GmmConfig(block_m=b, block_n=b)


def gmm_default(k: int, n_out: int, out_itemsize: int = 2) -> GmmConfig:
    """``gmm``'s tiles for an ``n_out``-wide output contracting ``k``: 128 x 256 (two compute
    warpgroups of 64 x 256, three 48 KiB stages beside the 64 KiB output tile) where
    ``n_out % 256 == 0`` and the output is 16-bit (an f32 output tile of 128 KiB would leave the
    ring two stages), as the FP8 kernels' wide tiles: 3/4 of a 128x128 tile's L2 -> SMEM bytes
    per FLOP, and two warpgroups' wgmmas interleave (predicted 1.5-2.2x faster than the
    one-warpgroup 128x128 tile at Qwen3-30B-A3B's experts: ``perf_model.gpu_grouped``); else
    ``default_config``'s."""
    if k % 64 == 0 and n_out % _MAX_WG_COLS == 0 and out_itemsize <= 2:
        return _WIDE
    return default_config(k, n_out)


def tgmm_default(k: int, n: int, out_itemsize: int = 2) -> GmmConfig:
    """``tgmm``'s tiles for ``dw [E, k, n]``: ``gmm_default``'s 128 x 256 where ``k % 128 == 0``
    and ``n % 256 == 0`` and the output is 16-bit (an f32 output tile of 128 KiB leaves the
    ring two stages), else ``default_config``'s."""
    if k % 128 == 0 and n % _MAX_WG_COLS == 0 and out_itemsize <= 2:
        return _WIDE
    return default_config(k, n)


def _tiles_reason(c: GmmConfig, tiled: dict, itemsize: int, out_itemsize: int) -> str | None:
    """Why one pass cannot run on ``c``: ``tiled`` maps each dimension's name to (its size, the
    tiles along it)."""
    if c.block_m % 64 or c.block_n % 64 or c.block_k % 64:
        return f"tiles {c.block_m}x{c.block_n}x{c.block_k} must be multiples of 64"
    if c.max_concurrent_steps < 2:
        return "max_concurrent_steps must be >= 2 (the ring releases a slot one step late)"
    for name, (dim, blocks) in tiled.items():
        if any(dim % b for b in blocks):
            return f"{name}={dim} must be a multiple of the tiles {blocks} along it"
    used = c.smem_bytes(itemsize, out_itemsize)
    if used > SMEM_BYTES:
        return f"tiles need {used} B of SMEM > {SMEM_BYTES} B (fewer stages or smaller tiles)"
    return None


def pass_reason(kind: str, k: int, n: int, cfg: GmmConfig, itemsize: int, out_itemsize: int,
                dims: tuple[str, str] = ("K", "N")) -> str | None:  # fmt: skip
    """Why one pass cannot run on ``cfg``, or None. ``kind="gmm"``: rows ``[M, k]`` times
    ``[E, k, n]``, ``n`` tiled by ``block_n`` and ``k`` contracted by ``block_k``; ``"tgmm"``:
    dw ``[E, k, n]``, ``k`` tiled by ``block_m`` and ``n`` by ``block_n``. ``dims``: the names
    of ``k`` and ``n`` in the messages (the input gradient contracts the forward's N)."""
    if cfg.block_m not in (64, 128) or cfg.block_n > _MAX_WG_COLS:
        return f"tiles are 64 or 128 rows x <= {_MAX_WG_COLS} columns (one or two " \
               f"warpgroups of 64 rows), got {cfg.block_m}x{cfg.block_n}"  # fmt: skip
    kn, nn = dims
    tiled = ({nn: (n, (cfg.block_n,)), kn: (k, (cfg.block_k,))} if kind == "gmm"
             else {kn: (k, (cfg.block_m,)), nn: (n, (cfg.block_n,))})  # fmt: skip
    return _tiles_reason(cfg, tiled, itemsize, out_itemsize)


def supports(m: int, k: int, n: int, dtype, cfg: GmmConfig | None = None) -> str | None:
    """None if the forward, the input gradient and the weight gradient (written in the
    operands' dtype, as ``grouped_matmul`` asks) all compile for rows [M, K] x [E, K, N] with
    this config (None: each pass its default, ``gmm_default`` / ``tgmm_default``), else why not.
    The forward tiles N by ``block_n`` and contracts K by ``block_k``; the input gradient tiles
    K by ``block_n`` and contracts N by ``block_k``; the weight gradient tiles K by ``block_m``
    and N by ``block_n`` (``pass_reason``)."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"operands must be bfloat16 or float16, got {jnp.dtype(dtype)}"
    if m < 1:
        return "M must be >= 1"
    size = jnp.dtype(dtype).itemsize
    passes = (  # (name, kind, contracted or dw rows, output columns, tiles, their names)
        ("forward", "gmm", k, n, cfg or gmm_default(k, n), ("K", "N")),
        ("input gradient", "gmm", n, k, cfg or gmm_default(n, k), ("N", "K")),
        ("weight gradient", "tgmm", k, n, cfg or tgmm_default(k, n, size), ("K", "N")),
    )
    for name, kind, a, b, c, dims in passes:
        if (bad := pass_reason(kind, a, b, c, size, size, dims)) is not None:
            return f"{name}: {bad}"
    return None


def _check_smem(name: str, cfg: GmmConfig, dtype, out_dtype) -> None:
    """Refuses a tile whose ring and output tile exceed the SMEM budget for this output dtype
    (the device compile would fail later, with less to go on)."""
    used = cfg.smem_bytes(jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize)
    if used > SMEM_BYTES:
        raise ValueError(
            f"{name}: {cfg} needs {used} B of SMEM with a {jnp.dtype(out_dtype).name} output "
            f"> {SMEM_BYTES} B (fewer stages, a narrower tile, or a 16-bit output)"
        )


def _pipeline(grid, in_specs, cfg: GmmConfig):
    """``(body, compute_context) -> pipeline``: a TMA warpgroup beside ``cfg.num_compute_wgs``
    compute warpgroups over ``grid`` (static, or read at run time)."""
    return functools.partial(
        plgpu.emit_pipeline_warp_specialized, grid=grid, memory_registers=40, in_specs=in_specs,
        wg_axis="wg", num_compute_wgs=cfg.num_compute_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps,
    )  # fmt: skip


def _accumulate_then(store, n_subs: int, sub_n: int):
    """A compute warpgroup's pipeline context: ``n_subs`` f32 [64, sub_n] accumulators carried
    through the steps, the last step's wgmmas waited for, then ``store(values)``."""

    def compute_context(eval_pipeline):
        acc = plgpu.ACC((_WG_ROWS, sub_n), jnp.float32)

        @functools.partial(pl.run_scoped, acc_refs=tuple(acc for _ in range(n_subs)))
        def _(acc_refs):
            eval_pipeline(acc_refs)
            plgpu.wgmma_wait(0)  # the last step's wgmmas
            store(tuple(a[...] for a in acc_refs))

    return compute_context


def _zeros(n_subs: int, sub_n: int) -> tuple:
    """``n_subs`` zero accumulators (the rows past the groups, an empty group's dw)."""
    zero = jnp.zeros((_WG_ROWS, sub_n), jnp.float32)
    return tuple(plgpu.layout_cast(zero, plgpu.Layout.WGMMA) for _ in range(n_subs))


def _gmm_kernel(meta_gmem, x_gmem, w_gmem, out_gmem, *, cfg: GmmConfig, transpose_w: bool):
    """One CTA: row tile t of its group times one N tile of its weight. A TMA warpgroup streams
    [bm, bk] x slices and [bk, bn] (or [bn, bk]) weight slices; each compute warpgroup runs one
    wgmma per slice into its 64 rows' accumulator, one in flight (``delay_release=1``), and
    stores its group's rows straight into y (``mgpu_rows``)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    nwg, out_dtype = cfg.num_compute_wgs, out_gmem.dtype
    t_idx, n_idx = lax.axis_index("t"), lax.axis_index("n")
    group, block, mode = meta_gmem[0, t_idx], meta_gmem[1, t_idx], meta_gmem[2, t_idx]
    first, count = meta_gmem[3, t_idx], meta_gmem[4, t_idx]
    transforms = smem_transforms(x_gmem.dtype, bk)
    w_block = (bn, bk) if transpose_w else (bk, bn)
    in_specs = [
        plgpu.BlockSpec((bm, bk), lambda s: (0, s), transforms=transforms, delay_release=1),
        plgpu.BlockSpec(
            w_block,
            (lambda s: (0, s)) if transpose_w else (lambda s: (s, 0)),
            transforms=smem_transforms(w_gmem.dtype, w_block[1]),
            delay_release=1,
        ),  # fmt: skip
    ]
    w_e = w_gmem.at[group]
    w_view = w_e.at[pl.ds(n_idx * bn, bn)] if transpose_w else w_e.at[:, pl.ds(n_idx * bn, bn)]
    gmem_in = (x_gmem.at[pl.ds(block * bm, bm)], w_view)

    pipeline = _pipeline((x_gmem.shape[1] // bk,), in_specs, cfg)
    ignore = lambda *_, **__: None
    sub_n = min(bn, _SUB_N)  # a warpgroup's columns in sub-tiles of <= 128 (an accumulator each)
    subs = range(0, bn, sub_n)
    scratch = dict(
        pipeline_allocs=pipeline(ignore, compute_context=ignore).get_allocations(*gmem_in),
        out_smem=mgpu_rows.scratch((nwg, len(subs)), sub_n, out_dtype),
    )

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(pipeline_allocs, out_smem):
        wg = lax.axis_index("wg")
        rows = pl.ds(wg * _WG_ROWS, _WG_ROWS)

        def store(accs):  # this warpgroup's rows of the group, into y
            row0 = wg * _WG_ROWS
            for s, (acc, c) in enumerate(zip(accs, subs, strict=True)):
                views = tuple(v.at[wg, s] for v in out_smem)
                dst = out_gmem.at[:, pl.ds(n_idx * bn + c, sub_n)]
                mgpu_rows.store(views, acc, dst, block * bm + row0, first - row0, count)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        compute_context = _accumulate_then(store, len(subs), sub_n)

        def body(_, x_smem, w_smem, acc_refs):
            for acc_ref, c in zip(acc_refs, subs, strict=True):
                cols = pl.ds(c, sub_n)
                w_op = w_smem.at[cols].T if transpose_w else w_smem.at[:, cols]
                plgpu.wgmma(acc_ref, x_smem.at[rows], w_op)
            plgpu.wgmma_wait(len(subs))  # the previous step's: its slots go one step late
            return acc_refs

        run = pipeline(body, compute_context=compute_context)
        pl.when(mode == 1)(functools.partial(run, *gmem_in, allocations=pipeline_allocs))

        @pl.when((mode == 2) & (wg < nwg))  # the rows past Σ sizes
        def _():
            store(_zeros(len(subs), sub_n))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _tgmm_kernel(meta_gmem, x_gmem, dy_gmem, out_gmem, *, cfg: GmmConfig):
    """One CTA: group e's ``dw_e`` tile (K tile ``block_m`` x N tile ``block_n``), contracting
    over the row blocks the group's rows touch (a pipeline whose length is read at run time).
    A TMA warpgroup streams [bk, bm] x and [bk, bn] dy slices; each compute warpgroup owns 64
    K rows (its x columns, ``x_smem.T`` as the wgmma A operand) x ``block_n`` in accumulators
    of <= 128 columns and stores them through swizzled SMEM. In the group's first and last
    blocks each warpgroup zeroes the other groups' rows in its x columns first. Empty groups
    write zeros."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    nwg, out_dtype = cfg.num_compute_wgs, out_gmem.dtype
    e_idx, m_idx, n_idx = lax.axis_index("e"), lax.axis_index("m"), lax.axis_index("n")
    start, end = meta_gmem[0, e_idx], meta_gmem[1, e_idx]  # the group's rows [start, end)
    first = start // bk
    count = jnp.where(end > start, (end + bk - 1) // bk - first, 0)
    in_specs = [
        plgpu.BlockSpec((bk, width), lambda r: (first + r, 0), delay_release=1,
                        transforms=smem_transforms(x_gmem.dtype, width))
        for width in (bm, bn)
    ]  # fmt: skip
    gmem_in = (x_gmem.at[:, pl.ds(m_idx * bm, bm)], dy_gmem.at[:, pl.ds(n_idx * bn, bn)])

    pipeline = _pipeline((count,), in_specs, cfg)
    ignore = lambda *_, **__: None
    sub_n = min(bn, _SUB_N)
    subs = range(0, bn, sub_n)
    out_shape = (nwg, len(subs), _WG_ROWS, sub_n)
    scratch = dict(
        pipeline_allocs=pipeline(ignore, compute_context=ignore).get_allocations(*gmem_in),
        out_smem=plgpu.SMEM(out_shape, out_dtype, transforms=smem_transforms(out_dtype, sub_n)),
    )

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(pipeline_allocs, out_smem):
        wg = lax.axis_index("wg")
        cols = pl.ds(wg * _WG_ROWS, _WG_ROWS)  # this warpgroup's x columns: its K rows of dw

        def store(accs):
            for s, acc in enumerate(accs):
                out_smem[wg, s] = acc.astype(out_dtype)
            plgpu.commit_smem()
            for s, c in enumerate(subs):
                dst = out_gmem.at[e_idx, pl.ds(m_idx * bm + wg * _WG_ROWS, _WG_ROWS),
                                  pl.ds(n_idx * bn + c, sub_n)]  # fmt: skip
                plgpu.copy_smem_to_gmem(out_smem.at[wg, s], dst)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        compute_context = _accumulate_then(store, len(subs), sub_n)

        def body(idx, x_smem, dy_smem, acc_refs):
            r = idx[0]
            x_wg = x_smem.at[:, cols]

            # The group's first and last row blocks hold other groups' rows: zero them in x
            # (dw = xᵀ dy, so that drops their dy rows too). Rows past M arrive as TMA's zeros.
            @pl.when((r == 0) | (r == count - 1))
            def _():
                rows = (first + r) * bk + plgpu.layout_cast(
                    lax.broadcasted_iota(jnp.int32, (bk, _WG_ROWS), 0), plgpu.Layout.WGMMA
                )
                keep = ((rows >= start) & (rows < end)).astype(x_smem.dtype)
                x_wg[...] = x_wg[...] * keep
                plgpu.commit_smem()

            for acc_ref, c in zip(acc_refs, subs, strict=True):  # [bk, 64]ᵀ · [bk, sub_n]
                plgpu.wgmma(acc_ref, x_wg.T, dy_smem.at[:, pl.ds(c, sub_n)])
            plgpu.wgmma_wait(len(subs))  # the previous step's: its slots go one step late
            return acc_refs

        run = pipeline(body, compute_context=compute_context)
        pl.when(count > 0)(functools.partial(run, *gmem_in, allocations=pipeline_allocs))

        @pl.when((count == 0) & (wg < nwg))  # an empty group: dw_e = 0
        def _():
            store(_zeros(len(subs), sub_n))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _interpret(interpret: bool) -> dict:
    return {"interpret": plgpu.InterpretGPUParams()} if interpret else {}


_PARAMS = dict(
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
)


@functools.partial(jax.jit, static_argnames=("transpose_w", "out_dtype", "config", "interpret"))
def gmm_mgpu(x_MK, w, group_sizes_E, *, transpose_w: bool = False, out_dtype=None,
             config: GmmConfig | None = None, interpret: bool = False) -> jax.Array:  # fmt: skip
    """``y_m = x_m · w[e(m)]`` [M, N] (``w`` [E, K, N]), or with ``transpose_w`` ``x_m · w[e(m)]ᵀ``
    (``w`` [E, N, K]: the input gradient against the forward's stacks); rows past ``Σ sizes``
    are zero. f32 accumulation, ``out_dtype`` (default x's) output."""
    m, k = x_MK.shape
    e = w.shape[0]
    n = w.shape[1] if transpose_w else w.shape[2]
    out_dtype = jnp.dtype(out_dtype or x_MK.dtype)
    cfg = config or gmm_default(k, n, out_dtype.itemsize)
    _check_smem("gmm_mgpu", cfg, w.dtype, out_dtype)
    m_pad = pl.cdiv(m, cfg.block_m) * cfg.block_m
    x = jnp.pad(x_MK.astype(w.dtype), ((0, m_pad - m), (0, 0)))
    kern = plgpu.kernel(
        functools.partial(_gmm_kernel, cfg=cfg, transpose_w=transpose_w),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_tiles(m, e + 1, cfg.block_m), n // cfg.block_n),
        grid_names=("t", "n"),
        num_threads=cfg.num_compute_wgs + 1,
        thread_name="wg",
        **_PARAMS,
        **_interpret(interpret),
    )
    return kern(ragged_meta(group_sizes_E, m, cfg.block_m), x, w)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def tgmm_mgpu(x_MK, dy_MN, group_sizes_E, *, out_dtype=jnp.float32,
              config: GmmConfig | None = None, interpret: bool = False) -> jax.Array:  # fmt: skip
    """``dw_e = Σ_{m ∈ e} x_mᵀ dy_m`` [E, K, N], accumulated in f32 and written in ``out_dtype``
    (rows past ``Σ sizes`` contribute 0). The training pass asks for the weights' BF16 directly:
    one rounding of the f32 accumulator, as a cast of the f32 result, without writing, reading
    and casting ``E x K x N`` f32 in HBM (``perf_model.gpu_grouped``: 2.1-2.2x faster at
    Qwen3-30B-A3B's experts)."""
    (m, k), n = x_MK.shape, dy_MN.shape[1]
    cfg = config or tgmm_default(k, n, jnp.dtype(out_dtype).itemsize)
    _check_smem("tgmm_mgpu", cfg, x_MK.dtype, out_dtype)
    e = group_sizes_E.shape[0]
    starts, ends = group_bounds(group_sizes_E, m)
    kern = plgpu.kernel(
        functools.partial(_tgmm_kernel, cfg=cfg),
        out_type=jax.ShapeDtypeStruct((e, k, n), jnp.dtype(out_dtype)),
        grid=(e, k // cfg.block_m, n // cfg.block_n),
        grid_names=("e", "m", "n"),
        num_threads=cfg.num_compute_wgs + 1,
        thread_name="wg",
        **_PARAMS,
        **_interpret(interpret),
    )
    return kern(jnp.stack([starts, ends]), x_MK, dy_MN.astype(x_MK.dtype))
