"""FP8 training GEMMs: the rollout's W8A8 forward with straight-through BF16 or FP8 (DeepSeek-V3)
backward GEMMs, beside a float64 reference (``reference.py``)."""

from kernels_pallas.fp8_train_matmul.api import (
    BACKWARDS,
    TrainMatmulConfig,
    bf16_grads,
    fp8_grads,
    fp8_train_matmul,
    quantize_train_weight,
    transpose_weight,
)
from kernels_pallas.fp8_train_matmul.reference import train_matmul_grads_reference

__all__ = [
    "BACKWARDS",
    "TrainMatmulConfig",
    "bf16_grads",
    "fp8_grads",
    "fp8_train_matmul",
    "quantize_train_weight",
    "train_matmul_grads_reference",
    "transpose_weight",
]
