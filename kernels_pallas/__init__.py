"""Pallas kernels for FP8 rollouts, each beside a pure-jnp reference with the same signature.

This package never imports ``fp8rl_jax`` (the library imports it, not the reverse).
"""

from kernels_pallas.backend import KernelImpls
from kernels_pallas.fp8_matmul import fp8_matmul
from kernels_pallas.grouped_fp8_matmul import grouped_fp8_matmul
from kernels_pallas.qarray import QArray, dequantize, dequantize_weight, fp8_dtype, fp8_max
from kernels_pallas.quantize import quantize_activations, quantize_blockwise, quantize_weight

__all__ = [
    "KernelImpls",
    "QArray",
    "dequantize",
    "dequantize_weight",
    "fp8_dtype",
    "fp8_matmul",
    "fp8_max",
    "grouped_fp8_matmul",
    "quantize_activations",
    "quantize_blockwise",
    "quantize_weight",
]
