"""GPU performance model of the MoE experts' Hopper kernels: ``grouped_matmul`` (the BF16
experts of the scoring and training passes) against XLA:GPU's dense ``ragged_dot``, and
``grouped_fp8_matmul`` (the FP8 rollout's experts) against a BF16 grouped GEMM at cuBLAS's
efficiencies: the step formula, waves and assumptions of ``gpu.py``, with the kernels' own SASS
profiles (``profile_gpu.py``)."""

from __future__ import annotations

import math

from kernels_pallas.grouped_fp8_matmul import aot_cases as gfp8_cases
from kernels_pallas.grouped_fp8_matmul import mgpu_rows
from kernels_pallas.perf_model.common import CHIPS, GPU_CHIPS, Case, Prediction
from kernels_pallas.perf_model.gpu import (
    BF16_GEMM_BW_EFF,
    BF16_GEMM_EFF,
    LAUNCH_S,
    SMEM_BYTES_PER_CLK,
    Loop,
    bf16_gemm_s,
    bf16_kernel_s,
    calibration,
    finish,
    grid_time,
    load_profiles,
    mm_loop,
)


def dense_ragged_dot_s(chip: str, m: int, k: int, n: int, e: int, pass_: str) -> float:
    """XLA:GPU's ``ragged_dot`` (and its gradients): dense over the groups, every one of the
    buffer's ``m`` rows times every one of the ``e`` weights (``pallas_mosaic_gpu.py``), at the
    BF16 GEMM efficiencies: the forward and dgrad are ``[e·m, ·]`` GEMMs, the wgrad ``e``
    GEMMs ``[k, m] x [m, n]``."""
    if pass_ == "wgrad":
        return bf16_gemm_s(chip, e * k, n, m)
    return bf16_gemm_s(chip, e * m, n if pass_ == "fwd" else k, k if pass_ == "fwd" else n)


