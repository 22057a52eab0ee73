"""TPU half of the hardware-free performance model: predicted kernel times on v5e / v6e from the
kernels' block shapes, against XLA's BF16 matmul at a stated efficiency.

A Pallas TPU kernel is a sequential loop over its grid; each step DMAs the blocks whose index
changed (double-buffered, so the DMA of step s+1 overlaps the compute of step s) and runs its body
on the MXU (dots) and the VPU (everything else). Predicted time::

    t = Σ_steps [ overhead + max(t_mxu, t_vpu, t_dma) ] + t_first_dma + t_last_store

Assumptions (each a named constant below; calibrate when a TPU is lent):
  * ``STEP_OVERHEAD_S`` 0.35 us per grid step: jax's Pallas TPU matmul guide
    (docs.jax.dev/en/latest/pallas/tpu/matmul.html, "each grid step has some overhead ... ~0.35
    us"), which also measures on v5e at bf16 4096^3: 128^3 tiles 6% of peak, 512x1024x1024 78%,
    XLA's ``jnp.dot`` 84%.
  * MXU: ``n_mxu`` weight-stationary D x D systolic arrays (v5e 4 x 128^2, v6e 4 x 256^2; the
    clock is derived from the published peak: peak = n_mxu · 2 D^2 · clock). A dot [R, Kd] x
    [Kd, Nd] costs ``ceil(Kd/D) · ceil(Nd/D) · max(R, D)`` cycles over the ``n_mxu`` arrays: a
    weight tile is D deep whatever Kd is (a 128-deep contraction fills half of a v6e array) and
    streaming R < D rows cannot hide the D-cycle weight load. FP8 operands run at the BF16 rate on
    v6e; v5e has no FP8 MXU (FP8 is upcast to BF16 on the VPU first).
  * ``dequant`` tiles (v6e prefill): one ``[bm, bk] x [bk, bn]`` dot per step at full depth, and
    per element of both operand tiles an FP8 -> f32 convert, a scale multiply and a BF16 round
    (``upcast_ops + 2`` ops) plus one store of the BF16 tile.
  * VPU: 8 x 128 lanes, ``VALU_SLOTS`` = 4 f32 element-ops per lane per cycle, one vector store
    per cycle (a 4 KiB vreg); an FP8 -> BF16 convert costs ``upcast_ops`` ops per element (v5e
    emulates it: 4; v6e converts natively: 2, a guess). A per-128-K-group promotion
    ``acc += part · s_x · s_w`` is 3 f32 ops per output element, and an accumulator larger than
    half the 64-vreg file is stored back to VMEM once per group.
  * HBM at ``HBM_EFFICIENCY`` = 0.85 of the published bandwidth for every kernel and for XLA.
  * XLA BF16 baseline: ``max(MXU cycles / XLA_MXU_EFFICIENCY, bf16 bytes / HBM)`` with
    ``XLA_MXU_EFFICIENCY`` = 0.84 (the guide's v5e 4096^3 measurement; assumed on v6e too).

Chip figures: cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 394 TOP/s int8, 16 GiB HBM2 at
819 GB/s) and /tpu/docs/v6e (918 TFLOP/s bf16, 1836 TOP/s int8, 32 GiB HBM at 1640 GB/s, 256x256
MXUs). ``python -m kernels_pallas.perf_model.tpu`` prints the table and writes
``experiments/results/perf_model_tpu.json`` and ``.md``.
"""

from __future__ import annotations

import dataclasses
import math

STEP_OVERHEAD_S = 0.35e-6
VALU_SLOTS = 4
VREG_ELEMS = 8 * 128
HBM_EFFICIENCY = 0.85
XLA_MXU_EFFICIENCY = 0.84
SCALE_GROUP = 128  # K group of the blockwise FP8 scales


@dataclasses.dataclass(frozen=True)
class TpuChip:
    name: str
    bf16_flops: float  # peak dense BF16 FLOP/s
    hbm_bytes_per_s: float
    hbm_bytes: int
    mxu_dim: int  # D of each D x D systolic array
    n_mxu: int
    fp8_mxu: bool  # FP8 operands straight into the MXU (at the BF16 rate)
    upcast_ops: int  # VPU ops per element of an FP8 -> BF16 convert
    vmem_bytes: int = 128 * 2**20

    @property
    def clock_hz(self) -> float:
        return self.bf16_flops / (self.n_mxu * 2 * self.mxu_dim**2)


CHIPS = {
    "v5e": TpuChip("v5e", 197e12, 819e9, 16 * 2**30, 128, 4, fp8_mxu=False, upcast_ops=4),
    "v6e": TpuChip("v6e", 918e12, 1640e9, 32 * 2**30, 256, 4, fp8_mxu=True, upcast_ops=2),
}


