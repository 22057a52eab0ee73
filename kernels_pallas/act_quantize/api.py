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
