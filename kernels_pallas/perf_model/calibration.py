"""The performance model against the first device run: ``gpu.KERNEL_CALIBRATION`` from data.

``python -m kernels_pallas.perf_model.calibration [RESULTS_DIR]`` reads the benchmark JSONs of a
``scripts/gpu_check.sh`` run (default: the H200 run of 2026-12-04,
``experiments/results/gpu_h200_2026-12-04``) and prints, per kernel family, the median over its
rows of (CUPTI kernel time) / (the model's uncalibrated kernel time without its launch): the
factor ``gpu.KERNEL_CALIBRATION`` holds. A factor is for our Pallas kernels only; the baselines
(cuBLAS BF16 GEMMs, the BF16-cache attention) are printed too, as a check of their stated
efficiencies, and are not scaled.

Families (the rows ``compare.predicted_us`` models, the kernel alone: no ``+quant`` / ``+add``):
  ``mm_prefill``: ``fp8:pallas_mosaic_gpu`` at M > 256 (the QArray kernel's prefill tiles);
  ``mm_decode``: the same at M <= 256 (swap-AB tiles);
  ``attn_fp8``: decode attention on an FP8 cache (static and dynamic scales), the swap-AB kernel;
  ``attn_fp8_unswapped``: the same, the unswapped kernel.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys

from kernels_pallas.perf_model import compare, gpu

DEFAULT_DIR = os.path.join(os.path.dirname(gpu.SASS_JSON), "gpu_h200_2026-12-04")
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
        return "attn_fp8_unswapped" if impl.endswith(":unswapped") else "attn_fp8"
    if impl == "fp8:pallas_mosaic_gpu":
        return "mm_prefill" if row["m"] > 256 else "mm_decode"
    if impl == "bf16":
        return "baseline: bf16 GEMM (BF16_GEMM_EFF / _BW_EFF)"
    return None


def ratios(paths: list[str], chip: str | None = None) -> dict[str, list[float]]:
    """family -> measured / predicted kernel time (the uncalibrated model, launch excluded)."""
    out = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        c = chip or compare.chip_of(data.get("meta", {}).get("device_kind", ""))
        for row in data.get("rows", []):
            fam, meas = family(row), row.get("median_us")
            if fam is None or meas is None:
                continue
            with gpu.uncalibrated():
                pred = compare.predicted_us(c, row)
            if pred is not None:
                out[fam].append(meas / (pred - gpu.LAUNCH_S * 1e6))
    return dict(out)


def factors(paths: list[str]) -> dict[str, float]:
    """family -> the median ratio, rounded to 2 digits (``gpu.KERNEL_CALIBRATION``'s values)."""
    return {k: round(statistics.median(v), 2) for k, v in ratios(paths).items()}


def main(argv=None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    root = args[0] if args else DEFAULT_DIR
    paths = [os.path.join(root, f) for f in DEFAULT_FILES]
    print("| family | rows | measured / predicted: median | min | max | in gpu.py |")
    print("|---|---|---|---|---|---|")
    for fam, v in sorted(ratios(paths).items()):
        have = gpu.KERNEL_CALIBRATION.get(fam, "-")
        print(f"| {fam} | {len(v)} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} "
              f"| {have} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
