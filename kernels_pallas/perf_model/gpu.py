"""GPU half of the performance model (H100 / H200, Mosaic GPU kernels). Being written."""

from __future__ import annotations

from kernels_pallas.perf_model.common import Case, Prediction

CASES: list[Case] = []


def predict_gpu(op: str, shape: dict, chip: str) -> Prediction:
    raise NotImplementedError
