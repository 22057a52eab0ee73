"""TPU half of the performance model: a stub, filled in by the ``tpu`` branch.

Interface (``common`` documents it): ``CASES: list[Case]`` and
``predict_tpu(op, shape, chip) -> Prediction`` for chips "v5e" / "v6e": grid steps x per-step
overhead + max(MXU FLOPs at the dot's tile fill, HBM bytes / bandwidth), from block shapes.
"""

from __future__ import annotations

from kernels_pallas.perf_model.common import Case, Prediction

CASES: list[Case] = []


def predict_tpu(op: str, shape: dict, chip: str) -> Prediction:
    raise NotImplementedError("perf_model.tpu: filled in by the tpu branch")
