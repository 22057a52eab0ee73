"""The performance model against the first device run: ``KERNEL_CALIBRATION`` from data.

``python -m kernels_pallas.perf_model.calibration [RESULTS_DIR | BENCH_JSON...] [--fit]`` reads
the benchmark JSONs of a ``scripts/gpu_check.sh`` run (default: the H200 run of 2026-12-04,
``experiments/results/gpu_h200_2026-12-04``; or the files named, those that exist: what
``gpu_check.sh``'s perf_model stage passes) and prints, per kernel family, the median over its
rows of (CUPTI kernel time) / (the model's uncalibrated kernel time without its launch): the
factor ``KERNEL_CALIBRATION`` holds, by which ``gpu.py`` scales our FP8 kernels' predicted
times. The baselines (cuBLAS BF16 GEMMs, the BF16-cache attention) are printed too, as a check
of their stated efficiencies, and are not scaled. ``--fit`` prints instead the spread of the
decode GEMMs' ratios over a grid of the model's load latency and per-kernel fill (``fit``): what
set ``gpu.DRAM_LATENCY_S`` and ``gpu.FILL_S``, and of the prefill GEMMs' over the cost of each
later wave of a grid (``fit_waves``: ``gpu.WAVE_S``).

Families (the rows ``compare.predicted_us`` models, the kernel alone: no ``+quant`` / ``+add``):
  ``mm_prefill``: ``fp8:pallas_mosaic_gpu`` (and its ``:plain`` arm: the tiles without
  ``overlap``) at M > 256 (the QArray kernel's prefill tiles; a row runs the config it records,
  ``compare.matmul_config``);
  ``mm_decode``: the same at M <= 256 (swap-AB tiles);
  ``attn_fp8``: decode attention on an FP8 cache (static and dynamic scales), the swap-AB kernel;
  ``attn_fp8_unswapped``: the same, the unswapped kernel;
  ``attn_fp8_bs128``, ``attn_fp8_st3``: the swap-AB kernel over 128-slot tiles, and with the
  3-stage ring (``bench_decode``'s ``:bs128`` and ``:st3`` arms; not measured yet: their
  predictions take ``attn_fp8``'s factor). A row runs at its ring depth (``compare
  .ring_depth``: recorded, or the defaults of the first run, 3 stages on FP8).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import statistics
import sys

from kernels_pallas.perf_model.sass_profiles import RESULTS_DIR

# The first device run (one H200, jax 0.11.2, 2026-12-04: experiments/results/
# gpu_h200_2026-12-04) found our FP8 kernels slower than the SASS model (``gpu.py``) by these
# factors: per family, the median of CUPTI kernel time / the predicted kernel time without its
# launch (``factors`` derives them from that run's files; a test checks they match). The
# baselines' stated efficiencies held there (cuBLAS BF16 GEMMs median 1.07x of the model over 19
# shapes; the BF16-cache attention 0.89-1.06x), so they stay unscaled. The same run set the
# model's GEMM load latency and per-wave fill (``fit``: the pair that leaves the decode GEMMs'
# ratios the least spread; their factor was 1.74, 1.28-2.56, with the earlier guesses and a
# latency term that left out the step's compute) and the attention kernels' load round trip
# (``attention_latency``: their factor was 1.35-1.39, the FP8 kernel's ring-bound 68% of HBM
# modelled at 88%). The prefill GEMMs' factor was 1.28 (0.72-1.42) until the model put the two
# compute warpgroups' MMAs in turn on each one's chain (they run in step: ``gpu.step_cycles``)
# and charged a later wave one load round trip (``fit_waves``) with 9 TB/s of L2 bandwidth
# (``gpu.L2_BYTES_PER_S``): 1.01 (0.99-1.08), nothing fitted to it but the per-wave cost. The
# paged attention kernel (not measured) shares the dense kernel's loop: it takes ``attn_fp8``.
# Every
# prediction, rollout and target of the model is calibrated by default; ``uncalibrated()`` gives
# the SASS model alone.
KERNEL_CALIBRATION = {
    "mm_prefill": 1.01,  # 6 shapes at M = 4096: 0.99-1.08 (0.72-1.42 before the chain in step)
    "mm_decode": 1.15,  # 12 shapes at M = 16 / 64: 1.01-1.30 (1.28-2.56 before ``fit``)
    "attn_fp8": 1.02,  # 6 (3 shapes x static / dynamic scales): 0.97-1.16
    "attn_fp8_unswapped": 1.22,  # 6: 1.13-1.32
}
_CALIBRATED = [True]


@contextlib.contextmanager
def uncalibrated():
    """Predictions without ``KERNEL_CALIBRATION`` inside this block (the SASS model alone)."""
    _CALIBRATED.append(False)
    try:
        yield
    finally:
        _CALIBRATED.pop()


def calibration(family: str) -> float:
    """The factor ``gpu.py`` scales a ``family`` kernel's time by (1 inside ``uncalibrated``)."""
    return KERNEL_CALIBRATION[family] if _CALIBRATED[-1] else 1.0


