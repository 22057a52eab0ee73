"""Tile configurations of the Hopper FP8 matmul (``pallas_mosaic_gpu.py``): which are legal, the
SMEM they take (as Mosaic GPU counts it), and the per-shape defaults. Pure Python, no jax."""

from __future__ import annotations

import dataclasses
import os

from kernels_pallas.dependent_launch import enabled as pdl_enabled

GROUP = 128  # K group of activation scales and K block (and N block) of weight scales
SMEM_BYTES = 232448  # H100/H200 shared_memory_per_block_optin (227 KiB), Mosaic GPU's budget
_WGMMA_M = 64  # rows of one warpgroup's wgmma tile
# x rows of a swap-AB tile (the wgmma N): a compute warpgroup holds two [64, block_m] f32
# accumulators (the running one and the fresh one of the step), 128 registers at 128 rows
_SWAP_MAX_M = 128
# x rows of a swap-AB tile are a multiple of this: the ring's stage of f32 x scales
# (block_m · 4 B) must be a multiple of 128 B, because TMA writes SMEM at 128-byte-aligned
# addresses and the stages lie back to back (16-row tiles, 64-B stages, stopped an H200 with
# CUDA_ERROR_MISALIGNED_ADDRESS; 32 rows and up ran; a compile cannot see it)
SWAP_ROW_ALIGN = 32
# The fused (BF16 x) swap-AB tiles carry no x scales in the ring: 16-row multiples (the wgmma N
# is a multiple of 8; a 16-row BF16 stage is 4 KiB per 128-K slice), so M = 16 needs no padding
FUSED_ROW_ALIGN = 16
FUSED_DECODE_ROWS = 16  # raw x of this many rows runs fused by default (api.fused_default)
FUSED_ENV = "FP8RL_FUSED_X"


def fused_enabled() -> bool:
    """Whether raw BF16 x may run the fused kernel by default (``FP8RL_FUSED_X`` unset or not
    "0"). "0": raw x is quantized once everywhere (``act_quantize``) and every producer
    quantizes for its FP8 GEMMs (``act_quantize.quantizes_for``): a switch for a device where
    the fused kernel misbehaves (it has not yet run on one), and for measuring both ways."""
    return os.environ.get(FUSED_ENV, "1") != "0"


