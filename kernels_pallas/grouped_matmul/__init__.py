"""BF16 grouped matmul for the MoE experts' training GEMMs (rows sorted by expert, weights
``[E, K, N]``), differentiable: ``jax.lax.ragged_dot`` (XLA) and Hopper kernels that compute only
the live rows, forward and backward."""

from kernels_pallas.grouped_matmul.api import IMPLEMENTATIONS, grouped_matmul, operand_error
from kernels_pallas.grouped_matmul.pallas_mosaic_gpu import GmmConfig
from kernels_pallas.grouped_matmul.reference import (
    grouped_matmul_reference,
    grouped_wgrad_reference,
)

__all__ = [
    "IMPLEMENTATIONS",
    "GmmConfig",
    "grouped_matmul",
    "grouped_matmul_reference",
    "grouped_wgrad_reference",
    "operand_error",
]
