"""GPU half of the performance model: Mosaic GPU kernels on H100 / H200, from their SASS.

Per kernel variant, ``profile_gpu.py`` records (deviceless H100 compile, ptxas, cuobjdump) the
registers, SMEM and the instruction counts of the compute warpgroup's main loop and of the TMA
warpgroup's loop (``kernels_pallas/perf_model/sass_profiles.json``). Per shape this module then
predicts, for one SM holding ``c`` CTAs that each advance one loop iteration ("step"):

  step = max(MMA, issue, chain, L2, latency) cycles, where
    MMA     = c x (warpgroup MMA FLOPs of the step) / (tensor FLOP per clock per SM);
    issue   = c x (instructions per warp of every warpgroup sharing a scheduler) / ISSUE_EFF;
              a warpgroup's 4 warps sit on the 4 schedulers, so each scheduler issues one warp
              of every warpgroup of every resident CTA; the TMA warpgroup's share is its loop
              body per K step (ptxas unrolls that loop: ``tma_step_instructions``);
    chain   = one warpgroup's serial path: the MMAs of its CTA's nwg compute warpgroups +
              WGMMA_LATENCY per ``wgmma_wait``, under which the instructions issued while its
              MMAs run hide (``under_mma``: the promotion of ``MgpuConfig.overlap``), + its
              other instructions (the kernels wait for each step's MMA before using it). The
              CTA's warpgroups' MMAs count in full because the warpgroups run in step: they wait
              for the same TMA barrier at the first step (and whenever the ring runs dry), and
              the SM's tensor cores interleave their wgmmas, so each one's group completes only
              with the other's, and no MMA runs under their waits and promotions. Nothing
              fitted: it reproduces the first device run's prefill steps (128x256 tiles, 2
              warpgroups of two 64x128 sub-tiles: ~1,650 cycles modelled, 1,600-1,730 measured
              over 5 shapes; one chain at a time would give ~1,180);
    L2      = c x (bytes the step's TMA loads move) / (L2 bandwidth per SM);
    smem    = c x (bytes the step moves through SMEM by ordinary loads/stores, e.g. the FP8 ->
              f16 upcast of attention tiles) / 128 B per clock (wgmma operand reads excluded);
    latency = (DRAM_LATENCY + chain) / stages: a ring slot is refilled only once the step
              that read it is done (``emit_pipeline`` issues step i + stages' load after step
              i's body; the warp-specialized pipeline after the consumer releases the slot),
              so each slot turns over once per load round trip plus one step's compute, and
              ``stages`` slots share that cycle (Little's law);
  CTAs per SM = min by registers (65536 / (regs x threads)), SMEM (228 KiB) and 32;
  waves = the grid spread over 132 SMs x CTAs per SM (the last wave with fewer CTAs per SM);
  time = max(FILL + sum over waves of steps x step + (waves - 1) x WAVE,
             HBM bytes / (BW x HBM_EFF) + FILL) + LAUNCH:
         FILL is the kernel's fixed cost (grid start, its first loads' round trip before any
         streaming, its last tiles' epilogue and store after it), paid once, also by a kernel
         streaming at the HBM bound; WAVE what each later wave adds (a finished CTA's
         successor on the SM waits one load round trip for its first tiles: ``DRAM_LATENCY_S``).

A kernel launched dependent (the decode GEMMs, ``MgpuConfig.pdl``, and the decode and paged
attention kernels: ``kernels_pallas/dependent_launch``) pays ``PDL_LAUNCH_S`` instead of
``LAUNCH_S``: its grid starts as its predecessor's CTAs exit, and only the predecessor's flush
is left between them (an assumption until a device measures it: ``bench_matmul``'s ``:nopdl``
arm, by the wall clock). Rows of the first device run launched plainly.

A persistent grid (``MgpuConfig.persistent``: P CTAs looping over the output tiles) runs the
same rounds of at most P tiles, paying ``TILE_SWITCH_S`` between its tiles: the pipeline
(``emit_pipeline_warp_specialized`` without ``pipeline_state``) lets the TMA warpgroup issue
the next tile's first loads only once the compute warpgroups consumed the current tile's last K
step, so one load round trip (``DRAM_LATENCY_S``) separates the tiles and the epilogue
(registers -> SMEM, TMA store issue: ~0.2 us) runs under it: the same cost as a new CTA's, so
the model sees a persistent grid of one CTA per SM at the speed of the plain grid (the first
device run's prefill rows: ``WAVE_S``). The snake tile order is assumed to keep HBM bytes at
one read per operand, which the model already assumes for every grid (the non-persistent grid
runs M-fastest, the same order at these shapes).

Split-K decode tiles sum their K chunks after the kernel (an XLA fusion over f32 partials: their
HBM bytes, plus a launch for a standalone call) or, with ``MgpuConfig.cluster_k``, inside their
CTA cluster: per wave, the CTA summing a warpgroup tile waits for the other chunks' f32
accumulators over the SM-to-SM network (``DSMEM_LATENCY_S`` + the bytes at its 1/132 share of
``DSMEM_BYTES_PER_S``), with no partials in HBM and no launch.

Baselines are not our code, so they get a stated efficiency from published measurements:
BF16 ``jnp.dot`` (cuBLAS / XLA Triton GEMM) ``BF16_GEMM_EFF`` of dense peak when compute-bound
and ``BF16_GEMM_BW_EFF`` of HBM when memory-bound, then timed on its own plus the per-kernel
``FILL_S`` our kernels pay (the first device run's cuBLAS rows at M = 16-64 say so:
``bf16_gemm_s``); BF16-cache decode attention ``gpu_attention.BF16_ATTN_BW_EFF`` of HBM (the
attention kernels' model: ``gpu_attention.py``). Assumptions (each
a constant below) are the model's knobs; the first device run (H200, ``scripts/gpu_check.sh``
prints measured beside predicted) confirmed the baselines' and scaled our FP8 kernels' times by
measured factors (``KERNEL_CALIBRATION``).
"""