DEFAULT_DIR = os.path.join(RESULTS_DIR, "gpu_h200_2026-12-04")
# the files of that run holding each measurement (run 1: M = 4096; run 2 after the fixes it
# prompted: M = 16 / 64 and the complete decode attention table)
DEFAULT_FILES = ("run1/bench_matmul.json", "run2/bench_matmul.json", "run2/bench_decode.json")


def family(row: dict) -> str | None:
    impl = row.get("impl", "")
    if "cache" in row:
        if row.get("lengths") != "full" or not impl.startswith("pallas_mosaic_gpu"):
            return None
        if row["cache"] == "bf16":
            return "baseline: attn_bf16 (our kernel, BF16_ATTN_BW_EFF)"
        arm = impl.partition(":")[2]  # bench_decode's arms: "", "unswapped", "bs128", "st3"
        return "attn_fp8" + (f"_{arm}" if arm else "")
    if impl in ("fp8:pallas_mosaic_gpu", "fp8:pallas_mosaic_gpu:plain"):
        return "mm_prefill" if row["m"] > 256 else "mm_decode"
    if impl == "bf16":
        return "baseline: bf16 GEMM (BF16_GEMM_EFF / _BW_EFF)"
    return None


def _launch_us(row: dict) -> float:
    """The launch the model's prediction of a bench row holds (CUPTI's kernel time has none):
    ``gpu.PDL_LAUNCH_S`` for a kernel launched dependent (as ``compare`` reads the row), else
    ``gpu.LAUNCH_S``."""
    from kernels_pallas.perf_model import compare, gpu

    pdl = row.get("pdl", False) if "cache" in row else compare.matmul_config(row).pdl
    return (gpu.PDL_LAUNCH_S if pdl else gpu.LAUNCH_S) * 1e6


def ratios(paths: list[str], chip: str | None = None) -> dict[str, list[float]]:
    """family -> measured / predicted kernel time (the uncalibrated model, launch excluded)."""
    from kernels_pallas.perf_model import compare

    out = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        c = chip or compare.chip_of(data.get("meta", {}).get("device_kind", ""))
        for row in data.get("rows", []):
            fam, meas = family(row), row.get("median_us")
            if fam is None or meas is None:
                continue
            with imported_uncalibrated():
                pred = compare.predicted_us(c, row)
            if pred is not None:
                out[fam].append(meas / (pred - _launch_us(row)))
    return dict(out)


def factors(paths: list[str]) -> dict[str, float]:
    """family -> the median ratio, rounded to 2 digits (``KERNEL_CALIBRATION``'s values)."""
    return {k: round(statistics.median(v), 2) for k, v in ratios(paths).items()}


FIT_LATENCIES_S = (0.6e-6, 0.8e-6, 1.0e-6, 1.2e-6, 1.4e-6)
FIT_FILLS_S = (1e-6, 2e-6, 3e-6, 4e-6, 5e-6)
FIT_WAVES_S = (0.0, 0.5e-6, 1e-6, 2e-6, 3e-6, 4e-6)


def _spread(paths: list[str], family_: str, **constants) -> dict | None:
    """``family_``'s measured / modelled ratios with ``gpu``'s ``constants`` set (restored
    after): median, min, max and coefficient of variation; None if the files have no row."""
    from kernels_pallas.perf_model import gpu

    saved = {k: getattr(gpu, k) for k in constants}
    try:
        for k, v in constants.items():
            setattr(gpu, k, v)
        v = ratios(paths).get(family_)
    finally:
        for k, v0 in saved.items():
            setattr(gpu, k, v0)
    return _stats(v) if v else None


def _stats(v: list[float]) -> dict:
    """Median, min, max and coefficient of variation of measured / modelled ratios."""
    return dict(median=statistics.median(v), min=min(v), max=max(v),
                cv=statistics.pstdev(v) / statistics.mean(v))  # fmt: skip


def fit(paths: list[str], family_: str = "mm_decode", latencies=FIT_LATENCIES_S,
        fills=FIT_FILLS_S) -> list[dict]:  # fmt: skip
    """How well the model's shape follows the device, per (``gpu.DRAM_LATENCY_S``,
    ``gpu.FILL_S``): the spread of ``family_``'s measured / modelled ratios (median, min, max,
    coefficient of variation). A constant factor is what ``KERNEL_CALIBRATION`` absorbs; the
    spread is what it cannot, so the pair with the least spread is the model's (``gpu.py``).
    ``gpu.WAVE_S`` follows the latency (a later wave's first round trip), as in the model."""
    out = []
    for lat in latencies:
        for fill in fills:
            sp = _spread(paths, family_, DRAM_LATENCY_S=lat, FILL_S=fill, WAVE_S=lat)
            if sp is None:  # the run measured none of them (e.g. GEMMs at M = 4096 only)
                return []
            out.append(dict(sp, latency_s=lat, fill_s=fill))
    return out


