"""Why ``fp8_matmul`` runs the tile it does at a shape: the rules' tile, the dispatch's pick
(``fp8_matmul.tile_choice``) and the performance model's fastest candidates, each predicted
inside a program, calibrated and by the SASS model alone, beside the BF16 GEMM.

  python -m kernels_pallas.perf_model.tile_report 256 4096 12288 [--chip h200] [--f32-out]
"""

from __future__ import annotations

import argparse
import sys

from kernels_pallas.fp8_matmul import mgpu_config as mc
from kernels_pallas.fp8_matmul import tile_choice as tc
from kernels_pallas.perf_model import gpu


def report(m: int, n: int, k: int, *, chip: str = "h100", out_itemsize: int = 2,
           top: int = 8) -> str:  # fmt: skip
    """A markdown table of the rules' tile, the dispatch's and the model's ``top`` fastest at
    [M, K] x [N, K] (FP8 x), in microseconds, each row tagged with what runs it."""
    rule = mc.default_config(m, n, k, out_itemsize=out_itemsize)
    got = tc.dispatch_config(m, n, k, out_itemsize=out_itemsize, chip=chip)
    bf16 = gpu.bf16_gemm_s(chip, m, n, k, fill=False)
    order = tc.ranked(m, n, k, out_itemsize=out_itemsize, chip=chip)
    times = {c: t for t, c in order}
    shown = [c for _, c in order[:top]]
    shown += [c for c in dict.fromkeys((rule, got)) if c not in shown and c in times]
    rows = [f"fp8_matmul M={m} N={n} K={k} on {chip}, in a program (predicted; BF16 GEMM "
            f"{bf16 * 1e6:.1f} us)", "",
            "| tile | calibrated us | SASS alone us | BF16 / tile | runs it |",
            "|---|---|---|---|---|"]  # fmt: skip
    for c in shown:
        t = times[c]
        tags = ", ".join(s for s, hit in (("rules", c == rule), ("dispatch", c == got)) if hit)
        rows.append(f"| {tc.name(c)} | {t * 1e6:.1f} | {tc._sass_alone(chip, m, n, k, c) * 1e6:.1f}"
                    f" | {bf16 / t:.2f}x | {tags} |")  # fmt: skip
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("m", type=int, help="rows of x (tokens)")
    ap.add_argument("n", type=int, help="output features (weight rows)")
    ap.add_argument("k", type=int, help="input features")
    ap.add_argument("--chip", choices=("h100", "h200"), default="h100")
    ap.add_argument("--f32-out", action="store_true", help="F32 output (fewer stages fit)")
    ap.add_argument("--top", type=int, default=8, help="the model's fastest shown")
    a = ap.parse_args(argv)
    if a.m < 1 or a.k < mc.GROUP or a.k % mc.GROUP or a.n < 64 or a.n % 64:
        ap.error(f"M must be >= 1, K a positive multiple of {mc.GROUP} and N of 64 "
                 f"(got M={a.m}, N={a.n}, K={a.k})")  # fmt: skip
    print(report(a.m, a.n, a.k, chip=a.chip, out_itemsize=4 if a.f32_out else 2, top=a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
