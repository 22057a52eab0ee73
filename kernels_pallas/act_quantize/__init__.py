"""Per-token 1x128 FP8 activation quantization as one GPU kernel (reference:
``kernels_pallas.quantize.quantize_activations``)."""

from kernels_pallas.act_quantize.pallas_triton import quantize_activations_triton, supports

__all__ = ["quantize_activations_triton", "supports"]
