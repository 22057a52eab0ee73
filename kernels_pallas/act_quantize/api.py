"""The producers of FP8 GEMM inputs, quantized: one kernel launch on Hopper, XLA elsewhere.

``impl``: "auto" runs the fused Triton kernel (``fused.py``) on a Hopper target when it takes the
operands, at every row count (decode: one launch instead of XLA's two to four; prefill: the
inputs read once instead of twice), else the reference (pure jnp, which XLA fuses with its
neighbours); "xla" the reference always;
"pallas_triton" the kernel or an error naming why not. On CPU "auto" is the reference: the same
ops as the unfused producer and quantization.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.act_quantize import fused
from kernels_pallas.act_quantize.reference import (
    GROUP,
    rmsnorm_quantize_reference,
    split_gate_up,
    swiglu_quantize_reference,
)
from kernels_pallas.backend import target_device
from kernels_pallas.qarray import QArray

IMPLS = ("auto", "xla", "pallas_triton")


def use_kernel(op: str, impl: str, reason: str | None) -> bool:
    """Whether ``op`` runs its fused kernel (module docstring); ``reason``: the kernel's support
    check (None: it takes the operands)."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "pallas_triton":
        if reason is not None:
            raise ValueError(f"{op}: impl 'pallas_triton' cannot run these operands: {reason}")
        return True
    return impl == "auto" and reason is None and target_device().is_hopper


def quantizes_for(rows: int, impl: str = "auto") -> bool:
    """Whether a producer quantizes its output for the FP8 GEMMs of ``rows`` rows it feeds
    (else it hands them raw BF16 x, which they quantize in-kernel). Always, but on Hopper
    (``impl`` "auto") at the fused decode kernel's rows (``mgpu_config.FUSED_DECODE_ROWS``):
    there FP8 x would be padded to the QArray kernel's 32-row tile by two XLA launches per
    GEMM (its values and its scales; a Triton producer cannot absorb a pad: 8 launches a
    layer in the compiled Qwen3-8B decode, ``perf_model.hlo_launches``), while raw x runs the
    fused kernel's 16-row tiles unpadded (``fp8_matmul.fused_default``; bit for bit the
    quantize-once result in interpret mode). The producer is then XLA's fusion, one launch as
    the Triton kernel was. Always with ``FP8RL_FUSED_X=0`` (``mgpu_config.fused_enabled``)."""
    from kernels_pallas.fp8_matmul.mgpu_config import FUSED_DECODE_ROWS, fused_enabled

    raw = rows == FUSED_DECODE_ROWS and fused_enabled() and target_device().is_hopper
    return not (impl == "auto" and raw)


def _rows(x) -> int:
    return x.size // x.shape[-1]


def _with_lead(q: QArray, lead: tuple[int, ...]) -> QArray:
    """A QArray [M, K] -> [*lead, K]."""
    k, g = q.shape[-1], q.scales.shape[-1]
    return QArray(q.values.reshape(*lead, k), q.scales.reshape(*lead, g), q.block_shape, q.dtype)


def rmsnorm_quantize(x, w, eps: float, dtype=jnp.float8_e4m3fn, *, impl: str = "auto",
                     interpret: bool = False) -> QArray:  # fmt: skip
    """``quantize_activations(rms_norm(x, w, eps))`` (1x128 groups): x ``[..., D]`` -> QArray."""
    d = x.shape[-1]
    reason = fused.rmsnorm_supports((_rows(x), d), w.shape)
    if not use_kernel("rmsnorm_quantize", impl, reason):
        return rmsnorm_quantize_reference(x, w, eps, dtype)
    q = fused.rmsnorm_quantize_triton(x.reshape(-1, d), w, float(eps), dtype, interpret=interpret)
    return _with_lead(q, x.shape[:-1])


def swiglu_quantize(gate_up=None, *, gate=None, up=None, dtype=jnp.float8_e4m3fn,
                    impl: str = "auto", interpret: bool = False) -> QArray:  # fmt: skip
    """``quantize_activations(silu(gate) ⊙ up)`` (1x128 groups) -> QArray ``[..., F]``, from the
    fused gate|up GEMM's output ``gate_up`` ``[..., 2F]`` (alternating 128-column blocks) or
    from ``gate`` and ``up`` ``[..., F]``."""
    split = gate is not None or up is not None
    if (gate_up is not None) == split or (split and (gate is None or up is None)):
        raise ValueError("swiglu_quantize: give gate_up, or gate and up")
    first = gate if gate_up is None else gate_up
    lead, n = first.shape[:-1], first.shape[-1]
    reason = fused.swiglu_supports((_rows(first), n), fused=gate_up is not None)
    if not use_kernel("swiglu_quantize", impl, reason):
        if gate_up is not None:
            gate, up = split_gate_up(gate_up, GROUP)
        return swiglu_quantize_reference(gate, up, dtype)
    if gate_up is not None:
        q = fused.swiglu_quantize_triton(gate_up.reshape(-1, n), None, dtype, interpret=interpret)
    else:
        q = fused.swiglu_quantize_triton(gate.reshape(-1, n), up.reshape(-1, n), dtype,
                                         interpret=interpret)  # fmt: skip
    return _with_lead(q, lead)


def fp8_input_dtype(*weights) -> jnp.dtype | None:
    """The FP8 format the GEMMs of ``weights`` quantize their common input to: all QArrays with
    128-wide K blocks in one format; else None (an input some GEMM takes unquantized)."""
    if not weights or not all(isinstance(w, QArray) for w in weights):
        return None
    fmts = {jnp.dtype(w.values.dtype) for w in weights}
    if len(fmts) != 1 or any(w.block_shape[-1] != GROUP for w in weights):
        return None
    return fmts.pop()
