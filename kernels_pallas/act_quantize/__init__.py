"""Per-token 1x128 FP8 activation quantization as GPU kernels: standalone (``act_quantize``'s
one launch, reference ``kernels_pallas.quantize.quantize_activations``) and fused into the
producers of the FP8 GEMMs' inputs (``fused.py``: RMSNorm, SwiGLU, decode attention's combine;
references in ``reference.py``; dispatch in ``api.py``)."""

from kernels_pallas.act_quantize.api import (
    fp8_input_dtype,
    quantizes_for,
    rmsnorm_quantize,
    swiglu_quantize,
)
from kernels_pallas.act_quantize.pallas_triton import quantize_activations_triton, supports

__all__ = [
    "fp8_input_dtype",
    "quantize_activations_triton",
    "quantizes_for",
    "rmsnorm_quantize",
    "supports",
    "swiglu_quantize",
]