from __future__ import annotations

import dataclasses
import math

# the measured factors on our FP8 kernels' times (re-exported: gpu.KERNEL_CALIBRATION & co.)
from kernels_pallas.perf_model.calibration import (  # noqa: F401
    KERNEL_CALIBRATION,
    calibration,
    uncalibrated,
)
from kernels_pallas.perf_model.common import CHIPS, GPU_CHIPS, Prediction  # noqa: F401 (gpu.GPU_CHIPS)
from kernels_pallas.perf_model.sass_profiles import (  # noqa: F401  (gpu.load_profiles & co.)
    SASS_JSON,
    load_profiles,
    nearest_profile,
    tma_step_instructions,
)

# --- assumptions (cycles at the 1.83 GHz tensor clock) -------------------------------------
ISSUE_EFF = 0.7  # fraction of cycles a scheduler issues in ALU-heavy loop code (stalls, waits)
WGMMA_LATENCY = 128  # cycles from the last wgmma issue to wgmma_wait(0) returning; Luo et al.
# 2024, "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture" (arXiv 2402.13499),
# measure ~128 cycles for m64n128 wgmma
# Fitted to the first device run (H200, 2026-12-04; ``calibration.fit``): the loaded HBM latency
# a TMA load sees (unloaded ~0.5 us, ibid.; the model took 0.8 us before the run) and the fixed
# cost per wave of a kernel (its first loads' round trip, CTA launch and setup, the epilogue's
# store and the grid's tail; 1 us before). With them the decode GEMMs' measured / modelled spread
# went from 1.28-2.56 (12 shapes, coefficient of variation 0.19) to 1.00-1.31 (0.09). cuBLAS's
# BF16 GEMMs at M = 16 in the same run give an independent check of the fill: 4.3 us intercept
# of time against bytes (slope 4.37 TB/s, 91% of HBM peak).
DRAM_LATENCY_S = 1.0e-6
# L2 -> SMEM bandwidth over all SMs: the least certain knob (Chips and Cheese measure ~5.5-7
# TB/s with plain loads; FP8 128x128 tiles at the full MMA rate would need ~15 TB/s). A lower
# bound from the first device run: its one prefill GEMM on 128x64 tiles (DeepSeek-V3 N = 2112,
# 2-CTA clusters, M = 4096) moved 8.9 TB/s from L2 into the SMs' TMA buffers (21 KB per CTA per
# K step, 0.31 us a step, 132 SMs); with 7 TB/s (the guess until then) the model made it 25%
# slower than measured, with 9 TB/s 1% faster.
L2_BYTES_PER_S = 9.0e12
L2_BYTES_PER_CLK_PER_SM = 64  # one SM's L2 port (A100-era figure), binds when few SMs run
HBM_EFF = 0.9  # best streaming fraction of HBM peak (STREAM-like copies reach ~90-93%)
FILL_S = 4.0e-6  # per kernel: grid start, first TMA round trip, last epilogue (fitted, above)
# Each later wave of a non-persistent grid: the new CTA's first load round trip. Fitted to the
# same run's prefill GEMMs (``calibration.fit_waves``: 6 shapes of 4-12 waves and 32-128 K
# steps): a per-wave cost of 0.5-1 us leaves their measured / modelled ratios spread least,
# 0.99-1.08 at 1 us (coefficient of variation 0.034), 4 us (the fill again, the model until
# then) 0.87-1.03 (0.054): with it the ratio grew with K, the sign of a per-step cost that the
# model missed then (the warpgroups in step, ``step_cycles``), not of a per-wave one.
WAVE_S = DRAM_LATENCY_S
TILE_SWITCH_S = DRAM_LATENCY_S  # persistent grid, between a CTA's tiles (module docstring)
LAUNCH_S = 2.0e-6  # per kernel (or XLA fusion): launch and grid start; baselines pay it too
# A kernel launched dependent (``MgpuConfig.pdl``: the decode GEMMs) starts its grid as its
# predecessor's CTAs exit and waits (griddepcontrol.wait) for the predecessor's completion and
# memory flush, so of the gap between two kernels, which ``LAUNCH_S`` stands for, it pays only
# that flush: assumed 0.5 us, not yet measured (``bench_matmul``'s ``:nopdl`` arm, wall clock,
# measures it). The weight prefetch it issues before the wait is not credited: with the
# predecessor's CTAs gone, the wait is too short for a load round trip to hide under it.
PDL_LAUNCH_S = 0.5e-6
# per predicate the host reads (a data-dependent while's, a conditional's branch index: XLA's GPU
# runtime copies it to the host and waits): the small copy's round trip (~5 us) plus the next
# launch from an idle GPU (~5 us). Zero if XLA runs the loop as a command buffer with device-side
# conditional nodes: the first device run tells (scripts/gpu_check.sh).
HOST_SYNC_S = 10.0e-6
REGS_PER_SM, MAX_CTAS_PER_SM, SMEM_PER_SM = 65536, 32, 233472
SMEM_BYTES_PER_CLK = 128  # per SM, ordinary shared loads/stores (32 banks x 4 B)
BF16_GEMM_EFF = 0.70  # XLA/cuBLAS BF16 GEMM at large M: ~600-750 TFLOP/s of 989 on H100 SXM
# (reference/kernels_wave3.md; NVIDIA's H100 cuBLAS GEMM plots reach ~750 at 8192^3)
BF16_GEMM_BW_EFF = 0.80  # memory-bound BF16 GEMM (decode M <= 64): Marlin (Frantar et al. 2024,
# arXiv 2408.11743) reports cuBLAS FP16 small-batch GEMMs close to but below the HBM roofline
ELEMENTWISE_BW_EFF = 0.85  # an XLA elementwise fusion (the residual add after a projection)
QUANT_BW_EFF = 0.70  # per-token quantization (the act_quantize kernel, XLA's fusions): the H200's
# device copy measured 3,369 of 4,800 GB/s (gpu_h200_2026-12-04/run1/bench_decode), and XLA's
# quantization at M = 4096 ran at 2.7-3.0 TB/s over its bytes (``calibration.quantize_check``)
XLA_QUANT_LAUNCHES = 3  # amax fusion, scale + transpose fusion, cast fusion (the H100 compile)
# The SM-to-SM network (``MgpuConfig.cluster_k``: split-K chunks summed in the cluster): Luo et
# al. 2024 (arXiv 2402.13499) measure ~180 cycles of latency and ~3.3 TB/s over the whole GPU for
# 2-CTA clusters; one SM receiving gets its 1/132 share (the safe side), and a sum pays the
# latency twice (the store, the mbarrier wake-up).
DSMEM_BYTES_PER_S = 3.3e12
DSMEM_LATENCY_S = 2 * 180 / CHIPS["h100"].clock_hz


