"""Blockwise FP8 W8A8 matmul: jnp reference, XLA fast paths, Mosaic GPU (Hopper) and Mosaic TPU
kernels, and the dispatcher ``fp8_matmul`` (weights ``[N, K]``, see ``qarray.py``)."""

from kernels_pallas.backend import default_impl
from kernels_pallas.fp8_matmul.api import IMPLEMENTATIONS, fp8_matmul
from kernels_pallas.fp8_matmul.pallas_mosaic_gpu import MgpuConfig
from kernels_pallas.fp8_matmul.pallas_tpu import TpuConfig
from kernels_pallas.fp8_matmul.reference import fp8_matmul_reference, operand_error
from kernels_pallas.fp8_matmul.xla import XlaConfig

__all__ = [
    "IMPLEMENTATIONS",
    "MgpuConfig",
    "TpuConfig",
    "XlaConfig",
    "default_impl",
    "fp8_matmul",
    "fp8_matmul_reference",
    "operand_error",
]
