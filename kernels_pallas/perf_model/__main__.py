"""``python -m kernels_pallas.perf_model [--out PATH]``: predict, print, write JSON + md."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from kernels_pallas.perf_model import (
    common,
    gpu,
    gpu_grouped,
    gpu_rollout,
    gpu_rollout_moe,
    gpu_targets,
    tpu,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, "experiments", "results", "perf_model.json")


def run_all(chips=None) -> list[common.Prediction]:
    """Predictions of both halves' cases on the chips they name (``chips`` filters)."""
    preds = []
    halves = ((gpu_targets.CASES, gpu_targets.predict_gpu),
              (gpu_grouped.CASES, gpu_grouped.predict), (tpu.CASES, tpu.predict_tpu))  # fmt: skip
    for cases, predict in halves:
        for case in cases:
            for chip in case.chips:
                if chips is None or chip in chips:
                    pred = predict(case.op, case.dims, chip)
                    preds.append(dataclasses.replace(pred, label=case.label))
    return preds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--chip", action="append", help="only these chips (repeatable)")
    args = ap.parse_args(argv)
    preds = run_all(args.chip)
    changes = gpu_targets.design_changes() + gpu_grouped.design_changes()
    steps = gpu_rollout.predictions()
    moe_steps = gpu_rollout_moe.predictions()
    goals = [*gpu_targets.targets(preds), gpu_rollout.target(steps), *tpu.targets(preds)]
    h100_64 = [p for p in steps if p.chip == "h100" and p.batch == 64]  # one per engine
    sections = {
        "Calibration on a device (H200, 2026-12-04)": calibration_section(),
        "Design changes, before -> after (predicted, calibrated)": "\n\n".join(
            (pick_summary(changes), change_table(changes))
        ),
        "Rollout decode step, W8A8 + FP8 KV vs BF16 (predicted, calibrated)": "\n\n".join(
            (
                gpu_rollout.table(steps),
                *map(gpu_rollout.breakdown, h100_64),
                gpu_rollout.paged_bookkeeping_change(),
                gpu_rollout.__doc__.strip(),
            )  # fmt: skip
        ),
        "MoE rollout decode step, W8A8 + FP8 KV vs BF16 (predicted, calibrated)": "\n\n".join(
            (
                gpu_rollout.table(moe_steps),
                *(
                    gpu_rollout.breakdown(p)
                    for p in moe_steps
                    if p.chip == "h100" and p.batch == 64
                ),
                gpu_rollout_moe.__doc__.strip(),
            )  # fmt: skip
        ),
        "Issue-21 targets (predicted, calibrated: H100, TPU v5e / v6e)": "\n".join(goals),
        "GPU model and its assumptions": gpu.__doc__.strip(),
    }
    print(common.table(preds))
    for title, text in sections.items():
        print(f"\n## {title}\n\n{text}")
    extra = dict(
        targets=goals,
        rollout_steps=[p.to_json() for p in steps],
        moe_rollout_steps=[p.to_json() for p in moe_steps],
        design_changes=[
            dict(change=c, before=b.to_json(), after=a.to_json()) for c, b, a in changes
        ],
    )
    common.write_results(preds, args.out, extra, sections)
    return 0


def calibration_section() -> str:
    """The measured / modelled factors the predictions carry, and the rollout they predict."""
    import contextlib
    import io

    from kernels_pallas.perf_model import calibration

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        calibration.main([])
    return "\n\n".join((
        "Every FP8-kernel prediction below is the SASS model x its family's factor (`gpu.py`, "
        "`KERNEL_CALIBRATION`): CUPTI kernel time / modelled kernel time on the first device "
        "run (`experiments/results/gpu_h200_2026-12-04`; `python -m "
        "kernels_pallas.perf_model.calibration`). The baselines are not scaled.",
        buf.getvalue().strip(),
        "The rollout decode step, predicted from the kernel factors alone, beside the measured "
        "one (`gpu_rollout.validation`):",
        gpu_rollout.validation_table(),
    ))  # fmt: skip


def pick_summary(changes) -> str:
    """The model-picked tiles' rows in one line per chip (their ratio to BF16 in a program),
    the fused-kernel picks at 17-64 rows' (standalone, raw BF16 x) and the grouped FP8 kernel's
    decode tiles': the geometric mean and the range of the ratio, before -> after."""
    import math

    gm = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
    t, lines = gpu_targets, []
    for change, what, total, keep in (
        (t.PICK_CHANGE, "take a model-picked tile; in a program",
         len(t.PICK_LAYERS) * len(t.PICK_ROWS), lambda p: p.label.endswith(", in program")),
        (t.FUSED_PICK_CHANGE, "with raw BF16 x run fused (no act_quantize launch); standalone",
         len(t.PICK_LAYERS) * len(t.FUSED_PICK_ROWS), lambda p: True),
        (gpu_grouped.GROUPED_TILE_CHANGE, "of the FP8 MoE experts (grouped) take 128 weight "
         "rows per CTA; standalone, FP8 x",
         len(gpu_grouped.GROUPED_FP8_LAYERS) * len(gpu_grouped.GROUPED_FP8_ROWS), lambda p: True),
    ):  # fmt: skip
        for chip in common.GPU_CHIPS:
            rows = [(b, a) for c, b, a in changes if c == change and a.chip == chip and keep(a)]
            if not rows:
                continue
            before, after = [b.ratio for b, _ in rows], [a.ratio for _, a in rows]
            speed = [b.time_s / a.time_s for b, a in rows]
            lines.append(f"- {chip}: {len(rows)} GEMMs (of {total} shapes x rows) {what}, "
                         f"FP8 / BF16 {gm(before):.2f}x -> {gm(after):.2f}x (geometric mean; "
                         f"worst {min(before):.2f}x -> {min(after):.2f}x), each "
                         f"{min(speed):.2f}-{max(speed):.2f}x faster")  # fmt: skip
    return "\n".join(lines)


def change_table(changes) -> str:
    rows = ["| change | case | chip | before | after | before (us) | after (us) | BF16 (us) "
            "| ratio vs BF16 before -> after |", "|" + "---|" * 9]  # fmt: skip
    for c, b, a in changes:
        rows.append(f"| {c} | {a.label} | {a.chip} | {b.impl} | {a.impl} | {b.time_s * 1e6:.1f} "
                    f"| {a.time_s * 1e6:.1f} | {a.baseline_s * 1e6:.1f} | "
                    f"{b.ratio:.2f}x -> {a.ratio:.2f}x |")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