def mxu_cycles(chip: TpuChip, rows: int, kd: int, nd: int) -> float:
    """Cycles of one dot [rows, kd] x [kd, nd] on the chip's MXUs (see the module doc)."""
    d = chip.mxu_dim
    return math.ceil(kd / d) * math.ceil(nd / d) * max(rows, d) / chip.n_mxu


def hbm_seconds(chip: TpuChip, nbytes: float) -> float:
    return nbytes / (chip.hbm_bytes_per_s * HBM_EFFICIENCY)


@dataclasses.dataclass(frozen=True)
class Step:
    """The work of one (typical) grid step."""

    mxu_cycles: float
    valu_ops: float  # f32 element-ops on the VPU
    vst_vregs: float  # vector stores of 8x128 x 32-bit
    dma_bytes: float  # HBM bytes moved for this step (in and out)


@dataclasses.dataclass(frozen=True)
class Prediction:
    kernel: str
    target: str
    shape: str
    time_s: float
    baseline_s: float  # XLA BF16 (matmuls) or the HBM roofline at the baseline's bytes
    bound: str  # which term dominates a step: mxu | vpu | hbm | overhead
    steps: int
    detail: str  # block shapes and the like

    @property
    def ratio(self) -> float:
        """Speed-up over the baseline (> 1: faster than BF16)."""
        return self.baseline_s / self.time_s

    def row(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(time_us=round(self.time_s * 1e6, 2), baseline_us=round(self.baseline_s * 1e6, 2),
                 ratio=round(self.ratio, 3))  # fmt: skip
        return d


def grid_time(chip: TpuChip, steps: int, step: Step, first_bytes: float, last_bytes: float):
    """(seconds, bound) of ``steps`` identical grid steps, the first DMA and last store exposed."""
    t_mxu = step.mxu_cycles / chip.clock_hz
    t_vpu = max(step.valu_ops / (VALU_SLOTS * VREG_ELEMS), step.vst_vregs) / chip.clock_hz
    t_dma = hbm_seconds(chip, step.dma_bytes)
    terms = {"mxu": t_mxu, "vpu": t_vpu, "hbm": t_dma}
    bound = max(terms, key=terms.get)
    if terms[bound] < STEP_OVERHEAD_S:
        bound = "overhead"
    body = steps * (STEP_OVERHEAD_S + max(terms.values()))
    return body + hbm_seconds(chip, first_bytes + last_bytes), bound


def xla_bf16_matmul_s(chip: TpuChip, m: int, k: int, n: int) -> float:
    """XLA's BF16 ``x[M,K] · w[K,N]``: MXU at ``XLA_MXU_EFFICIENCY`` or HBM, whichever is slower."""
    t_mxu = mxu_cycles(chip, m, k, n) / chip.clock_hz / XLA_MXU_EFFICIENCY
    return max(t_mxu, hbm_seconds(chip, 2 * (m * k + k * n + m * n)))


# ------------------------------------------------------------------ blockwise FP8 matmul kernels


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
    """What the model needs of a dense FP8 matmul kernel's plan for one problem."""

    block_m: int
    block_n: int
    block_k: int
    fp8_mxu: bool  # FP8 fed straight to the MXU (else upcast to BF16 in VMEM first)
    out_bytes: int = 2
    pack: int = 1  # K groups per MXU dot (2: two groups block-diagonal in one 256-deep dot)
    dequant: bool = False  # operands dequantized to BF16 in VMEM, one block_k-deep dot per step
    weight_reuse: bool = False  # grouped: an expert's weight blocks stay in VMEM across its tiles


# The wave-2 kernel (before issue 21): 256 x 128 x 512 tiles, FP8 upcast on every chip.
LEGACY_MATMUL = dict(block_m=256, block_n=128, block_k=512, fp8_mxu=False)


def _acc_vst(chip: TpuChip, bm: int, bn: int, groups: int) -> float:
    """Vector stores of the f32 accumulator: once per group when it exceeds half the vregs."""
    vregs = bm * bn / VREG_ELEMS
    return vregs * (groups if vregs > 32 else 1)


def fp8_matmul_step(chip: TpuChip, m: int, k: int, n: int, t: MatmulTiles) -> tuple[int, Step]:
    """(grid steps, one step's work) of the blockwise kernel: grid (M/bm, N/bn, K/bk), one MXU dot
    [bm,128]x[128,bn] per 128-K group, promotion on the VPU, FP8 upcast unless fed natively."""
    bm, bn, bk = t.block_m, t.block_n, t.block_k
    m_pad = math.ceil(m / bm) * bm
    mt, nt, kt = m_pad // bm, n // bn, k // bk
    steps, groups = mt * nt * kt, bk // SCALE_GROUP
    upcast = 0 if (t.fp8_mxu and chip.fp8_mxu) else chip.upcast_ops * (bm + bn) * bk
    if t.dequant:  # convert, multiply by the scale, round to BF16: per element of both tiles
        upcast = (chip.upcast_ops + 2) * (bm + bn) * bk
    # x (and its scales) change with every step when K is split, else only with the M tile;
    # the weight changes with every step unless a single (N, K) tile covers it.
    x_total = m_pad * k * (t.pack + 4 / SCALE_GROUP) * (nt if kt > 1 else 1)
    w_total = n * k * (1 + 4 / SCALE_GROUP**2) * (mt if nt * kt > 1 else 1)
    out_total = m_pad * n * t.out_bytes
    step = Step(
        mxu_cycles=groups // t.pack * mxu_cycles(chip, t.pack * bm, t.pack * SCALE_GROUP, bn),
        valu_ops=3 * groups * bm * bn + upcast,
        vst_vregs=_acc_vst(chip, bm, bn, groups),
        dma_bytes=(x_total + w_total + out_total) / steps,
    )
    if t.dequant:  # one deep dot, one accumulator add; the BF16 tiles are stored to VMEM once
        step = dataclasses.replace(
            step, mxu_cycles=mxu_cycles(chip, bm, bk, bn), valu_ops=bm * bn + upcast,
            vst_vregs=(bm + bn) * bk / (2 * VREG_ELEMS) + bm * bn / VREG_ELEMS,
        )  # fmt: skip
    return steps, step


def _method(chip: TpuChip, t: MatmulTiles) -> str:
    """How a plan multiplies, for the table's detail column."""
    if t.dequant:
        return "dequant->bf16 dot"
    return "fp8->mxu" if t.fp8_mxu and chip.fp8_mxu else "upcast"


def fp8_matmul_predict(chip: TpuChip, m: int, k: int, n: int, t: MatmulTiles, kernel: str,
                       shape: str) -> Prediction:  # fmt: skip
    steps, step = fp8_matmul_step(chip, m, k, n, t)
    first = (t.block_m + t.block_n) * t.block_k
    last = t.block_m * t.block_n * t.out_bytes
    secs, bound = grid_time(chip, steps, step, first, last)
    detail = f"bm={t.block_m} bn={t.block_n} bk={t.block_k} pack={t.pack} " + _method(chip, t)
    return Prediction(kernel, chip.name, shape, secs, xla_bf16_matmul_s(chip, m, k, n), bound,
                      steps, detail)  # fmt: skip


def grouped_fp8_matmul_predict(chip: TpuChip, rows: int, k: int, n: int, experts: int,
                               t: MatmulTiles, kernel: str, shape: str) -> Prediction:  # fmt: skip
    """Megablox-style grouped kernel with routing spread evenly: ``cdiv(rows, bm) + min(E, rows)
    - 1`` row tiles (every group boundary adds one), each a dense (bm, N, K) problem on its
    expert's weight; with ``t.weight_reuse`` (each stack's weight one block: ``pallas_tpu.plan``)
    consecutive tiles of an expert keep its weight block, so the weights cross HBM once per
    used expert instead of once per tile. Baseline: XLA BF16 per-expert GEMMs over the used
    experts."""
    used = min(experts, rows)
    tiles = math.ceil(rows / t.block_m) + used - 1
    steps1, step = fp8_matmul_step(chip, t.block_m, k, n, t)
    if t.weight_reuse:  # a tile's share of the weights: used experts' worth over all tiles
        w_tile = n * k * (1 + 4 / SCALE_GROUP**2)
        dma = step.dma_bytes + (used / tiles - 1) * w_tile / steps1
        step = dataclasses.replace(step, dma_bytes=dma)
    last = t.block_m * t.block_n * t.out_bytes
    secs, bound = grid_time(chip, tiles * steps1, step, (t.block_m + t.block_n) * t.block_k, last)
    per = math.ceil(rows / used)
    base = used * xla_bf16_matmul_s(chip, per, k, n)
    reuse = " reuse" if t.weight_reuse else ""
    detail = f"tiles={tiles} bm={t.block_m} bn={t.block_n} bk={t.block_k}{reuse} " + \
        _method(chip, t)  # fmt: skip
    return Prediction(kernel, chip.name, shape, secs, base, bound, tiles * steps1, detail)


# ------------------------------------------------------------------ the shared model's interface
# ``common``: ``CASES`` and ``predict_tpu(op, shape, chip)`` feed ``python -m
# kernels_pallas.perf_model``'s joint table; ``tpu_table`` prints the TPU before -> now table.


def _to_common(op: str, p: Prediction, baseline: str, nbytes: int, flops: int):
    from kernels_pallas.perf_model import common

    return common.Prediction(
        op=op, label=p.shape, chip=p.target, impl=f"pallas_tpu {p.detail}", time_s=p.time_s,
        baseline=baseline, baseline_s=p.baseline_s, bound=p.bound, terms=dict(steps=p.steps),
        bytes=int(nbytes), flops=int(flops),
    )  # fmt: skip


_XLA = f"XLA BF16 jnp.dot at {XLA_MXU_EFFICIENCY:.0%} MXU / {HBM_EFFICIENCY:.0%} HBM"
_ROOF = "a BF16-cache kernel at the HBM roofline"


def predict_tpu(op: str, shape: dict, chip: str):
    """One case (``common`` names the dims) on "v5e" / "v6e", as a ``common.Prediction``."""
    from kernels_pallas.perf_model import tpu_attention, tpu_table

    c, label = CHIPS[chip], ""
    if op == "fp8_matmul":
        m, n, k = shape["M"], shape["N"], shape["K"]
        p = fp8_matmul_predict(c, m, k, n, tpu_table.matmul_tiles(c, m, k, n), op, label)
        return _to_common(op, p, _XLA, m * k + n * k + 2 * m * n, 2 * m * n * k)
    if op == "grouped_fp8_matmul":
        m, k, e = shape["M"], shape["K"], shape["E"]
        ns = tuple(shape["N"]) if isinstance(shape["N"], (tuple, list)) else (shape["N"],)
        n = sum(ns)
        t = tpu_table.grouped_tiles(c, m, k, ns, e)
        p = grouped_fp8_matmul_predict(c, m, k, n, e, t, op, label)
        return _to_common(op, p, _XLA, m * k + min(e, m) * n * k + 2 * m * n, 2 * m * n * k)
    if op in ("decode_attention", "paged_attention"):
        b, s, h, kv, d = shape["B"], shape["S"], shape["H"], shape["KV"], shape["D"]
        kv_bytes = 1 if shape.get("cache", "fp8") == "fp8" else 2
        slots = tpu_attention.slots_per_step(op, s, shape.get("Y", 128))
        p = tpu_attention.predict(c, op, label, b, s, slots, kv, h // kv, d, kv_bytes, False)
        return _to_common(op, p, _ROOF, 2 * b * s * kv * d * kv_bytes, 4 * b * s * h * d)
    raise ValueError(f"perf_model.tpu: unknown op {op!r}")


# fp8_matmul aot_cases rows the FP8 rollout runs only as part of a fused GEMM
SEPARATE_ONLY = ("k_proj|v_proj", "gate|up_proj", "Qwen3-30B-A3B q_proj ")


def targets(preds) -> list[str]:
    """Issue 21's TPU targets on the joint table's fp8_matmul rows (``common.Prediction``s) that
    the FP8 rollout runs (``SEPARATE_ONLY`` left out): v6e >= 1.3x XLA's BF16 matmul, v5e >=
    0.9x; decode (M <= 64) and prefill (M >= 4096) judged apart, since only decode can gain
    from bytes."""
    out = []
    for chip, goal in (("v6e", 1.3), ("v5e", 0.9)):
        # the FP8 rollout runs k|v and gate|up fused with q / each other (fp8rl_jax.models.fused)
        rows = [p for p in preds if p.chip == chip and p.op == "fp8_matmul"
                and not any(sep in p.label for sep in SEPARATE_ONLY)]  # fmt: skip
        for name, keep in (("M <= 64", lambda m: m <= 64), ("M >= 4096", lambda m: m >= 4096)):
            sel = [p for p in rows if keep(int(p.label.split("M=", 1)[1].split()[0]))]
            if not sel:
                continue
            met = [p for p in sel if p.ratio >= goal]
            worst = min(sel, key=lambda p: p.ratio)
            out.append(f"- TPU {chip} fp8_matmul >= {goal}x XLA BF16, {name}, rollout GEMMs: "
                       f"{'MET' if len(met) == len(sel) else 'NOT MET'} ({len(met)}/{len(sel)}); "
                       f"worst {worst.label}: {worst.ratio:.2f}")  # fmt: skip
    return out


def _cases():
    from kernels_pallas.perf_model.common import Case
    from kernels_pallas.perf_model.tpu_table import case_shapes

    return [Case.make(op, label, tuple(CHIPS), **dims) for op, label, dims in case_shapes()]


CASES = _cases()
