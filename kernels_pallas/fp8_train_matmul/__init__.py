"""FP8 training GEMMs: the rollout's W8A8 forward with straight-through BF16 or FP8 (DeepSeek-V3)
backward GEMMs (``api.py``; MoE expert stacks: ``grouped.py``), beside a float64 reference
(``reference.py``)."""

from kernels_pallas.fp8_train_matmul.api import (
    BACKWARDS,
    TrainMatmulConfig,
    bf16_grads,
    fp8_grads,
    fp8_train_matmul,
    quantize_train_weight,
    transpose_weight,
)
from kernels_pallas.fp8_train_matmul.grouped import (
    grouped_fp8_grads,
    grouped_fp8_train_matmul,
    quantize_token_groups,
    token_tiles,
)
from kernels_pallas.fp8_train_matmul.reference import (
    grouped_train_grads_reference,
    train_matmul_grads_reference,
)

__all__ = [
    "BACKWARDS",
    "TrainMatmulConfig",
    "bf16_grads",
    "fp8_grads",
    "fp8_train_matmul",
    "grouped_fp8_grads",
    "grouped_fp8_train_matmul",
    "grouped_train_grads_reference",
    "quantize_token_groups",
    "quantize_train_weight",
    "token_tiles",
    "train_matmul_grads_reference",
    "transpose_weight",
]