def predict_grouped_bf16(chip: str, m: int, live: int, e: int, k: int, n: int, pass_: str,
                         label: str = "", in_program: bool = False,
                         one_wg: bool = False, f32_dw: bool = False) -> Prediction:  # fmt: skip
    """``grouped_matmul``'s Hopper kernels for one pass over a dispatch buffer of ``m`` rows of
    which ``live`` belong to the ``e`` groups (``fwd``: ``[m, k] x [e, k, n]``; ``dgrad``:
    ``[m, n] x [e, k, n]ᵀ``; ``wgrad``: ``[e, k, n]``). ``gmm`` (fwd, dgrad) on its default
    tiles (``gmm_default``: 128x256, two compute warpgroups, 64-deep steps, 3 stages), storing
    its rows into y (the rows past ``live`` as zeros: all ``m`` rows written once; the tiles a
    group boundary cuts pay ``ragged_epilogue_s``); ``tgmm`` (wgrad) on the same tiles
    (``tgmm_default``), writing dw in BF16 (``f32_dw``: in f32, then cast by XLA). Live tiles
    are the bound ``cdiv(live, 128) + e - 1``; dead tiles exit at once (not modelled). The XLA
    around the kernels: x padded to whole row blocks (fwd/dgrad, when M is not a multiple of
    128), the tile map, the group bounds of tgmm, and with ``f32_dw`` the f32 -> BF16 cast of
    dw (``in_program``: their bytes, not their launches, which a program's count has).
    ``one_wg``: the kernels as they were before (one warpgroup on 128x128 tiles, 4 stages;
    ``gmm`` writing whole tiles into tile outputs that XLA gathered: ``design_changes``)."""
    from kernels_pallas.grouped_matmul import pallas_mosaic_gpu as kernel

    launch = 0.0 if in_program else LAUNCH_S
    c = CHIPS[chip]
    bw = c.hbm_bytes_per_s
    kk, nn = (k, n) if pass_ != "dgrad" else (n, k)  # contraction, output width
    kind = {"fwd": "gmm", "dgrad": "gmm", "wgrad": "tgmm"}[pass_]
    suffix = "_t" if pass_ == "dgrad" else ""
    if one_wg:
        cfg, nwg = kernel.GmmConfig(128, 128, 64, 4), 1
        name = f"{kind}_bf16_128x128{suffix}_1wg"
    else:
        cfg = kernel.tgmm_default(k, n, 4 if f32_dw else 2) if pass_ == "wgrad" else \
            kernel.gmm_default(kk, nn)  # fmt: skip
        nwg = cfg.num_compute_wgs
        name = f"{kind}_bf16_{cfg.block_m}x{cfg.block_n}{suffix}"
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    prof = load_profiles()[name]
    threads = 128 if one_wg else 128 * (nwg + 1)  # warp-specialized: a TMA warpgroup too
    loop = Loop(nwg=nwg, threads=threads, wg_flops=2 * bm // nwg * bn * bk,
                fp8=False, waits=0, step_bytes=(bm + bn) * bk * 2,
                stages=cfg.max_concurrent_steps)  # fmt: skip
    if pass_ == "wgrad":
        ctas = e * (k // bm) * (n // bn)
        steps = math.ceil((live + e * (bk - 1)) / bk / e)  # a group's row blocks, on average
        dw = 4 if f32_dw else 2
        extra = (e * k * n * (4 + 2) / bw if f32_dw else 0.0) + launch  # f32 dw: read, cast
        hbm = (live + e * bk) * (k + n) * 2 + e * k * n * dw
    else:
        tiles = math.ceil(live / bm) + e - 1
        ctas, steps = tiles * (nn // bn), kk // bk
        pad = m * kk * 2 * 2 if m % bm else 0  # jnp.pad of x to whole row blocks
        if one_wg:  # whole tiles out, then XLA's gather of the M rows from them
            extra = (pad + (tiles * bm + m) * nn * 2 * 2) / bw + 2 * launch
            hbm = tiles * bm * kk * 2 + e * k * n * 2 + tiles * bm * nn * 2
        else:  # y written once, its rows past ``live`` as zeros; the tile map's launch
            extra = pad / bw + (1 + bool(pad)) * launch
            hbm = tiles * bm * kk * 2 + e * k * n * 2 + m * nn * 2
    t, terms = grid_time(chip, loop, prof, ctas, steps)
    if pass_ != "wgrad" and not one_wg:  # the tiles a group boundary cuts
        t += ragged_epilogue_s(chip, cfg, e, nn // bn, terms["ctas_per_sm"])
    terms = dict(terms, registers=prof["registers"], smem_alloc=prof["smem_bytes"])
    base = f"XLA:GPU dense ragged_dot (all {m} rows x {e} groups; {BF16_GEMM_EFF:.0%} of peak)"
    label = label or f"{pass_} M={m} live={live} E={e} K={k} N={n}"
    return finish("grouped_matmul", label, chip, f"{name} ({pass_})", t, terms, hbm,
                  2 * live * k * n, base, dense_ragged_dot_s(chip, m, k, n, e, pass_),
                  extra)  # fmt: skip


# XLA fusions around the grouped FP8 kernel (``grouped_fp8_matmul_mgpu``): the tile map from the
# group sizes, x's scales padded and transposed (x padded too where the rows are not whole row
# tiles), and on swap-AB (decode) tiles the gather of each row's output from its tile; prefill
# tiles store their rows into y themselves (ragged stores)
GROUPED_FP8_FUSIONS = 3
GROUPED_FP8_FUSIONS_RAGGED = 2
# below this many rows per expert the groups are decode-sized (``default_config``'s swap-AB rule)
DECODE_ROWS_PER_EXPERT = 64
# A ragged store's unswizzled SMEM tile: each 32-bit store of a WGMMA fragment puts a warp's 8 rows
# (256-512 B apart) in the same 4 banks, so it takes 8 bank wavefronts (the swizzled stores of a
# whole sub-tile take one: ``stmatrix``)
RAGGED_CONFLICT_WAYS = 8


def ragged_epilogue_s(chip: str, cfg, used: int, n_tiles: int, ctas_per_sm: int,
                      out_itemsize: int = 2) -> float:  # fmt: skip
    """Seconds the prefill tiles' ragged stores add: each of the ``used - 1`` group boundaries
    (routing spread evenly: none on a row-tile edge) cuts a tile of each of its two groups, in
    which one compute warpgroup's 64 cut rows (a 64-row sub-tile of each of its 128-column
    blocks) go through the unswizzled SMEM tile at ``RAGGED_CONFLICT_WAYS`` times the store
    cost, spread over the SMs' CTA slots."""
    c = CHIPS[chip]
    cycles = mgpu_rows.ROWS * cfg.block_n * out_itemsize * RAGGED_CONFLICT_WAYS / SMEM_BYTES_PER_CLK
    ragged_ctas = 2 * max(used - 1, 0) * n_tiles
    return ragged_ctas * cycles / c.clock_hz / (c.cores * ctas_per_sm)


def grouped_fp8_variant(cfg) -> str:
    """The SASS profile of the grouped FP8 kernel's tile (``profile_gpu``: ``gfp8_*``)."""
    return f"gfp8_{'swap_' if cfg.swap_ab else ''}{cfg.block_m}x{cfg.block_n}"


def predict_grouped_fp8(chip: str, rows: int, e: int, k: int, ns: tuple[int, ...],
                        label: str = "", config=None, in_program: bool = False,
                        ragged: bool | None = None) -> Prediction:  # fmt: skip
    """``grouped_fp8_matmul``'s Hopper kernel on its default tile (``default_config``) for
    ``rows`` FP8 rows (tokens x top-k, sorted by expert) over ``e`` experts' stacked weights
    ``[E, N_i, K]`` (``ns``: gate and up run as one launch; ``config``: another tile), routing
    spread evenly: ``min(E, rows)`` experts have rows, each streaming its weights once per row tile,
    and the tiles are the kernel's bound ``cdiv(rows, tm) + min(E, rows) - 1`` (every group
    boundary splits a row tile; dead tiles exit at once, not modelled). The kernel's K loop is
    the dense kernel's (``gfp8_*`` and ``mm_*`` profiles agree within 2 instructions), so its
    calibration is the dense family's. Around it, ``GROUPED_FP8_FUSIONS`` XLA launches: x padded
    to whole row tiles with its scales transposed, and the gather of the tile outputs (rows x N,
    read and written); prefill tiles store their rows into y (``GROUPED_FP8_FUSIONS_RAGGED``,
    no gather; ``ragged_epilogue_s`` for the tiles a group boundary cuts). Baseline: one BF16
    grouped GEMM over the same experts at cuBLAS's efficiencies (``bf16_kernel_s``), the bound
    a BF16 rollout's experts could reach (XLA:GPU's own ``ragged_dot`` expands densely over the
    experts: ``dense_ragged_dot_s``).
    ``in_program``: the fusions' bytes without their launches, which a program's count has
    (``gpu_rollout.moe_step``). ``ragged=False``: a prefill tile stored whole into the tile
    outputs and gathered, as before the ragged stores (``design_changes``)."""
    from kernels_pallas.grouped_fp8_matmul import pallas_mosaic_gpu as kernel
    from kernels_pallas.grouped_fp8_matmul.tiles import num_tiles

    n, used = sum(ns), min(e, rows)
    cfg = config or kernel.default_config(rows, ns, k, e)
    name = grouped_fp8_variant(cfg)
    prof = load_profiles()[name]
    tiles, n_tiles = num_tiles(rows, e, cfg.block_m), n // cfg.block_n
    t, terms = grid_time(chip, mm_loop(cfg, False), prof, tiles * n_tiles, k // 128)
    # rows stored into y by the kernel: no tile outputs, no gather
    ragged = not cfg.swap_ab if ragged is None else ragged
    if ragged:
        t += ragged_epilogue_s(chip, cfg, used, n_tiles, terms["ctas_per_sm"])
    terms = dict(terms, registers=prof["registers"], smem_alloc=prof["smem_bytes"])
    bw = CHIPS[chip].hbm_bytes_per_s
    w_bytes = used * n * k + used * (n // 128) * (k // 128) * 4
    x_bytes = rows * k + rows * (k // 128) * 4
    hbm = w_bytes + x_bytes + (rows if ragged else tiles * cfg.block_m) * n * 2
    rows_pad = -(-rows // cfg.block_m) * cfg.block_m
    pad = (x_bytes + rows_pad * k) if rows % cfg.block_m else 2 * rows * (k // 128) * 4
    fusions = GROUPED_FP8_FUSIONS_RAGGED if ragged else GROUPED_FP8_FUSIONS
    gather = 0 if ragged else 2 * rows * n * 2
    extra = (pad + gather) / bw + (0 if in_program else fusions * LAUNCH_S)
    base_s = bf16_kernel_s(chip, 2 * rows * n * k, used * n * k * 2 + rows * (k + n) * 2)
    base = (f"BF16 grouped GEMM over the {used} experts with rows ({BF16_GEMM_EFF:.0%} of peak / "
            f"{BF16_GEMM_BW_EFF:.0%} of HBM)")  # fmt: skip
    label = label or f"rows={rows} E={e} K={k} N={'+'.join(map(str, ns))}"
    # the measured family of the regime, whatever the tile: decode-sized groups stream weights
    scale = calibration("mm_decode" if rows / e < DECODE_ROWS_PER_EXPERT else "mm_prefill")
    return finish("grouped_fp8_matmul", label, chip, f"{name} + {fusions} fusions",
                  t, terms, hbm, 2 * rows * n * k, base, base_s, extra, scale)  # fmt: skip


# (label, dispatch rows M, live rows, local experts E, K, N): Qwen3-30B-A3B's training experts
# (D 2,048, expert F 768, top-8) over one dispatch chunk of 4,096 gathered tokens: at expert = 8
# (16 local experts, ~1/8 of the 32,768 rows live: moe_parallel) and on one device (all 128).
GROUPED_SHAPES = (
    ("Qwen3-30B-A3B gate|up EP=8", 32768, 4096, 16, 2048, 768),
    ("Qwen3-30B-A3B down EP=8", 32768, 4096, 16, 768, 2048),
    ("Qwen3-30B-A3B gate|up EP=1", 32768, 32768, 128, 2048, 768),
)


# The FP8 rollout's experts, as the grouped kernel's compile cases have them (Qwen3-30B-A3B:
# E 128, top-8, D 2,048, expert F 768; decode steps of 1-256 sequences, prefill chunks of 512
# and 8,192 tokens): (layer, K, N of each weight stack), rows, experts
GROUPED_FP8_LAYERS, GROUPED_FP8_ROWS = gfp8_cases.LAYERS, gfp8_cases.ALL_ROWS
GROUPED_FP8_E = gfp8_cases.E

CASES: list[Case] = [
    Case.make(
        "grouped_matmul", f"{label} {pass_}", GPU_CHIPS, M=m, L=live, E=e, K=k, N=n, x=pass_
    )  # fmt: skip
    for label, m, live, e, k, n in GROUPED_SHAPES
    for pass_ in ("fwd", "dgrad", "wgrad")
] + [
    Case.make(
        "grouped_fp8_matmul",
        f"Qwen3-30B-A3B {layer} rows={rows}",
        GPU_CHIPS,
        M=rows,
        E=GROUPED_FP8_E,
        K=k,
        N=ns,
    )  # fmt: skip
    for layer, k, ns in GROUPED_FP8_LAYERS
    for rows in GROUPED_FP8_ROWS
]


def predict(op: str, shape: dict, chip: str, label: str = "") -> Prediction:
    """The common interface (``common``) for ``grouped_matmul`` and ``grouped_fp8_matmul``."""
    if op == "grouped_fp8_matmul":
        return predict_grouped_fp8(chip, shape["M"], shape["E"], shape["K"], tuple(shape["N"]),
                                   label=label)  # fmt: skip
    if op != "grouped_matmul":
        raise ValueError(f"perf_model.gpu_grouped: no model for {op}")
    return predict_grouped_bf16(chip, shape["M"], shape["L"], shape["E"], shape["K"], shape["N"],
                                shape["x"], label=label)  # fmt: skip


GROUPED_TILE_CHANGE = "grouped FP8 experts: 128 weight rows per CTA (two compute warpgroups)"
GROUPED_PREFILL_CHANGE = "grouped FP8 prefill: rows stored into y (no gather), wide 128x256 tiles"
GMM_CHANGE = "BF16 grouped gmm: two warpgroups on 128x256 tiles, rows stored into y (no gather)"
TGMM_CHANGE = "BF16 grouped tgmm: two warpgroups on 128x256 tiles, dw written in BF16 (no cast)"


def design_changes() -> list[tuple[str, Prediction, Prediction]]:
    """(change, before, after) on H100 and H200 where ``default_config``'s decode tiles took 128
    weight rows per CTA instead of 64 (every Qwen3-30B-A3B stack's N % 128 == 0), where its
    prefill tiles became the wide 128x256 ones storing their group's rows into y (before:
    128x128 tiles written whole into the tile outputs, then gathered), and where the BF16
    ``gmm`` (the experts' forward and input gradient) went from one warpgroup on 128x128 tiles
    with a gather to two on 128x256 storing rows (``predict_grouped_bf16``'s ``one_wg``), and
    ``tgmm`` from one warpgroup writing an f32 dw that XLA cast to two on 128x256 tiles writing
    BF16 (``one_wg``, ``f32_dw``)."""
    import dataclasses

    from kernels_pallas.fp8_matmul.mgpu_config import MgpuConfig
    from kernels_pallas.grouped_fp8_matmul import pallas_mosaic_gpu as kernel

    out = []
    for layer, k, ns in GROUPED_FP8_LAYERS:
        for rows in GROUPED_FP8_ROWS:
            cfg = kernel.default_config(rows, ns, k, GROUPED_FP8_E)
            label = f"Qwen3-30B-A3B {layer} rows={rows}"
            if cfg.swap_ab:
                change, old, old_ragged = (
                    GROUPED_TILE_CHANGE,
                    dataclasses.replace(cfg, block_n=64),
                    None,
                )
            else:
                change, old, old_ragged = GROUPED_PREFILL_CHANGE, MgpuConfig(128, 128, 4), False
            for chip in GPU_CHIPS:
                before = predict_grouped_fp8(chip, rows, GROUPED_FP8_E, k, ns, label, old,
                                             ragged=old_ragged)  # fmt: skip
                after = predict_grouped_fp8(chip, rows, GROUPED_FP8_E, k, ns, label, cfg)
                out.append((change, before, after))
    for label, m, live, e, k, n in GROUPED_SHAPES:
        for pass_ in ("fwd", "dgrad"):
            for chip in GPU_CHIPS:
                args = (chip, m, live, e, k, n, pass_, f"{label} {pass_}")
                before = predict_grouped_bf16(*args, one_wg=True)
                out.append((GMM_CHANGE, before, predict_grouped_bf16(*args)))
        for chip in GPU_CHIPS:
            args = (chip, m, live, e, k, n, "wgrad", f"{label} wgrad")
            before = predict_grouped_bf16(*args, one_wg=True, f32_dw=True)
            out.append((TGMM_CHANGE, before, predict_grouped_bf16(*args)))
    return out
