"""Why ``fp8_matmul`` runs the tile it does at a shape: the rules' tile, the dispatch's pick
(``fp8_matmul.tile_choice``) and the performance model's fastest candidates, each predicted
inside a program, calibrated and by the SASS model alone, beside the BF16 GEMM. With
``--raw-x`` (BF16 x at 16-64 rows): the fused kernel's tiles ranked the same way, then why x is
quantized in-kernel or once (``tile_choice.fused_wins``: both paths in a program and standalone).

  python -m kernels_pallas.perf_model.tile_report 256 4096 12288 [--chip h200] [--f32-out]
  python -m kernels_pallas.perf_model.tile_report 32 4096 4096 --raw-x
"""

from __future__ import annotations

import argparse
import sys

from kernels_pallas.fp8_matmul import mgpu_config as mc
from kernels_pallas.fp8_matmul import tile_choice as tc
from kernels_pallas.perf_model import gpu


def report(m: int, n: int, k: int, *, chip: str = "h100", out_itemsize: int = 2,
           top: int = 8, fused: bool = False) -> str:  # fmt: skip
    """A markdown table of the rules' tile, the dispatch's and the model's ``top`` fastest at
    [M, K] x [N, K] (FP8 x; ``fused``: raw BF16 x through the fused kernel), in microseconds,
    each row tagged with what runs it."""
    rule = mc.default_config(m, n, k, fused=fused, out_itemsize=out_itemsize)
    got = tc.dispatch_config(m, n, k, fused=fused, out_itemsize=out_itemsize, chip=chip)
    bf16 = gpu.bf16_gemm_s(chip, m, n, k, fill=False)
    order = tc.ranked(m, n, k, fused=fused, out_itemsize=out_itemsize, chip=chip)
    times = {c: t for t, c in order}
    shown = [c for _, c in order[:top]]
    shown += [c for c in dict.fromkeys((rule, got)) if c not in shown and c in times]
    kernel = "the fused kernel (BF16 x quantized in-kernel)" if fused else "fp8_matmul"
    rows = [f"{kernel} M={m} N={n} K={k} on {chip}, in a program (predicted; BF16 GEMM "
            f"{bf16 * 1e6:.1f} us)", "",
            "| tile | calibrated us | SASS alone us | BF16 / tile | runs it |",
            "|---|---|---|---|---|"]  # fmt: skip
    for c in shown:
        t, raw = times[c], tc._sass_alone(chip, m, n, k, c, fused)
        tags = ", ".join(s for s, hit in (("rules", c == rule), ("dispatch", c == got)) if hit)
        rows.append(f"| {tc.name(c)} | {t * 1e6:.1f} | {raw * 1e6:.1f} | {bf16 / t:.2f}x "
                    f"| {tags} |")  # fmt: skip
    return "\n".join(rows)


def raw_x_report(m: int, n: int, k: int, *, chip: str = "h100", out_itemsize: int = 2,
                 top: int = 8) -> str:  # fmt: skip
    """Raw BF16 x at 16-64 rows: the fused kernel's tiles (``report(fused=True)``), then its
    dispatch tile against quantizing x once (``act_quantize``, then the FP8-x dispatch tile),
    in a program and standalone, calibrated and by the SASS model alone, and which runs
    (``api.fused_default``: always fused at 16 rows, elsewhere ``tile_choice.fused_wins``)."""
    from kernels_pallas.fp8_matmul import api

    fused = api.fused_default(m, n, k, chip)
    rows = [report(m, n, k, chip=chip, out_itemsize=out_itemsize, top=top, fused=True), "",
            f"raw BF16 x at M={m}: {'fused' if fused else 'quantized once'} (the fused kernel "
            f"runs where it is >{1 - tc.MODEL_MARGIN:.0%} faster in all four columns; at "
            f"{mc.FUSED_DECODE_ROWS} rows always)", "",
            "| path | tile | in a program us | SASS alone us | standalone us | SASS alone us "
            "| runs it |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    paths = tc.raw_x_times(m, n, k, out_itemsize=out_itemsize, chip=chip)
    for label, is_fused, (cfg, ts) in zip(("fused kernel", "act_quantize + QArray kernel"),
                                          (True, False), paths):  # fmt: skip
        runs = "yes" if fused == is_fused else ""
        rows.append(f"| {label} | {tc.name(cfg)} | " + " | ".join(f"{t * 1e6:.1f}" for t in ts)
                    + f" | {runs} |")  # fmt: skip
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("m", type=int, help="rows of x (tokens)")
    ap.add_argument("n", type=int, help="output features (weight rows)")
    ap.add_argument("k", type=int, help="input features")
    ap.add_argument("--chip", choices=("h100", "h200"), default="h100")
    ap.add_argument("--f32-out", action="store_true", help="F32 output (fewer stages fit)")
    ap.add_argument("--top", type=int, default=8, help="the model's fastest shown")
    ap.add_argument("--raw-x", action="store_true",
                    help="BF16 x (16-64 rows): the fused kernel's tiles and why x is quantized "
                         "in-kernel or once")  # fmt: skip
    a = ap.parse_args(argv)
    if a.m < 1 or a.k < mc.GROUP or a.k % mc.GROUP or a.n < 64 or a.n % 64:
        ap.error(f"M must be >= 1, K a positive multiple of {mc.GROUP} and N of 64 "
                 f"(got M={a.m}, N={a.n}, K={a.k})")  # fmt: skip
    rows = (mc.FUSED_DECODE_ROWS, mc._WGMMA_M)
    if a.raw_x and not rows[0] <= a.m <= rows[1]:
        ap.error(
            f"--raw-x: M={a.m} is outside {rows[0]}-{rows[1]} rows, where raw x is always "
            f"quantized once (act_quantize, then the FP8-x tile: run without --raw-x)"
        )
    show = raw_x_report if a.raw_x else report
    print(show(a.m, a.n, a.k, chip=a.chip, out_itemsize=4 if a.f32_out else 2, top=a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
