"""``python -m kernels_pallas.perf_model [--out PATH]``: predict, print, write JSON + md."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from kernels_pallas.perf_model import common, gpu, tpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, "experiments", "results", "perf_model.json")


def run_all(chips=None) -> list[common.Prediction]:
    """Predictions of both halves' cases on the chips they name (``chips`` filters)."""
    preds = []
    for cases, predict in ((gpu.CASES, gpu.predict_gpu), (tpu.CASES, tpu.predict_tpu)):
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
    print(common.table(preds))
    common.write_results(preds, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