def _tensor_flops_per_clk(chip, fp8: bool) -> float:
    c = CHIPS[chip]
    return (c.fp8_flops_per_s if fp8 else c.bf16_flops_per_s) / c.cores / c.clock_hz


@dataclasses.dataclass(frozen=True)
class Loop:
    """What one CTA does per step of its main loop (inputs of the step formula)."""

    nwg: int  # compute warpgroups (each has its own main loop)
    threads: int  # per CTA
    wg_flops: float  # MMA FLOPs of one warpgroup per step
    fp8: bool  # FP8 tensor rate (else f16/bf16)
    waits: int  # wgmma_wait(0) per step on a warpgroup's serial path
    step_bytes: int  # TMA bytes per step (L2 -> SMEM)
    stages: int
    smem_bytes: int = 0  # ld/st.shared bytes per step outside wgmma (upcast copies)
    load_latency_s: float | None = None  # the load round trip its ring sees (None: DRAM_LATENCY_S)


def step_cycles(chip: str, loop: Loop, prof: dict, c: int, active_sms: int) -> dict:
    """Cycles for ``c`` co-resident CTAs to each advance one step, with the terms."""
    rate = _tensor_flops_per_clk(chip, loop.fp8)
    main = prof["main_loop"]
    tma = prof["tma_step"] if "tma_step" in prof else tma_step_instructions(prof)
    mma_wg = loop.wg_flops / rate
    per_sched = loop.nwg * main["total"] + (tma or 0.0)
    clk = CHIPS[chip].clock_hz
    l2_per_sm = min(L2_BYTES_PER_S / active_sms, L2_BYTES_PER_CLK_PER_SM * clk)
    # a warpgroup's serial path per step: its CTA's warpgroups' MMAs in turn (they run in
    # step: module docstring) and a wgmma latency per wait, under which the instructions issued
    # while its MMA group runs hide (``under_mma``), then the rest of its loop
    under = main.get("under_mma", 0)
    chain = max(loop.nwg * mma_wg + loop.waits * WGMMA_LATENCY, under / ISSUE_EFF) + \
        (main["total"] - main["mma"] - under) / ISSUE_EFF  # fmt: skip
    terms = dict(
        mma=c * loop.nwg * mma_wg,
        issue=c * per_sched / ISSUE_EFF,
        chain=chain,
        l2=c * loop.step_bytes / l2_per_sm * clk,
        smem=c * loop.smem_bytes / SMEM_BYTES_PER_CLK,
        latency=((loop.load_latency_s or DRAM_LATENCY_S) * clk + chain) / loop.stages,
    )
    return terms


