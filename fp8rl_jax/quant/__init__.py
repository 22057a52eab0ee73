"""FP8 formats, the QArray pytree, blockwise/per-token quantization and ``quantize_params``."""

from fp8rl_jax.quant.matmul import matmul
from fp8rl_jax.quant.params import QuantStats, path_str, quantize_params, should_quantize
from fp8rl_jax.quant.recipe import DEFAULT_EXCLUDE, QuantRecipe
from fp8rl_jax.quant.train import (
    KVFakeQuant,
    TrainQWeight,
    grouped_train_matmul,
    kv_fake_quant,
    train_weights,
)
from kernels_pallas.qarray import QArray, dequantize, dequantize_weight, fp8_dtype, fp8_max
from kernels_pallas.quantize import quantize_activations, quantize_blockwise, quantize_weight

__all__ = [
    "DEFAULT_EXCLUDE",
    "KVFakeQuant",
    "QArray",
    "QuantRecipe",
    "QuantStats",
    "TrainQWeight",
    "dequantize",
    "dequantize_weight",
    "fp8_dtype",
    "fp8_max",
    "grouped_train_matmul",
    "kv_fake_quant",
    "matmul",
    "path_str",
    "quantize_activations",
    "quantize_blockwise",
    "quantize_weight",
    "quantize_params",
    "should_quantize",
    "train_weights",
]
