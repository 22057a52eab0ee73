"""Blockwise FP8 W8A8 matmul: jnp reference, Mosaic GPU (Hopper) and Mosaic TPU kernels."""

from kernels_pallas.fp8_matmul.api import default_impl, fp8_matmul
from kernels_pallas.fp8_matmul.reference import fp8_matmul_reference

__all__ = ["default_impl", "fp8_matmul", "fp8_matmul_reference"]
