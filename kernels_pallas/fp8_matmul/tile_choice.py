"""Which Hopper tile ``fp8_matmul`` runs: the candidates, and the default the model picks.

``candidates``: the tile configs the on-device autotuner chooses among for a shape (swap-AB
decode tiles of 64/128 weight rows x split-K 1-8, one or two 128-K slices a step, the K chunks
summed in the cluster; the prefill tiles 128x256 / 256x128 / 128x128 / 128x64 / 64x64, 2-CTA
clusters, persistent grids, promotions under the wgmmas), each as the support check accepts it.

``dispatch_config``: the tile a call without an explicit config runs. The performance model
ranks every candidate at its shape (FP8 x or raw x quantized once; with ``fused``, the fused
kernel's tiles for raw BF16 x at 16-64 rows, x padded to the row tile) as a GEMM inside a
program (``perf_model.gpu.predict_matmul``: the compiled kernels' SASS instruction counts,
registers and SMEM, calibrated on the H200 run) and takes the fastest that beats the rules' tile
by more than ``MODEL_MARGIN``, calibrated and by the SASS model alone -- the rules' tile
otherwise. So a tile the device has run is left only for a predicted gain well beyond the
model's spread between shapes, and never for one that comes from the calibration's family
factors alone: swap-AB tiles carry the factor measured on decode tiles (1.15), prefill tiles the
one measured at 4096 rows (1.01), and at 16-64 rows that gap alone would make a 64-row prefill
tile beat the decode rules on 5 of 11 rollout GEMM shapes. This is how DeepGEMM picks its block
shape per call (an analytic search over block M/N and stages at run time); here the analysis is
the calibrated model.

The rules were written for one shape family at a time (swap-AB while K splits, 128x256 while
the grid fills, clusters on even grids) and tuned by the model at 16/64 and 4096 rows, where
they mostly stand (up to 64 rows one change: Qwen3-8B q|o_proj at 33-64 rows on the H100, 64x64
swap tiles unsplit, 1.07x). Between, they left SMs idle: over 17 shapes of Qwen3-8B/30B-A3B,
Llama-3-70B and DeepSeek-V3 the rules' tiles were 5-22% slower than the model's best on average
at M = 96-1024 (up to 1.78x: Llama-3-70B k|v_proj at M = 320-384, whose 8 N tiles they ran as 24
CTAs of 128x128); ``perf_model.md``'s design-change table has each change before -> after.

``fused_wins``: whether raw BF16 x at 17-64 rows runs the fused kernel by default
(``api.fused_default``; always at 16 rows): where its dispatch tile beats the ``act_quantize``
launch plus the FP8-x tile by the same margin, calibrated and SASS alone, in a program and
standalone. The fused kernel saves a launch and re-quantizes x in every CTA (issue cycles under
the weight stream): narrow or launch-bound shapes win (k|v_proj, o_proj at 32 and 64 rows),
wide short-K ones lose on the H100 (Qwen3-8B gate+up at 32-64 rows, q|o_proj at 64); the
H200's faster HBM leaves less issue time per weight byte, and there the balance moves per shape.
Rows x would be padded for (17-31, 33-63) stay quantized once: standalone the pad is a launch
as costly as the one saved.

The chip (H100 or H200: the model's HBM bandwidth and clock) comes from the target's device
kind; anything else ranks on the H100's constants. The ranking is pure Python over shapes
(~1-9 ms per shape, cached per shape), reads ``perf_model/sass_profiles.json`` (package data)
and falls back to the rule's tile where the profiles cannot be read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

from kernels_pallas.fp8_matmul import mgpu_config as mc
from kernels_pallas.fp8_matmul.mgpu_config import MgpuConfig, decode_pdl, fused_rows

# a candidate replaces the rule's tile only where the model predicts it this much faster (the
# first device run's decode GEMMs spread 1.01-1.30x around the model's calibrated time, its
# prefill GEMMs 0.99-1.08x: ``perf_model/calibration.py``)
MODEL_MARGIN = 0.95


def chip_of(device_kind: str) -> str:
    """The performance model's chip for a device kind: "h200" for an H200, else "h100"."""
    return "h200" if "h200" in device_kind.lower() else "h100"


