"""Building blocks: RMSNorm, SwiGLU MLP, biased linear (Array or QArray weights).

Where every GEMM an activation feeds takes FP8 input (QArray weights, W8A8), the producer
quantizes it (``rms_norm_for``, ``swiglu_mlp``): on Hopper at decode sizes the producer and the
quantization are one kernel launch (``kernels_pallas.act_quantize``); elsewhere the same ops in
XLA as the plain producer followed by the GEMM's own quantization. They give the same bits where
XLA rounds every op as written (``--xla_allow_excess_precision=false``: the whole rollout is then
bit-identical either way); with XLA's default excess precision the moved fusion boundary changes
which BF16 roundings XLA skips inside a fusion (a last-bit change, as any refactor of the ops).
"""

from __future__ import annotations

import math

import jax

from fp8rl_jax.models.fused import GATE_UP, split_gate_up
from fp8rl_jax.quant import matmul
from kernels_pallas.act_quantize import (
    fp8_input_dtype,
    quantizes_for,
    rmsnorm_quantize,
    swiglu_quantize,
)
from kernels_pallas.act_quantize.reference import rms_norm, swiglu
from kernels_pallas.qarray import QArray

__all__ = ["fp8_input_dtype", "linear", "producer_dtype", "quant_impl", "rms_norm", "rms_norm_for",
           "swiglu_mlp"]  # fmt: skip


def quant_impl(matmul_impl: str) -> str:
    """The fused producers' impl for a model's ``KernelImpls.matmul``: XLA when the GEMMs are
    asked to run in XLA, else the target's choice."""
    return "xla" if matmul_impl == "xla" else "auto"


def producer_dtype(x, *consumers, impl: str = "auto"):
    """The FP8 format ``x``'s producer quantizes it to for the GEMMs of ``consumers`` (their
    ``fp8_input_dtype``), or None where they take it raw: no FP8 input, or on Hopper at the
    fused decode kernel's rows (``act_quantize.quantizes_for``); ``impl`` is the model's
    matmul impl."""
    dtype = fp8_input_dtype(*consumers)
    if dtype is None or quantizes_for(math.prod(x.shape[:-1]), quant_impl(impl)):
        return dtype
    return None


def rms_norm_for(x, w: jax.Array, eps: float, consumers: tuple, *, impl: str = "auto"):
    """``rms_norm(x, w, eps)``, quantized (a QArray) when every weight in ``consumers`` (the
    GEMMs that read it) takes FP8 input from its producer (``producer_dtype``); ``impl`` is the
    model's matmul impl."""
    dtype = producer_dtype(x, *consumers, impl=impl)
    if dtype is None:
        return rms_norm(x, w, eps)
    return rmsnorm_quantize(x, w, eps, dtype, impl=quant_impl(impl))


def linear(x, w, bias: jax.Array | None = None, *, impl: str = "auto") -> jax.Array:
    """``x @ w (+ bias)`` in ``x``'s dtype; ``w`` may be a QArray (blockwise W8A8 by ``impl``), and
    then ``x`` may be too (already quantized by its producer)."""
    if isinstance(x, QArray) and not isinstance(w, QArray):
        raise ValueError(f"linear: a quantized input needs a QArray weight, got {type(w).__name__}")
    y = matmul(x, w, impl=impl)
    return y if bias is None else y + bias.astype(y.dtype)


def swiglu_mlp(p: dict, x, *, impl: str = "auto") -> jax.Array:
    """``W_down (silu(x W_gate) ⊙ x W_up)`` (Shazeer 2020, arXiv 2002.05202); a fused
    ``w_gate_up`` (``models.fused``) runs both input GEMMs as one. A QArray ``w_down`` gets its
    input quantized with the product (one launch on Hopper at decode sizes)."""
    dtype, q_impl = producer_dtype(x, p["w_down"], impl=impl), quant_impl(impl)
    if GATE_UP in p and dtype is not None and p[GATE_UP].block_shape[0] == 128:
        h = swiglu_quantize(linear(x, p[GATE_UP], impl=impl), dtype=dtype, impl=q_impl)
    else:
        if GATE_UP in p:
            gate, up = split_gate_up(linear(x, p[GATE_UP], impl=impl), p[GATE_UP].block_shape[0])
        else:
            gate, up = linear(x, p["w_gate"], impl=impl), linear(x, p["w_up"], impl=impl)
        h = swiglu(gate, up) if dtype is None else swiglu_quantize(gate=gate, up=up, dtype=dtype,
                                                                   impl=q_impl)  # fmt: skip
    return linear(h, p["w_down"], impl=impl)
