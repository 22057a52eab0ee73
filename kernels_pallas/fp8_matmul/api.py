"""``fp8_matmul``: validates operands and dispatches to the reference or a Pallas kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.backend import IMPLS, Impl, default_impl
from kernels_pallas.fp8_matmul.reference import fp8_matmul_reference
from kernels_pallas.qarray import QArray, fp8_dtype
from kernels_pallas.quantize import quantize_activations


def _check(x_q: QArray, w_q: QArray) -> None:
    if not isinstance(w_q, QArray) or w_q.ndim != 2 or len(w_q.block_shape) != 2:
        raise ValueError("fp8_matmul: w_q must be a rank-2 QArray [K, N] with 2-D block_shape")
    if x_q.ndim != 2 or len(x_q.block_shape) != 1:
        raise ValueError("fp8_matmul: x_q must be a QArray [M, K] with per-token groups (g,)")
    for name, q in (("x_q", x_q), ("w_q", w_q)):
        fp8_dtype(q.values.dtype)  # raises on a non-FP8 dtype
        if q.scales.dtype != jnp.float32:
            raise ValueError(f"fp8_matmul: {name}.scales must be float32, got {q.scales.dtype}")
    if x_q.shape[1] != w_q.shape[0]:
        raise ValueError(
            f"fp8_matmul: contracting dims differ: x K={x_q.shape[1]}, w K={w_q.shape[0]}"
        )
    if x_q.block_shape[0] != w_q.block_shape[0]:
        raise ValueError(
            f"fp8_matmul: activation group {x_q.block_shape[0]} must equal the weight K block "
            f"{w_q.block_shape[0]}"
        )


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "interpret"))
def _dispatch(x_q, w_q, *, out_dtype, impl, interpret):
    if impl == "xla":
        return fp8_matmul_reference(x_q, w_q, out_dtype=out_dtype)
    if impl == "pallas_mosaic_gpu":
        from kernels_pallas.fp8_matmul import pallas_mosaic_gpu

        return pallas_mosaic_gpu.fp8_matmul_mgpu(x_q, w_q, out_dtype=out_dtype, interpret=interpret)
    if impl == "pallas_tpu":
        from kernels_pallas.fp8_matmul import pallas_tpu

        return pallas_tpu.fp8_matmul_tpu(x_q, w_q, out_dtype=out_dtype, interpret=interpret)
    raise ValueError(f"fp8_matmul: unknown impl {impl!r}; expected one of {IMPLS}")


def _fusable(x: jax.Array, w_q: QArray) -> bool:
    """Raw BF16/F16 x with 128x128 weight blocks: the Hopper kernel quantizes x in-kernel."""
    return x.dtype in (jnp.bfloat16, jnp.float16) and tuple(w_q.block_shape) == (128, 128)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def _fused_mgpu(x, w_q, *, out_dtype, interpret):
    from kernels_pallas.fp8_matmul import pallas_mosaic_gpu

    if x.shape[-1] != w_q.shape[0]:
        raise ValueError(
            f"fp8_matmul: contracting dims differ: x K={x.shape[-1]}, w K={w_q.shape[0]}"
        )
    fp8_dtype(w_q.values.dtype)
    y = pallas_mosaic_gpu.fp8_matmul_mgpu_fused(
        x.reshape(-1, x.shape[-1]), w_q, out_dtype=out_dtype, interpret=interpret
    )
    return y.reshape(*x.shape[:-1], w_q.shape[1])


def fp8_matmul(
    x_q: QArray | jax.Array,
    w_q: QArray,
    *,
    out_dtype=jnp.bfloat16,
    impl: Impl = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Blockwise FP8 W8A8 matmul ``x @ w`` (see ``fp8_matmul_reference`` for the formula).

    ``x_q`` may be a QArray [..., K] or a plain array, which is quantized per token in groups of
    the weight's K block: in-kernel by the Hopper kernel for BF16/F16 ``x`` (no separate pass over
    ``x``), by ``quantize_activations`` otherwise. Leading axes of ``x`` are flattened into M.
    """
    if impl not in IMPLS:
        raise ValueError(f"fp8_matmul: unknown impl {impl!r}; expected one of {IMPLS}")
    if not isinstance(w_q, QArray):
        raise ValueError("fp8_matmul: w_q must be a QArray (use quantize_blockwise)")
    impl = default_impl() if impl == "auto" else impl
    if not isinstance(x_q, QArray):
        if impl == "pallas_mosaic_gpu" and _fusable(x_q, w_q):
            return _fused_mgpu(x_q, w_q, out_dtype=jnp.dtype(out_dtype), interpret=interpret)
        x_q = quantize_activations(x_q, w_q.block_shape[0], w_q.values.dtype)
    lead = x_q.shape[:-1]
    x2 = QArray(
        x_q.values.reshape(-1, x_q.shape[-1]),
        x_q.scales.reshape(-1, x_q.scales.shape[-1]),
        x_q.block_shape,
        x_q.dtype,
    )
    _check(x2, w_q)
    y = _dispatch(x2, w_q, out_dtype=jnp.dtype(out_dtype), impl=impl, interpret=interpret)
    return y.reshape(*lead, w_q.shape[1])