def fit_waves(paths: list[str], family_: str = "mm_prefill", waves=FIT_WAVES_S) -> list[dict]:
    """The same for ``gpu.WAVE_S`` (what each later wave of a non-persistent grid costs) on the
    multi-wave prefill GEMMs (4-12 waves of 32-128 K steps at M = 4096)."""
    out = []
    for w in waves:
        sp = _spread(paths, family_, WAVE_S=w)
        if sp is None:
            return []
        out.append(dict(sp, wave_s=w))
    return out


def baseline_fill(paths: list[str], max_m: int = 256) -> list[dict]:
    """The BF16 ``jnp.dot`` baseline's memory-bound rows (M <= ``max_m``): the spread of their
    measured / modelled times without and with the per-kernel ``gpu.FILL_S``
    (``gpu.bf16_gemm_s``'s ``fill``), launch excluded as in ``ratios``."""
    import json

    from kernels_pallas.perf_model import compare, gpu

    out = []
    for fill in (False, True):
        v = []
        for path in paths:
            with open(path) as f:
                data = json.load(f)
            chip = compare.chip_of(data.get("meta", {}).get("device_kind", ""))
            for r in data.get("rows", []):
                if r.get("impl") == "bf16" and r.get("median_us") and r["m"] <= max_m and chip:
                    pred = gpu.bf16_gemm_s(chip, r["m"], r["n"], r["k"], fill) - gpu.LAUNCH_S
                    v.append(r["median_us"] * 1e-6 / pred)
        if not v:
            return []
        out.append(dict(_stats(v), fill_s=gpu.FILL_S if fill else 0.0))
    return out