def ctas_per_sm(prof: dict, threads: int) -> int:
    by_regs = REGS_PER_SM // (prof["registers"] * threads)
    by_smem = SMEM_PER_SM // max(prof["smem_bytes"] + 1024, 1)  # + the CTA's reserved 1 KiB
    return max(1, min(by_regs, by_smem, MAX_CTAS_PER_SM))


def grid_time(chip: str, loop: Loop, prof: dict, ctas: int, steps: int,
              persistent: int = 0) -> tuple[float, dict]:  # fmt: skip
    """Seconds for ``ctas`` tiles of ``steps`` steps each, wave by wave, and the bound: one CTA
    per tile, or (``persistent``) that many CTAs taking the tiles in rounds."""
    sms, clk = CHIPS[chip].cores, CHIPS[chip].clock_hz
    c_max = ctas_per_sm(prof, loop.threads)
    grid = min(persistent, ctas) if persistent else ctas
    if persistent:  # the grid's CTAs all resident at once: at most c_max per SM
        c_max = min(c_max, math.ceil(grid / sms))
    switch = TILE_SWITCH_S if persistent else WAVE_S  # before each wave (round) but the first
    total, left, first = FILL_S - switch, ctas, None
    while left > 0:
        c = min(c_max, math.ceil(min(left, grid) / sms))
        terms = step_cycles(chip, loop, prof, c, min(sms, left))
        first = first or dict(terms, ctas_per_sm=c)
        total += steps * max(terms.values()) / clk + switch
        left -= c * sms
    waves = math.ceil(ctas / (sms * c_max))
    return total, dict(first, waves=waves, ctas=grid, tiles=ctas, ctas_per_sm_max=c_max)