def candidates(m: int, n: int, k: int, legal, fused: bool = False,
               pinned: tuple[MgpuConfig, ...] = ()) -> list[MgpuConfig]:  # fmt: skip
    """The tile configs beyond ``pinned`` (the default and its twins) that ``legal`` accepts
    at [M, K] x [N, K], each launched as the default's would be (swap-AB tiles dependent:
    ``MgpuConfig.pdl``), in a fixed order without repeats. ``fused``: raw x runs fused
    (``fused_rows`` tiles)."""
    G = MgpuConfig
    cfgs: list[MgpuConfig] = []
    rows = fused_rows(m) if fused and m <= mc._WGMMA_M else \
        -(-m // mc.SWAP_ROW_ALIGN) * mc.SWAP_ROW_ALIGN  # fmt: skip
    if m <= 256:  # swap-AB: all rows as the wgmma N up to 128, tiles of 64 or 128 above
        bms = [min(rows, 128)] + ([64] if m > 64 else [])
        cfgs += [G(bm, bn, 4, True, split) for bm in bms for bn in (64, 128)
                 for split in (1, 2, 4, 8)]  # fmt: skip
        # two 128-K slices per step (4 stages, or 3 where 4 do not fit)
        cfgs += [next((c for c in (dataclasses.replace(c1, k_slices=2, max_concurrent_steps=st)
                                   for st in (4, 3)) if legal(c)), c1)
                 for c1 in list(cfgs)]  # fmt: skip
        # the K chunks summed in the cluster (DSMEM), 3 stages where 4 do not fit
        for c in [c for c in (*pinned[1:], *cfgs) if c.split_k > 1]:
            c4, c3 = (dataclasses.replace(c, cluster_k=True, max_concurrent_steps=st)
                      for st in (4, 3))  # fmt: skip
            cfgs.append(c4 if legal(c4) else c3)
        cfgs += [G(min(64, rows), 64, 4, True), G(64, 128, 4)]
    cfgs += [G(128, 256, 3, cluster_m=2), G(128, 256, 3), G(256, 128, 3)]
    cfgs += [G(128, 128, 4, cluster_m=2), G(128, 128, 4), G(128, 64, 4), G(64, 64, 6)]
    if m > 64:  # prefill: each tile also as a persistent grid of one CTA per SM (snake order)
        cfgs += [dataclasses.replace(c, persistent=mc.NUM_SMS) for c in cfgs
                 if not c.swap_ab and c.block_m >= 128]  # fmt: skip
        # and the one-sub-tile tiles with their promotions under the wgmmas (3 stages)
        cfgs += [G(bm, bn, 3, cluster_m=cl, overlap=True) for bm, bn in ((128, 128), (128, 64))
                 for cl in (2, 1)]  # fmt: skip
    # every swap-AB tile launched as the default's is (dependent: ``MgpuConfig.pdl``), so
    # the timer compares tiles; the launch itself is judged by the benchmark's wall clock
    # (``bench_matmul``'s ``:nopdl`` arm), which sees the gaps CUPTI leaves out
    cfgs = [dataclasses.replace(c, pdl=c.swap_ab and decode_pdl()) for c in cfgs]
    return [c for c in dict.fromkeys(cfgs) if c not in pinned and legal(c)]


def name(cfg: MgpuConfig) -> str:
    """The autotuner's name of a Pallas tile (``pallas_mosaic_gpu:128x128x4s/k2c/s2`` ...)."""
    s = f"pallas_mosaic_gpu:{cfg.block_m}x{cfg.block_n}x{cfg.max_concurrent_steps}"
    s += f"s/k{cfg.split_k}" if cfg.swap_ab else ""
    s += "c" if cfg.cluster_k else ""
    s += f"/s{cfg.k_slices}" if cfg.k_slices > 1 else ""
    s += f"/c{cfg.cluster_m}" if cfg.cluster_m > 1 else ""
    s += f"/p{cfg.persistent}" if cfg.persistent else ""
    s += "/o" if cfg.overlap else ""
    return s


def ranked(m: int, n: int, k: int, *, fused: bool = False, out_itemsize: int = 2,
           chip: str = "h100") -> list[tuple[float, MgpuConfig]]:  # fmt: skip
    """(predicted seconds inside a program, tile) of the rule's tile and every legal candidate
    at [M, K] x [N, K], fastest first (ties: the rule's tile, then the candidates' order): for
    FP8 x (quantized once), or with ``fused`` for raw BF16 x quantized in-kernel (the fused
    kernel's tiles, x padded to the row tile where M is not a multiple of it). Raises
    ``OSError`` where the SASS profiles cannot be read."""
    from kernels_pallas.perf_model import gpu

    gpu.load_profiles()  # OSError here, before any rule is judged without its profiles

    def legal(c: MgpuConfig) -> bool:
        return mc.supports(m, k, n, c, fused=fused, x_itemsize=2 if fused else 1,
                           out_itemsize=out_itemsize) is None  # fmt: skip

    rule = mc.default_config(m, n, k, fused=fused, out_itemsize=out_itemsize)
    out = []
    for i, c in enumerate([rule, *candidates(m, n, k, legal, fused, pinned=(rule,))]):
        try:
            t = _predicted(chip, m, n, k, c, fused)
        except KeyError:  # no SASS profile of this tile's family: never chosen
            continue
        out.append((t, i, c))
    return [(t, c) for t, _, c in sorted(out, key=lambda e: e[:2])]


def _predicted(chip: str, m: int, n: int, k: int, cfg: MgpuConfig, fused: bool) -> float:
    """The model's time of ``cfg`` inside a program: FP8 x, or raw x through the fused kernel."""
    from kernels_pallas.perf_model import gpu

    x, mode = ("bf16", "fused") if fused else ("fp8", "default")
    return gpu.predict_matmul(chip, m, n, k, x, mode=mode, config=cfg, in_program=True).time_s


def dispatch_config(m: int, n: int, k: int, *, fused: bool = False, out_itemsize: int = 2,
                    chip: str = "h100") -> MgpuConfig:  # fmt: skip
    """The tile ``fp8_matmul`` runs at [M, K] x [N, K] without an explicit config (module
    docstring): the model's fastest candidate where it beats ``mgpu_config.default_config``'s
    tile by ``MODEL_MARGIN`` (calibrated and SASS alone), else that tile; ``fused``: among the
    fused kernel's tiles (raw BF16 x quantized in-kernel)."""
    return _dispatch(m, n, k, fused, out_itemsize, chip, decode_pdl())


@functools.lru_cache(maxsize=4096)
def _dispatch(m: int, n: int, k: int, fused: bool, out_itemsize: int, chip: str,
              pdl: bool) -> MgpuConfig:  # fmt: skip
    """``dispatch_config``, cached per shape and per ``FP8RL_PDL`` (the launch is in the key)."""
    del pdl  # read by default_config and candidates through decode_pdl()
    rule = mc.default_config(m, n, k, fused=fused, out_itemsize=out_itemsize)
    if fused and m > mc._WGMMA_M:  # the fused prefill tiles run only with an explicit config
        return rule
    try:
        order = ranked(m, n, k, fused=fused, out_itemsize=out_itemsize, chip=chip)
    except OSError:  # the profiles are not there (a broken install): the rules alone
        return rule
    t_rule = next((t for t, c in order if c == rule), None)
    if t_rule is None:  # the rules' tile has no profile: the model's fastest
        return order[0][1]
    raw_rule = _sass_alone(chip, m, n, k, rule, fused)
    for t, cfg in order:  # the fastest that wins calibrated and by the SASS model alone
        if t >= MODEL_MARGIN * t_rule:
            break
        if _sass_alone(chip, m, n, k, cfg, fused) < MODEL_MARGIN * raw_rule:
            return cfg
    return rule


def fused_wins(m: int, n: int, k: int, *, out_itemsize: int = 2, chip: str = "h100") -> bool:
    """Whether raw BF16 x [M, K] with ``FUSED_DECODE_ROWS`` < M <= 64 runs the fused kernel by
    default (``api.fused_default``): its dispatch tile (``dispatch_config(fused=True)``, x
    padded to the row tile) beats quantizing x once (the ``act_quantize`` launch, then the
    dispatch tile for FP8 x) by ``MODEL_MARGIN`` calibrated and by the SASS model alone, both
    inside a program (x's padding fused into its producer, split-K sums into the consumer) and
    standalone (each a launch of its own; ``raw_x_times``). False where the profiles cannot be
    read (the rules: quantize once)."""
    if not mc.FUSED_DECODE_ROWS < m <= mc._WGMMA_M:
        return False
    return _fused_wins(m, n, k, out_itemsize, chip, decode_pdl())


@functools.lru_cache(maxsize=4096)
def _fused_wins(m: int, n: int, k: int, out_itemsize: int, chip: str, pdl: bool) -> bool:
    del pdl  # read by the dispatch through decode_pdl()
    try:
        (_, fused), (_, once) = raw_x_times(m, n, k, out_itemsize=out_itemsize, chip=chip)
    except (OSError, KeyError):  # no profiles, or none of a tile's family: quantize once
        return False
    return all(t_fused < MODEL_MARGIN * t_once for t_fused, t_once in zip(fused, once))


# the four predictions ``fused_wins`` judges each path by: (inside a program, calibrated)
RAW_X_COLUMNS = ((True, True), (True, False), (False, True), (False, False))


def raw_x_times(m: int, n: int, k: int, *, out_itemsize: int = 2, chip: str = "h100"):
    """((fused tile, seconds), (FP8-x tile, seconds)) for raw BF16 x [M, K]: the fused kernel on
    its dispatch tile, and ``act_quantize`` + the QArray kernel on the FP8-x dispatch tile, each
    predicted in ``RAW_X_COLUMNS``. Raises ``OSError`` without the SASS profiles."""
    from kernels_pallas.perf_model import calibration, gpu

    gpu.load_profiles()
    out = []
    for fused, mode in ((True, "fused"), (False, "qarray")):
        cfg = dispatch_config(m, n, k, fused=fused, out_itemsize=out_itemsize, chip=chip)
        times = []
        for in_program, calibrated in RAW_X_COLUMNS:
            with contextlib.nullcontext() if calibrated else calibration.uncalibrated():
                times.append(gpu.predict_matmul(chip, m, n, k, "bf16", mode=mode, config=cfg,
                                                in_program=in_program).time_s)  # fmt: skip
        out.append((cfg, tuple(times)))
    return tuple(out)


def _sass_alone(chip: str, m: int, n: int, k: int, cfg: MgpuConfig, fused: bool = False) -> float:
    """The predicted time without the device run's per-family factors (``KERNEL_CALIBRATION``:
    swap-AB tiles 1.15, measured at 16/64 rows; prefill tiles 1.01, measured at 4096)."""
    from kernels_pallas.perf_model import calibration

    with calibration.uncalibrated():
        return _predicted(chip, m, n, k, cfg, fused)