def attention_latency(paths: list[str], chip: str | None = None) -> list[dict]:
    """Per full-row decode attention row of our Hopper kernels (both caches, every arm): the load
    round trip its ring saw, ``stages x step - chain`` (Little's law on the model's step formula,
    ``gpu.step_cycles``: a slot turns over once per load plus the step that reads it), with
    ``step`` the measured time over the CTA's tile steps and waves, ``stages`` the row's ring
    depth (``compare.ring_depth``) and ``chain`` the SASS model's serial path of one step. What
    set ``gpu_attention.ATTN_LOAD_LATENCY_S``; on a later run, whether a deeper ring kept it."""
    from kernels_pallas.perf_model import compare, gpu
    from kernels_pallas.perf_model.common import CHIPS

    out = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        c = chip or compare.chip_of(data.get("meta", {}).get("device_kind", ""))
        for row in data.get("rows", []):
            if "cache" not in row or row.get("median_us") is None or c is None:
                continue
            with imported_uncalibrated():
                p = compare.attention_prediction(c, row)
            if p is None:
                continue
            t, stages = p.terms, compare.ring_depth(row)
            steps = -(-row["s"] // t["block_s"] // t["splits"])
            step_s = (row["median_us"] * 1e-6 - gpu.FILL_S - (t["waves"] - 1) * gpu.WAVE_S) \
                / (t["waves"] * steps)  # fmt: skip
            chain_s = t["chain"] / CHIPS[c].clock_hz
            out.append(dict(label=f"{row.get('model', '')} B={row['b']} S={row['s']} "
                                  f"{row['cache']} {row['impl']}",
                            cache="bf16" if row["cache"] == "bf16" else "fp8",
                            swap_ab=not row["impl"].endswith(":unswapped"), stages=stages,
                            step_s=step_s, latency_s=stages * step_s - chain_s))  # fmt: skip
    return out


def imported_uncalibrated():
    """``uncalibrated`` of the imported module, whose switch gpu.py reads (run as ``python -m``,
    this file is ``__main__``, a second copy whose ``uncalibrated`` gpu.py would not see)."""
    from kernels_pallas.perf_model import calibration as imported

    return imported.uncalibrated()


def quantize_check(paths: list[str], chip: str | None = None) -> list[dict]:
    """XLA's quantization of BF16 x measured (at M > 256, where ``fp8_matmul`` quantized with
    XLA until the act_quantize kernel took every M: the ``+quant`` row minus the kernel's row of
    the same shape) beside ``gpu.quantize_s`` for XLA and for the kernel, and the GEMM from BF16
    x over cuBLAS BF16: measured (with XLA's quantization) and predicted with the kernel's (the
    measured GEMM plus the modelled quantization)."""
    from kernels_pallas.perf_model import compare, gpu

    out = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        c = chip or compare.chip_of(data.get("meta", {}).get("device_kind", ""))
        rows = {(r["m"], r["n"], r["k"], r.get("impl")): r for r in data.get("rows", [])
                if "m" in r and r.get("median_us") is not None}  # fmt: skip
        for (m, n, k, impl), r in rows.items():
            base, bf16 = (rows.get((m, n, k, i)) for i in ("fp8:pallas_mosaic_gpu", "bf16"))
            if impl != "fp8:pallas_mosaic_gpu+quant" or m <= 256 or None in (base, bf16):
                continue
            kernel_us = gpu.quantize_s(c, m, k) * 1e6
            out.append(dict(
                label=f"{r.get('model', '')} {r.get('layer', '')} M={m} K={k}".strip(),
                measured_us=r["median_us"] - base["median_us"],
                xla_us=gpu.quantize_s(c, m, k, "xla") * 1e6, kernel_us=kernel_us,
                speedup_measured=bf16["median_us"] / r["median_us"],
                speedup_predicted=bf16["median_us"] / (base["median_us"] + kernel_us),
            ))  # fmt: skip
    return out


def print_fit(rows: list[dict], grid: tuple, family_: str) -> None:
    """One ``--fit`` table: the grid's columns ((header, key, format), in us), then the spread
    of ``family_``'s measured / modelled ratios at each point."""
    heads = [h for h, _, _ in grid] + [f"{family_} measured / modelled: median", "min", "max",
                                       "coefficient of variation"]  # fmt: skip
    print("| " + " | ".join(heads) + " |\n" + "|---" * len(heads) + "|")
    if not rows:
        print(f"| (no {family_} rows in these files: no fit) |" + " |" * (len(heads) - 1))
    for r in rows:
        cells = [f"{r[key] * 1e6:{fmt}}" for _, key, fmt in grid]
        cells += [f"{r[k]:.2f}" for k in ("median", "min", "max")] + [f"{r['cv']:.3f}"]
        print("| " + " | ".join(cells) + " |")


def modelled(paths: list[str]) -> tuple[list[str], list[str]]:
    """(the bench files whose device the model has, notes naming the others): a CPU run's
    files (``gpu_check.sh --quick``) have no chip to predict."""
    import json

    from kernels_pallas.perf_model import compare

    keep, notes = [], []
    for path in paths:
        with open(path) as f:
            kind = json.load(f).get("meta", {}).get("device_kind", "")
        if compare.chip_of(kind) is None:
            notes.append(f"({path}: device {kind or '?'}: no model)")
        else:
            keep.append(path)
    return keep, notes


def main(argv=None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    show_fit = "--fit" in args
    args = [a for a in args if a != "--fit"]
    if args and all(a.endswith(".json") for a in args):  # a new run's bench files
        paths = [a for a in args if os.path.exists(a)]
    else:
        root = args[0] if args else DEFAULT_DIR
        paths = [p for f in DEFAULT_FILES if os.path.exists(p := os.path.join(root, f))]
    paths, notes = modelled(paths)
    for note in notes:
        print(note)
    if show_fit:
        print_fit(fit(paths), (("DRAM_LATENCY_S (us)", "latency_s", ".1f"),
                               ("FILL_S (us)", "fill_s", ".0f")), "mm_decode")  # fmt: skip
        print()
        print_fit(fit_waves(paths), (("WAVE_S (us)", "wave_s", ".1f"),), "mm_prefill")
        print()
        print_fit(baseline_fill(paths), (("BF16 GEMM fill (us)", "fill_s", ".0f"),),
                  "bf16 GEMM, M <= 256")  # fmt: skip
        return 0
    print("| family | rows | measured / predicted: median | min | max | KERNEL_CALIBRATION |")
    print("|---|---|---|---|---|---|")
    for fam, v in sorted(ratios(paths).items()):
        have = KERNEL_CALIBRATION.get(fam, "-")
        print(f"| {fam} | {len(v)} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} "
              f"| {have} |")  # fmt: skip
    print("\n| decode attention row (full lengths) | ring stages | measured step (us) | load round "
          "trip it implies (us) |\n|---|---|---|---|")  # fmt: skip
    for r in attention_latency(paths):
        print(f"| {r['label']} | {r['stages']} | {r['step_s'] * 1e6:.2f} | "
              f"{r['latency_s'] * 1e6:.2f} |")  # fmt: skip
    print("\n| BF16 x quantized (M > 256) | XLA: measured us | XLA: model | act_quantize: model "
          "| GEMM + quant / BF16: measured (XLA) | predicted (act_quantize) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for q in quantize_check(paths):
        print(f"| {q['label']} | {q['measured_us']:.1f} | {q['xla_us']:.1f} | "
              f"{q['kernel_us']:.1f} | {q['speedup_measured']:.2f}x | "
              f"{q['speedup_predicted']:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