def finish(op, label, chip, impl, t_compute, terms, hbm_bytes, flops, base, base_s, extra_s=0.0,
           scale=1.0, launch_s=LAUNCH_S):  # fmt: skip
    """The prediction: ``scale`` (``calibration``) x the kernel's max(compute, HBM) time, then
    its launch (``launch_s``) and ``extra_s`` (epilogue fusions, quantization) on top."""
    t_hbm = hbm_bytes / (CHIPS[chip].hbm_bytes_per_s * HBM_EFF) + FILL_S
    t = scale * max(t_compute, t_hbm) + launch_s + extra_s
    bound = "hbm" if t_hbm >= t_compute else max(
        ("mma", "issue", "chain", "l2", "smem", "latency"), key=lambda k: terms.get(k, 0)
    )  # fmt: skip
    terms = dict(
        terms,
        compute_s=t_compute,
        hbm_s=t_hbm,
        extra_s=extra_s,
        calibration=scale,
        launch_s=launch_s,
    )
    return Prediction(op, label, chip, impl, t, base, base_s, bound, terms, int(hbm_bytes),
                      int(flops))  # fmt: skip


def hbm_ceiling(p: Prediction) -> float:
    """BF16 / FP8 at ``p``'s shape if the FP8 call were its kernel alone streaming its HBM bytes:
    ``HBM_EFF`` of peak, plus the per-kernel fixed cost (``FILL_S``, scaled by the kernel's
    calibration) and its launch; no quantization, epilogue or compute time. No tile, split or
    fusion of the quantization beats it under the model's constants, so a memory-bound target
    missed below it is missed by those constants, not by a kernel's design."""
    t = p.terms
    return p.baseline_s / (t["calibration"] * t["hbm_s"] + t["launch_s"])


# --- fp8_matmul -----------------------------------------------------------------------------


def bf16_gemm_s(chip: str, m: int, n: int, k: int, fill: bool = True) -> float:
    """XLA BF16 ``jnp.dot`` [M, K] x [K, N] at the stated efficiencies. Memory-bound, a GEMM
    timed on its own pays the per-kernel ``FILL_S`` as ours do: the first device run's cuBLAS
    GEMMs at M = 16-64 took 0.95-1.79x the model without it (median 1.26, coefficient of
    variation 0.19) and 0.89-1.24x with it (median 0.95, 0.11; ``calibration --fit``,
    ``baseline_fill``), its M = 4096 ones (compute-bound) 0.93-1.02x either way.
    ``fill=False``: inside a program (``gpu_rollout``), whose measured BF16 step the model
    already puts 11% slow without it."""
    return bf16_kernel_s(chip, 2 * m * n * k, 2 * (m * k + n * k + m * n), fill)


def bf16_kernel_s(chip: str, flops: float, nbytes: float, fill: bool = True) -> float:
    """A BF16 GEMM kernel of ``flops`` over ``nbytes`` of HBM traffic at the stated cuBLAS
    efficiencies (``bf16_gemm_s``), one launch."""
    c = CHIPS[chip]
    t_mma = flops / (c.bf16_flops_per_s * BF16_GEMM_EFF)
    t_bw = nbytes / (c.hbm_bytes_per_s * BF16_GEMM_BW_EFF)
    return max(t_mma, t_bw + (FILL_S if fill else 0.0)) + LAUNCH_S


def add_fusion_s(chip: str, m: int, n: int) -> float:
    """An XLA elementwise fusion over a BF16 [M, N] output and one [M, N] operand (the residual
    add that consumes a projection): two reads and a write, one launch."""
    return 3 * m * n * 2 / (CHIPS[chip].hbm_bytes_per_s * ELEMENTWISE_BW_EFF) + LAUNCH_S


def pad_s(chip: str, m: int, rows: int, k: int, launch: bool = True) -> float:
    """BF16 x [M, K] padded with zero rows to [rows, K] (``jnp.pad``: an XLA fusion, its launch
    unless inside a program, where it fuses into x's producer)."""
    nbytes = (m + rows) * k * 2
    return nbytes / (CHIPS[chip].hbm_bytes_per_s * ELEMENTWISE_BW_EFF) + (LAUNCH_S if launch else 0)


