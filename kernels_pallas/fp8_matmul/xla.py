"""The XLA implementation of ``fp8_matmul``: the exact reference, or a fast path chosen by M.

On GPU the exact reference dequantizes both operands to f32 (4x the bytes of FP8, f32 matmul
speed), so ``method="auto"`` picks one of two fast paths there instead:

  * ``kblock_fp8`` (small M): the FP8 ``dot_general`` with the K blocks as a batch dimension,
    ``p[kb] = x̂_kb · ŵ_kbᵀ`` (f32 out: an FP8 tensor-core GEMM), then
    ``y = Σ_kb p[kb] · s_x[:, kb] · s_w[:, kb]`` in one fused reduction (qwix ``dot_general``'s
    "fast" path). Same numerics as the reference up to f32 summation order; its f32
    intermediate ``[K/128, M, N]`` is ``M/32`` times the FP8 weight bytes, so it pays off for
    ``M <= kblock_max_m``.
  * ``dequant_bf16`` (large M): both operands dequantized to BF16 (``values · scales`` rounded
    once to BF16, relative error <= 2^-9 per element on top of FP8's), then one BF16 GEMM with
    f32 accumulation. Not bit-compatible with the reference: the tests bound the difference.

Elsewhere (CPU) ``auto`` is the exact reference (measured fastest there: see the tests' module
docstring).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas.fp8_matmul.reference import fp8_matmul_reference
from kernels_pallas.qarray import QArray, dequantize, expand_scales

METHODS = ("auto", "reference", "kblock_fp8", "dequant_bf16")


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """How the XLA implementation computes the product (a static argument)."""

    method: str = "auto"  # one of METHODS; auto: by platform and M (module docstring)
    kblock_max_m: int = 32  # auto on GPU: kblock_fp8 for M <= this, dequant_bf16 above

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"XlaConfig.method must be one of {METHODS}, got {self.method!r}")


def choose_method(m: int, cfg: XlaConfig, platform: str) -> str:
    """The method ``cfg`` resolves to for ``m`` rows on ``platform`` ("cpu" | "gpu" | "tpu")."""
    if cfg.method != "auto":
        return cfg.method
    if platform != "gpu":
        return "reference"
    return "kblock_fp8" if m <= cfg.kblock_max_m else "dequant_bf16"


def _pad_last(a: jax.Array, size: int) -> jax.Array:
    pad = size - a.shape[-1]
    return a if pad == 0 else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])


def fp8_matmul_kblock(x_q: QArray, w_q: QArray, *, out_dtype=jnp.bfloat16) -> jax.Array:
    """``y = Σ_kb s_x[:, kb] ⊙ s_w[:, kb] ⊙ (x̂_kb · ŵ_kbᵀ)``: FP8 GEMMs batched over K blocks.

    ``x_q``: [M, K] with (bk,) groups; ``w_q``: [N, K] with (bn, bk) blocks. K tails are padded
    with zeros (they add nothing); N tails take their partial block's scale.
    """
    (m, k), (n, _) = x_q.shape, w_q.shape
    bk = w_q.block_shape[1]
    kb = -(-k // bk)
    xb = _pad_last(x_q.values, kb * bk).reshape(m, kb, bk)
    wb = _pad_last(w_q.values, kb * bk).reshape(n, kb, bk)
    p = jax.lax.dot_general(
        xb, wb, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32
    )
    sw = expand_scales(w_q.scales, (n, kb), (w_q.block_shape[0], 1))  # [N, KB]
    y = jnp.einsum("bmn,mb,nb->mn", p, x_q.scales, sw, precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def fp8_matmul_dequant_bf16(x_q: QArray, w_q: QArray, *, out_dtype=jnp.bfloat16) -> jax.Array:
    """``y ≈ bf16(x̂ s_x) · bf16(ŵ s_w)ᵀ`` with f32 accumulation (one BF16 GEMM)."""
    x = dequantize(x_q, jnp.bfloat16)
    w = dequantize(w_q, jnp.bfloat16)
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


_RUN = {
    "reference": fp8_matmul_reference,
    "kblock_fp8": fp8_matmul_kblock,
    "dequant_bf16": fp8_matmul_dequant_bf16,
}


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "platform"))
def fp8_matmul_xla(
    x_q: QArray, w_q: QArray, *, out_dtype=jnp.bfloat16, config=None, platform: str = "cpu"
) -> jax.Array:
    """``fp8_matmul`` in plain XLA ops; ``x_q`` [M, K], ``w_q`` [N, K] (see the module doc)."""
    method = choose_method(x_q.shape[0], config or XlaConfig(), platform)
    return _RUN[method](x_q, w_q, out_dtype=out_dtype)