_SMEM_ALIGN = 1024  # Mosaic GPU rounds every SMEM scratch buffer up to this (SMEM_ALIGNMENT)
_MAX_STAGES = 6  # deepest ring that compiled without spills for every tile shape tried
_MAX_GRID = 65535  # CUDA's limit on the y and z grid dimensions (x allows 2^31 - 1)
_REDUCTION_SCRATCH = 2048  # SMEM a kernel with a reduction reserves (CompilerParams default)
NUM_SMS = 132  # H100 SXM / H200
_WIDE_SUB_N = 128  # columns of one wgmma sub-tile of the wide tiles (64 also compiles, 0 spills)
_MAX_CLUSTER = 8  # CTAs per cluster (the portable limit)
_L2_BAND_BYTES = 24 << 20  # x rows one snake band of a persistent grid keeps in L2 (half of 50 MB)


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tile configuration of the Hopper kernel (a static argument)."""

    block_m: int = 128  # x rows per CTA: 64, 128 or 256 (2 WGs of 64 or 128); swap_ab: 32..128, /32
    block_n: int = 128  # w rows (output columns) per CTA: 64, 128, 256 (swap_ab: 64 per WG)
    max_concurrent_steps: int = 4  # SMEM ring depth of the TMA pipeline (K steps in flight), <= 6
    swap_ab: bool = False  # compute yᵀ = w xᵀ so that M is the wgmma N (decode)
    split_k: int = 1  # swap_ab only: K split over this many CTAs, f32 partials summed by XLA
    cluster_m: int = 1  # 2: CTA pairs along M share each weight tile by TMA multicast (prefill)
    persistent: int = 0  # CTAs of a persistent grid looping over the output tiles in snake order
    # (132: one per H100/H200 SM; a multiple of cluster_m); 0: one CTA per output tile
    cluster_k: bool = False  # split_k 2-8: a tile's K chunks run as one CTA cluster, each warpgroup
    # tile summed in one CTA's SMEM (DSMEM stores), which writes it: no f32 partials, no XLA sum
    overlap: bool = False  # prefill tiles of one sub-tile per warpgroup: each 128-K slice's
    # promotion runs under the next slice's wgmma, two slices per pipeline step (``k_pair_overlap``)
    k_slices: int = 1  # swap_ab: 128-K slices per pipeline step (1, 2 or 4): each TMA stage
    # holds 256-512 contiguous bytes of every weight row, and the ring that many times the bytes
    pdl: bool = False  # dependent launch (``kernels_pallas/dependent_launch.py``): the grid starts
    # while its predecessor drains, prefetches its first ring of weight tiles into L2, then waits

    @property
    def num_compute_wgs(self) -> int:
        rows = self.block_n if self.swap_ab else self.block_m
        return min(rows // _WGMMA_M, 2)

    @property
    def k_block(self) -> int:
        """K elements per pipeline step: one 128-K slice, two with ``overlap``, ``k_slices``
        on swap-AB tiles."""
        return GROUP * (2 if self.overlap else self.k_slices)

    @property
    def wg_subtiles(self) -> tuple[tuple[int, int], ...]:
        """(row, column) offsets, inside one compute warpgroup's tile, of its 64-row wgmma
        sub-tiles: one, or ``_WIDE_SUB_N``-column ones for the wide tiles (128x256: 64 rows x
        256 columns; 256x128: 128 rows x 128 columns)."""
        if self.swap_ab or max(self.block_m, self.block_n) <= GROUP:
            return ((0, 0),)
        rows = range(0, self.block_m // self.num_compute_wgs, _WGMMA_M)
        return tuple((r, c) for r in rows for c in range(0, self.block_n, _WIDE_SUB_N))

    def invalid(self) -> str | None:
        """Why this tile configuration is illegal, or None."""
        if self.block_n not in (64, 128, 256):
            return f"block_n must be 64, 128 or 256, got {self.block_n}"
        if self.block_n == 256 and (self.swap_ab or self.block_m != 128):
            # 64 rows x 256 columns per warpgroup is the register limit (wg_subtiles)
            return "block_n=256 needs block_m=128 and no swap_ab"
        if self.swap_ab and (self.block_m % FUSED_ROW_ALIGN or self.block_m > _SWAP_MAX_M):
            return f"swap_ab block_m must be a multiple of {FUSED_ROW_ALIGN} (of " \
                   f"{SWAP_ROW_ALIGN} with FP8 x) up to {_SWAP_MAX_M}, got " \
                   f"{self.block_m}"  # fmt: skip
        if not self.swap_ab and self.block_m not in (64, 128, 256):
            return f"block_m must be 64, 128 or 256, got {self.block_m}"
        if not self.swap_ab and self.block_m == 256 and self.block_n != 128:
            return f"block_m=256 needs block_n=128 (two 64x128 sub-tiles per warpgroup), got " \
                   f"{self.block_n}"  # fmt: skip
        if self.cluster_m not in (1, 2) or (self.cluster_m == 2 and self.swap_ab):
            return f"cluster_m must be 1, or 2 without swap_ab, got {self.cluster_m}"
        if self.split_k < 1 or (self.split_k > 1 and not self.swap_ab):
            return f"split_k must be 1, or > 1 with swap_ab, got {self.split_k}"
        if self.cluster_k and not 2 <= self.split_k <= _MAX_CLUSTER:
            # a cluster of more than 8 CTAs is not portable (H100 allows 16 only by opt-in)
            return f"cluster_k needs split_k in [2, {_MAX_CLUSTER}], got {self.split_k}"
        if isinstance(self.persistent, bool) or self.persistent < 0:
            return f"persistent is a CTA count (e.g. 132), got {self.persistent!r}"
        if self.persistent and (self.swap_ab or self.persistent % self.cluster_m):
            return f"persistent={self.persistent} needs no swap_ab (prefill) and a multiple of " \
                   f"cluster_m={self.cluster_m}"  # fmt: skip
        if self.overlap and (self.swap_ab or self.persistent or len(self.wg_subtiles) > 1):
            # the product being promoted (64 registers) beside the running and the fresh
            # accumulators: one sub-tile per warpgroup
            return "overlap needs a prefill tile of one sub-tile per warpgroup (block_m, " \
                   "block_n <= 128, no swap_ab) and no persistent grid"  # fmt: skip
        if self.k_slices not in (1, 2, 4) or (self.k_slices > 1 and not self.swap_ab):
            return f"k_slices must be 1, or 2 or 4 with swap_ab, got {self.k_slices}"
        if not 2 <= self.max_concurrent_steps <= _MAX_STAGES:
            # Deeper rings spill registers (ptxas, H100: 64x64 tiles spill from 8 stages).
            steps = self.max_concurrent_steps
            return f"max_concurrent_steps must be in [2, {_MAX_STAGES}], got {steps}"
        return None


def _align(nbytes: int) -> int:
    return -(-nbytes // _SMEM_ALIGN) * _SMEM_ALIGN


def smem_bytes(cfg: MgpuConfig, k: int, x_itemsize: int, out_itemsize: int, fused: bool) -> int:
    """The SMEM the kernel allocates, counted as Mosaic GPU counts it: every scratch buffer
    rounded up to 1 KiB (``SMEM_ALIGNMENT``), 8 B per pipeline barrier (a produced and a consumed
    one per stage), and the reduction scratch the fused row amax reserves. Equals the
    ``smem_bytes`` of ``mosaic/gpu/core.py`` for every case in ``aot_cases.py`` (jax 0.11.2 and
    0.12.0.1)."""
    kb = cfg.k_block
    stages = min(cfg.max_concurrent_steps, k // kb // cfg.split_k)  # never holds more
    ring = [cfg.block_m * kb * x_itemsize, cfg.block_n * kb]
    # the x scales of a step's slices (overlap: from GMEM)
    ring += [] if fused or cfg.overlap else [cfg.block_m * 4 * cfg.k_slices]
    total = sum(_align(stages * b) for b in ring) + 2 * stages * 8
    out_itemsize = 4 if cfg.split_k > 1 and not cfg.cluster_k else out_itemsize  # f32 partials
    total += _align(cfg.block_m * cfg.block_n * out_itemsize)  # epilogue tile
    if cfg.cluster_k:  # the other chunks' f32 accumulators, one barrier per compute warpgroup
        total += _align((cfg.split_k - 1) * cfg.block_m * cfg.block_n * 4)
        total += 8 * cfg.num_compute_wgs
    if fused and cfg.swap_ab:  # x̂ tiles and x scales, a buffer per compute warpgroup, barriers
        bufs = cfg.num_compute_wgs
        total += _align(bufs * cfg.k_slices * cfg.block_m * GROUP)
        total += _align(bufs * cfg.k_slices * cfg.block_m * 4) + _REDUCTION_SCRATCH
        total += 16 if bufs > 1 else 0
    elif fused:
        total += _align(cfg.block_m * GROUP) + _REDUCTION_SCRATCH  # x̂ tile, amax scratch
    return total


def snake_band(cfg: MgpuConfig, m_pad: int, k: int) -> int:
    """M tiles of one band of a persistent grid's snake order (``plgpu.planar_snake``, M minor):
    the tiles run M-fastest across a band of this many cluster-row tiles, then the next band
    sweeps N backwards. As many as keep the band's x rows within ``_L2_BAND_BYTES`` (all of M
    for M = 4096, K = 4096: x is then read from HBM once and each weight tile once per band)."""
    rows = cfg.block_m * cfg.cluster_m
    return max(1, min(m_pad // rows, _L2_BAND_BYTES // (rows * k)))


# Decode grids split K until this many compute warpgroups run (a little over half the SMs' worth
# of two-warpgroup CTAs): the performance model finds the f32 partials' XLA sum (serial, one
# more pass over the output) costs more than further SMs gain past it.
_DECODE_WGS = 160
_DECODE_MIN_STEPS = 4  # K steps per chunk (the pipeline fill is paid per chunk)
# Two K chunks are summed in their 2-CTA cluster (``MgpuConfig.cluster_k``): the performance
# model puts it at 0.97-1.08x the XLA sum inside a program (the sum fused into the consumer) and
# 1.09-1.29x for a standalone call (the sum's launch saved), H100/H200; at 4-8 chunks the CTA
# receiving 3-7 accumulators over the SM-to-SM network is predicted slower inside a program.
_CLUSTER_K_SPLIT = 2
# 128-K slices per pipeline step of the decode tiles (``default_config``: where 3-4 such stages
# fit). The first device run's 64-weight-row swap tiles ran their K steps at the pace of one
# load round trip per ring of 4 (569-588 cycles a step on the H200, the model's latency term
# 530-551): a memory-bound decode GEMM goes as fast as the bytes its SMs keep in flight, and
# two-slice stages double them at 1 CTA per SM, where SMEM is otherwise idle. Their compiled
# K loop is shorter per slice (H100 SASS: 145 instructions and 3 TMA loads per two slices
# against 2 x 86 and 2 x 3, the first slice's promotion under the second's wgmma; same
# registers, 0 spills). The model (``perf_model.md``, 30 decode shapes x chip, standalone and
# in a program): 1.00-1.33x on the H200, whose decode GEMMs it finds latency-bound, 1.00-1.19x
# on the H100, where HBM binds most (in a program 1.00-1.01x); never slower. The autotuner pins
# one slice per step beside it and the benchmark times it (``tuning.tuning_specs``,
# ``bench_matmul``'s ``:plain`` arm).
_DECODE_K_SLICES = 2
# Dependent launch of the decode tiles (``MgpuConfig.pdl``, ``kernels_pallas/dependent_launch``):
# a decode GEMM is a few microseconds of weight bytes under a fixed cost per kernel of the same
# order (the first device run: cuBLAS's BF16 GEMMs at M = 16 had a 4.3 us intercept), and the
# launch is part of it. Launched dependent, its grid starts as its predecessor's CTAs exit (not
# once the predecessor has completed), initialises its barriers and puts its first ring of
# weight tiles in flight to L2 while the predecessor drains; no operand is read before the wait.
# H100 SASS: one UTMAPF per 128-K slice of the ring, then ACQBULK, before the first TMA load;
# same registers and main loop, 0 spills (both jax). Prefill tiles (many waves) are left as they
# were: the launch is under 2% of their time.
_DECODE_PDL = True


def decode_pdl() -> bool:
    """Whether swap-AB decode tiles launch dependent by default (``_DECODE_PDL``, unless
    ``FP8RL_PDL=0``)."""
    return _DECODE_PDL and pdl_enabled()


def decode_split_k(ctas: int, k_steps: int, wgs_per_cta: int = 2) -> int:
    """K chunks for a decode grid of ``ctas`` CTAs: the largest power of two dividing the K
    steps with ``ctas · wgs_per_cta · split <= 160`` and >= 4 K steps per chunk."""
    split = 1
    while ctas * wgs_per_cta * split * 2 <= _DECODE_WGS and k_steps % (split * 2) == 0 and \
            k_steps // (split * 2) >= _DECODE_MIN_STEPS:  # fmt: skip
        split *= 2
    return split


def swap_default(m: int, n: int, k: int) -> bool:
    """Whether M rows (unfused) take the swap-AB decode tile by default: always up to 64 rows;
    from 65 to 256 rows where ``decode_config`` splits K, i.e. where the prefill tiles'
    ``ceil(M / 128) x N / 128`` grid would leave most SMs idle (o_proj, down_proj, k/v_proj
    widths) and split-K fills them (above 128 rows, only grids of at most a quarter of the SMs:
    narrow N). Where neither tile splits, both grids are the same CTAs and the 128x128 prefill
    tile's K loop is the shorter one (128 against 169 SASS instructions per step at 128 rows,
    ``perf_model/sass_profiles.json``)."""
    if m <= _WGMMA_M:
        return True
    if m > 2 * _SWAP_MAX_M:
        return False
    block_n = 128 if n % 128 == 0 else 64
    if m > _SWAP_MAX_M and -(-m // 128) * (n // block_n) > NUM_SMS // 4:
        return False
    return decode_config(m, n, k).split_k > 1


def decode_config(m: int, n: int, k: int, fused: bool = False) -> MgpuConfig:
    """The swap-AB tile for decode rows (``swap_default``): all M rows (rounded up to 32; fused:
    ``fused_rows``) as the wgmma N up to 128, tiles of 128 rows above; 128 weight rows per CTA
    (two compute warpgroups, each its own wgmma chain, half the x re-reads of 64-row tiles) with
    K split by ``decode_split_k`` over the grid of M tiles x N tiles; 64 rows where N % 128 != 0, or
    (M <= 64) where 128 rows leave an unsplit grid of under half the SMs that 64 rows fill
    within one wave (Qwen3-8B q|k|v fused: 96 CTAs, not 48; above 64 x rows, a one-warpgroup
    CTA's serial wgmma chain binds instead: Llama-3-70B o_proj M = 128 1.66x against 2.12x).
    Chosen for GEMMs inside a program, where XLA fuses the split-K sum into the consumer (a
    standalone call pays its launch too). The performance model (``perf_model.md``: H100, BF16
    x, the profiled SASS of both tiles, in-program) puts this rule's pick within 0.6% of its best
    of 64/128 rows x split 1-16 on average over 19 decode shapes at M = 16/32/64
    (``aot_cases.py``, ``perf_model.gpu``), 9% at worst (Qwen3-30B-A3B k/v_proj, N = 512: split
    8 would leave 2-step chunks); against 64-row tiles with the earlier split rule (one wave,
    >= 16-32 steps per chunk) it predicts Llama-3-70B q|k|v fused M = 64 1.60x -> 1.98x BF16,
    Qwen3-8B o_proj M = 64 1.19x -> 1.35x, gate|up M = 64 1.72x -> 1.87x, Qwen3-30B-A3B q_proj
    M = 16 1.01x -> 1.17x, no shape more than 4% slower. The on-device autotuner
    (``kernels_pallas.autotune``) times split 1-8 x 64/128 rows (standalone calls)."""
    rows = min(-(-m // SWAP_ROW_ALIGN) * SWAP_ROW_ALIGN, _SWAP_MAX_M)
    if fused:  # M <= 64: no scales in the ring, 16-row tiles (``fused_rows``)
        rows = fused_rows(m)
    m_tiles = -(-m // rows)
    steps = k // GROUP

    def tile(block_n: int) -> MgpuConfig:
        split = decode_split_k(m_tiles * (n // block_n), steps, 2 if block_n == 128 else 1)
        return MgpuConfig(block_m=rows, block_n=block_n, swap_ab=True, split_k=split,
                          cluster_k=split == _CLUSTER_K_SPLIT)  # fmt: skip

    if n % 128:
        return tile(64)
    wide = tile(128)
    if rows <= _WGMMA_M and wide.split_k == 1 and n // 128 < NUM_SMS // 2 and \
            n // 64 <= NUM_SMS:  # fmt: skip
        return tile(64)
    return wide


def _wide_grid(tiles_m: int, n: int) -> bool:
    """Whether a prefill grid of ``tiles_m`` 128-row tiles takes 128x256 CTAs: where their grid
    fills >= 2/3 of the SMs, or where 128x128 CTAs would need a second wave (one CTA per SM)
    that 128x256 ones do not (the model, H100: Qwen3-8B q|k|v fused M = 384 0.88x -> 1.28x BF16,
    Llama-3-70B q|k|v fused M = 160-256 1.24x -> 1.52x, DeepSeek-V3 N = 7168 M = 384 1.07x ->
    1.56x; never slower over 168 shapes at M = 160-8192)."""
    wide = tiles_m * (n // 256)
    return wide >= NUM_SMS * 2 // 3 or (tiles_m * (n // 128) > NUM_SMS and wide <= NUM_SMS)


def _overlap_tile(n: int) -> MgpuConfig:
    """The prefill tile with promotions under the wgmmas, before its cluster rule."""
    return MgpuConfig(block_m=128, block_n=64 if n % 128 else 128, max_concurrent_steps=3,
                      overlap=True)  # fmt: skip


def _overlap_fits(m: int, n: int, k: int, out_itemsize: int) -> bool:
    """Whether the prefill default takes ``_overlap_tile``: two 128-K slices per step, its 3
    stages within the SMEM budget, and a grid that runs in 2-CTA clusters (an even number of M
    tiles, >= 2/3 of the SMs: the cluster rule below). Alone, each CTA reads its own weight
    tile from L2 at twice the 128x256 tiles' bytes per FLOP, and the model puts it 0.93-1.0x
    those on the grids of 3 M tiles it was tried on (Llama-3-70B gate|up M = 384)."""
    cfg = _overlap_tile(n)
    return m > 64 and (k // GROUP) % 2 == 0 and _clustered(cfg, m, n) and \
        smem_bytes(cfg, k, 1, out_itemsize, False) <= SMEM_BYTES  # fmt: skip


def _clustered(cfg: MgpuConfig, m: int, n: int) -> bool:
    """Whether a prefill grid of ``cfg``'s tiles runs in 2-CTA clusters by default: an even
    number of M tiles and >= 2/3 of the SMs' worth of CTAs."""
    tiles_m = -(-m // cfg.block_m)
    return tiles_m % 2 == 0 and tiles_m * (n // cfg.block_n) >= NUM_SMS * 2 // 3


def default_config(m: int, n: int, k: int, *, fused: bool = False, out_itemsize: int = 2,
                   swap: bool | None = None, overlap: bool = True,
                   k_slices: bool = True, pdl: bool = True):  # fmt: skip
    """The rules' tiles (what ``fp8_matmul`` runs for the fused kernel, and elsewhere unless
    ``tile_choice.dispatch_config``'s performance model finds a tile that beats them by a
    margin: mostly between decode and prefill). Decode (M <= 64; 65-256 rows where K splits;
    unfused: ``swap_default``): swap-AB with 64 or 128 weight rows per CTA (``decode_config``),
    M rounded up to 32; fused (BF16 x quantized in-kernel, M <= 64) to 16, 32 or 64 rows
    (``fused_rows``). Prefill:
    128x256 CTAs where their grid fills >= 2/3 of the SMs or saves a wave (``_wide_grid``) (the
    performance model, H100: 1.33-1.44x faster than 128x128 there, 0.5-0.96x on grids of <= 64 CTAs:
    ``perf_model.md``), else 128x128 with two compute warpgroups (64x128 if N % 128). Unfused
    prefill grids of >= 88 CTAs with an even number of M tiles run as 2-CTA clusters sharing each
    weight tile (TMA multicast; the model: 1.06-1.41x there, losses only on small or odd-padded
    grids). Not persistent: a persistent grid of 132 CTAs (``persistent=132``) is predicted
    0.996x on the M = 4096 prefill grids (a later wave of the plain grid costs one load round
    trip, the first device run says: what a persistent CTA pays between its tiles), and has run
    on no device yet; the on-device autotuner times it beside these defaults
    (``tuning.tuning_specs``). The ring is as deep as fits the SMEM budget (<= 4 stages; 3 for
    128x256 or the fused variant's BF16 x tiles; 2 for 128x256, F32 out). ``swap=False``: the
    prefill tiles even where ``swap_default`` says swap-AB (the performance model's before ->
    after).

    Prefill grids that run in 2-CTA clusters, with K a multiple of 256 (``_overlap_fits``):
    128x128 tiles (64 columns if N % 128) whose promotions run under the wgmmas (``overlap``: two
    128-K slices per step, x scales from GMEM), 3 stages where they fit (BF16 out). The model
    (calibrated on the first device run, where the two compute warpgroups of the tiles above
    ran in step and the tensor core idled through each wait and promotion) puts them at
    1.06-1.47x those tiles (median 1.15x) over 104 prefill shapes x {H100, H200} of 96-8192
    rows, never slower. ``overlap=False``: the tiles before it (the model's before -> after, the
    benchmark's ``:plain`` arm).

    Decode (swap-AB) tiles take two 128-K slices per pipeline step where 3-4 such stages fit
    the SMEM (``_DECODE_K_SLICES``: twice the bytes in flight per SM); ``k_slices=False``: one
    slice per step (the tiles before it, the benchmark's ``:plain`` arm).

    Decode (swap-AB) tiles launch dependent (``MgpuConfig.pdl``, ``_DECODE_PDL``) unless
    ``FP8RL_PDL=0``; ``pdl=False``: launched after their predecessor completes (the benchmark's
    ``:nopdl`` arm)."""
    if (swap_default(m, n, k) if swap is None else swap) and (not fused or m <= _WGMMA_M):
        cfg = decode_config(m, n, k, fused)
    elif overlap and not fused and _overlap_fits(m, n, k, out_itemsize):
        cfg = _overlap_tile(n)
    elif m <= 64:
        cfg = MgpuConfig(block_m=64, block_n=64 if n % 128 else 128)
    elif not fused and n % 256 == 0 and _wide_grid(-(-m // 128), n):
        cfg = MgpuConfig(block_m=128, block_n=256)
    else:
        cfg = MgpuConfig(block_m=128, block_n=128 if n % 128 == 0 else 64)
    if not (fused or cfg.swap_ab) and _clustered(cfg, m, n):
        cfg = dataclasses.replace(cfg, cluster_m=2)
    x_itemsize = 2 if fused else 1
    # (k_slices, stages): a swap-AB ring of two-slice stages where >= 3 of them fit
    rings = [(1, st) for st in range(cfg.max_concurrent_steps, 1, -1)]
    if k_slices and cfg.swap_ab and (k // GROUP) % (_DECODE_K_SLICES * cfg.split_k) == 0:
        rings = [(_DECODE_K_SLICES, st) for st in (cfg.max_concurrent_steps, 3)] + rings
    cfg = dataclasses.replace(cfg, pdl=pdl and cfg.swap_ab and decode_pdl())
    for cluster_k in dict.fromkeys((cfg.cluster_k, False)):  # in-cluster sum if it fits
        for k_slices, stages in rings:
            c = dataclasses.replace(cfg, max_concurrent_steps=stages, cluster_k=cluster_k,
                                    k_slices=k_slices)  # fmt: skip
            if smem_bytes(c, k, x_itemsize, out_itemsize, fused) <= SMEM_BYTES:
                return c
    return c


def scale_stages_refuse(cfg: MgpuConfig) -> str | None:
    """Why a swap-AB tile of FP8 x (its ring carries the x scales, ``block_m`` f32 a stage)
    cannot run: stages of under 128 B break TMA's SMEM alignment (``SWAP_ROW_ALIGN``)."""
    if cfg.swap_ab and cfg.block_m % SWAP_ROW_ALIGN:
        return f"swap_ab block_m must be a multiple of {SWAP_ROW_ALIGN} with FP8 x (128-B TMA " \
               f"stages of f32 x scales), got {cfg.block_m}"  # fmt: skip
    return None


def fused_refuses(cfg: MgpuConfig) -> str | None:
    """Why the fused (BF16 x, in-kernel quantization) kernel cannot run ``cfg``, or None. It
    takes tiles of one sub-tile per warpgroup, unclustered and not persistent, and swap-AB
    tiles whose units of quantization (``fused_unit_rows``) are 16, 32 or a multiple of 64 x
    rows (the register layouts of its row amax: ``mgpu_fused_swap._rows_layout``)."""
    if cfg.cluster_m > 1:
        return "the fused (BF16 x) kernel has no cluster variant"
    if cfg.persistent:
        return "the fused (BF16 x) kernel has no persistent variant"
    if cfg.overlap:
        return "the fused (BF16 x) kernel has no overlap variant"
    if len(cfg.wg_subtiles) > 1:
        return "the fused (BF16 x) kernel takes 64/128 tiles only (one x slice per warpgroup)"
    if cfg.swap_ab and (rows := fused_unit_rows(cfg)) not in (16, 32) and rows % _WGMMA_M:
        return f"the fused (BF16 x) swap-AB kernel quantizes x in units of 16, 32 or 64 rows " \
               f"(block_m, halved with two compute warpgroups and one slice a step), got " \
               f"{rows} (block_m={cfg.block_m})"  # fmt: skip
    return None


def fused_unit_rows(cfg: MgpuConfig) -> int:
    """x rows of one unit of the fused swap-AB step's quantization (``mgpu_fused_swap``): the
    tile's, or half of them where two compute warpgroups split one slice a step."""
    nwg = cfg.num_compute_wgs
    return cfg.block_m if nwg == 1 or cfg.k_slices >= nwg else cfg.block_m // nwg


def fused_rows(m: int) -> int:
    """x rows of the fused kernel's swap-AB tile for M <= 64 rows: 16, 32 or 64."""
    return next(r for r in (16, 32, _WGMMA_M) if m <= r)


def supports(m: int, k: int, n: int, cfg: MgpuConfig, *, fused: bool, x_itemsize: int,
             out_itemsize: int) -> str | None:  # fmt: skip
    """None if the kernel compiles for these shapes and this tile configuration, else why not."""
    if (bad := cfg.invalid()) is not None:
        return bad
    if not fused and (bad := scale_stages_refuse(cfg)) is not None:
        return bad
    if fused and (bad := fused_refuses(cfg)) is not None:
        return bad
    if k % GROUP or k == 0:
        return f"K={k} must be a positive multiple of {GROUP}"
    if (k // GROUP) % cfg.split_k:
        return f"split_k={cfg.split_k} must divide the {k // GROUP} K steps"
    if cfg.overlap and (k // GROUP) % 2:
        return f"overlap takes two 128-K slices per step: K={k} must be a multiple of 256"
    if (k // GROUP) % (cfg.split_k * cfg.k_slices):
        return f"k_slices={cfg.k_slices} x split_k={cfg.split_k} must divide the {k // GROUP} " \
               f"128-K slices of K={k}"  # fmt: skip
    if n % cfg.block_n:
        return f"N={n} must be a multiple of block_n={cfg.block_n}"
    if m < 1:
        return "M must be >= 1"
    if max(-(-m // (cfg.block_m * cfg.cluster_m)), n // cfg.block_n) > _MAX_GRID:
        return f"the CTA grid ({-(-m // cfg.block_m)} x {n // cfg.block_n}) exceeds {_MAX_GRID}"
    used = smem_bytes(cfg, k, x_itemsize, out_itemsize, fused)
    if used > SMEM_BYTES:
        return f"tiles need {used} B of SMEM > {SMEM_BYTES} B (fewer stages or smaller tiles)"
    return None