def quantize_s(chip: str, m: int, k: int, impl: str = "kernel") -> float:
    """Per-token 1x128 quantization of BF16 x [M, K]. ``impl="kernel"``: ``act_quantize``'s one
    launch, x read once, FP8 values and scales written; ``"xla"``: ``quantize_activations`` as
    XLA compiles it (``XLA_QUANT_LAUNCHES``: x read by the amax fusion and again by the cast
    fusion, the scales written, read and written transposed)."""
    x, q, sc = m * k * 2, m * k, m * (k // 128) * 4
    nbytes, launches = (x + q + sc, 1) if impl == "kernel" else (2 * x + q + 3 * sc,
                                                                 XLA_QUANT_LAUNCHES)  # fmt: skip
    return nbytes / (CHIPS[chip].hbm_bytes_per_s * QUANT_BW_EFF) + launches * LAUNCH_S


def _variant_name(cfg, fused: bool) -> str:
    if fused:  # in-kernel quantization of BF16 x (decode: swap-AB tiles)
        return f"mm_fused{'_swap' if cfg.swap_ab else ''}_{cfg.block_m}x{cfg.block_n}"
    if cfg.swap_ab:
        return f"mm_swap_{cfg.block_m}x{cfg.block_n}"
    cluster = f"_c{cfg.cluster_m}" if cfg.cluster_m > 1 else ""
    tail = ("_p" if cfg.persistent else "") + ("_o" if getattr(cfg, "overlap", False) else "")
    return f"mm_qarray_{cfg.block_m}x{cfg.block_n}{cluster}{tail}"


def mm_loop(cfg, fused: bool) -> Loop:
    """The step of a Hopper FP8 GEMM tile (``MgpuConfig``; the dense kernel's, which the grouped
    kernel shares): a compute warpgroup's tile per step is 64 rows, or 128 rows / 256 columns
    for the wide tiles, whose sub-tiles each wait for their own wgmma (``wg_subtiles``)."""
    b_blk = cfg.block_m if cfg.swap_ab else cfg.block_n
    wg_rows = 64 if cfg.swap_ab else cfg.block_m // cfg.num_compute_wgs
    x_b, kb = 2 if fused else 1, getattr(cfg, "k_block", 128)  # K per step: 256 with overlap
    return Loop(
        nwg=cfg.num_compute_wgs, threads=128 * (cfg.num_compute_wgs + 1),
        wg_flops=2 * wg_rows * b_blk * kb, fp8=True, waits=len(cfg.wg_subtiles) * kb // 128,
        # a weight tile multicast to a cluster of CTAs is read from L2 once for all of them
        step_bytes=(cfg.block_m * x_b + cfg.block_n // cfg.cluster_m) * kb
        + cfg.block_m * 4 * kb // 128,
        stages=cfg.max_concurrent_steps,
    )  # fmt: skip


def matmul_kernel(chip: str, m: int, n: int, k: int, cfg, fused: bool, profs=None,
                  epilogue_launch: bool = True):  # fmt: skip
    """(kernel seconds, epilogue seconds, terms, variant) of the Hopper fp8_matmul kernel at
    this config (BF16 out). The epilogue is the XLA fusion that sums split-K partials (written
    as yᵀ and transposed by it; unsplit swap-AB tiles write y), serial after the kernel: the
    partials' bytes always, its launch unless ``epilogue_launch=False`` (in a program XLA fuses
    it into the consumer, the residual add or SiLU product, which the BF16 program runs too)."""
    profs = profs or load_profiles()
    name = _variant_name(cfg, fused)
    split = getattr(cfg, "split_k", 1)
    in_cluster = split > 1 and getattr(cfg, "cluster_k", False)
    ks = getattr(cfg, "k_slices", 1)
    sl = f"_s{ks}" if ks > 1 else ""
    key = name + (f"_k{split}" if split > 1 else "")
    prof = profs.get(key + "c" + sl) if in_cluster else None
    own = prof is not None
    if prof is None:  # several slices a step: a loop of as many (KeyError if none profiled:
        prof = nearest_profile(key + sl, profs)  # ``tuning._model_ranked`` ranks those last)
    if in_cluster and not own:  # same K loop; the SMEM of the received accumulators, no f32
        from kernels_pallas.fp8_matmul.mgpu_config import smem_bytes  # partial tile

        prof = dict(prof, smem_bytes=smem_bytes(cfg, k, 1, 2, False))
    name += f" k_slices={ks}" if sl else ""
    loop, kb = mm_loop(cfg, fused), getattr(cfg, "k_block", 128)  # K per step: 256 with overlap
    cl = getattr(cfg, "cluster_m", 1)  # M is padded to whole clusters
    ctas = math.ceil(m / (cfg.block_m * cl)) * cl * (n // cfg.block_n) * split
    t, terms = grid_time(chip, loop, prof, ctas, k // kb // split, cfg.persistent)
    epilogue = 0.0
    if in_cluster:  # per wave, the CTA summing a warpgroup tile receives the others' chunks
        owned = math.ceil(cfg.num_compute_wgs / split)
        recv = (split - 1) * owned * 64 * cfg.block_m * 4
        per_sm = DSMEM_BYTES_PER_S / CHIPS[chip].cores
        epilogue += terms["waves"] * (DSMEM_LATENCY_S + recv / per_sm)
        name += f" split_k={split} in-cluster"
    elif split > 1:  # the XLA sum of the f32 partials [split, N, M_pad]
        m_pad = math.ceil(m / cfg.block_m) * cfg.block_m
        epilogue += (split + 1) * n * m_pad * 4 / CHIPS[chip].hbm_bytes_per_s
        epilogue += LAUNCH_S if epilogue_launch else 0.0
        name += f" split_k={split}"
    terms = dict(terms, registers=prof["registers"], smem_alloc=prof["smem_bytes"])
    return t, epilogue, terms, name


def predict_matmul(chip: str, m: int, n: int, k: int, x: str = "bf16", *, mode: str = "default",
                   label: str = "", split_k: int | None = None, config=None,
                   in_program: bool = False, quant: str = "kernel") -> Prediction:  # fmt: skip
    """fp8_matmul on a Hopper GPU. ``x``: how activations arrive ("bf16" pays quantization:
    the one-launch ``act_quantize`` kernel, or with ``quant="xla"`` XLA's fusions, what
    ``fp8_matmul`` ran above 256 rows until the kernel took every M). ``mode``:
    "default" (what ``api.fp8_matmul`` dispatches today), "fused" (in-kernel quantization),
    "qarray" (quantize once, then the QArray kernel). ``in_program``: inside a program whose
    launches are counted (``gpu_rollout``), so no launch for the output's epilogue fusion."""
    from kernels_pallas.fp8_matmul import api, tile_choice

    if mode == "default":
        fused = x == "bf16" and api.fused_default(m, n, k, chip)
    else:
        fused = mode == "fused" and x == "bf16"
    cfg = config or tile_choice.dispatch_config(m, n, k, fused=fused, chip=chip)
    if split_k is not None and cfg.swap_ab:
        cfg = dataclasses.replace(cfg, split_k=split_k)
    t, epilogue, terms, name = matmul_kernel(chip, m, n, k, cfg, fused,
                                             epilogue_launch=not in_program)  # fmt: skip
    pdl = getattr(cfg, "pdl", False)  # after a kernel in a program, or a quantize kernel
    name += " pdl" if pdl else ""
    quant_s = quantize_s(chip, m, k, quant) if (x == "bf16" and not fused) else 0.0
    if fused and m % cfg.block_m:  # the fused kernel reads raw x padded to its row tile
        quant_s = pad_s(chip, m, -(-m // cfg.block_m) * cfg.block_m, k, launch=not in_program)
    out_b = 2
    hbm = (m * k * (2 if fused else 1) + n * k + m * n * out_b + (n // 128) * (k // 128) * 4
           + (0 if fused else m * (k // 128) * 4))  # fmt: skip
    impl = name + ("" if not quant_s else " + pad" if fused else " + quantize kernel"
                   if quant == "kernel" else " + XLA quantize")  # fmt: skip
    base = f"XLA BF16 jnp.dot ({BF16_GEMM_EFF:.0%} of peak / {BF16_GEMM_BW_EFF:.0%} of HBM)"
    scale = calibration("mm_decode" if cfg.swap_ab else "mm_prefill")
    return finish("fp8_matmul", label or f"M={m} N={n} K={k}", chip, impl, t, terms, hbm,
                   2 * m * n * k, base,
                   bf16_gemm_s(chip, m, n, k, fill=not in_program), quant_s + epilogue, scale,
                   PDL_LAUNCH_S if pdl else LAUNCH_S)  # fmt: skip
