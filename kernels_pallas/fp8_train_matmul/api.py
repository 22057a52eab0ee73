"""``fp8_train_matmul``: the rollout's W8A8 forward with a straight-through, BF16 or FP8 backward.

Forward: ``y = fp8_matmul(x, quantize_weight(w))``, the exact op the rollout runs for a linear
layer (1x128 activation groups, 128x128 weight blocks, f32 accumulation), so a training forward
built from it reproduces the rollout's numerics.

Backward (straight-through estimator, Bengio et al. 2013, arXiv 1308.3432): the Jacobians of the
weight and activation quantizers are taken as the identity, so the cotangent ``dy`` of the FP8
product reaches ``x`` and the master weight ``w`` as if the product were ``x · w``:

  * ``backward="bf16"``: ``dx = dy · wᵀ`` and ``dw = xᵀ · dy`` as BF16 (compute-dtype) GEMMs with
    f32 accumulation over the operands the quantizers read: the BF16 training GEMMs, evaluated at
    the FP8 forward's activations and cotangents. (The identity ``x + stop_gradient(q(x) − x)``
    gives the same estimator with the GEMMs reading ``q(x)``, ``q(w)`` instead: the two differ by
    the FP8 rounding of the operands.)
  * ``backward="fp8"``: DeepSeek-V3's recipe (arXiv 2412.19437 §3.3, Fig. 6; the 128x1
    re-quantization for the transposed operands is §3.5.2):
      - dgrad ``dx = dy · ŵ``: ``dy`` quantized per token in 1x128 groups along N (its contraction
        axis), the forward's 128x128-block weight ``ŵ`` read transposed (a square block grid
        transposes with its scales, no re-quantization): ``fp8_matmul`` (1D2D scaling);
      - wgrad ``dw = xᵀ · dy``: the contraction is over tokens, so ``x`` and ``dy`` are
        re-quantized in groups of 128 tokens (128x1 tiles of ``[M, K]``/``[M, N]``, i.e. 1x128
        along M of the transposes: DeepGEMM's 1D1D wgrad scaling) and multiplied with f32
        accumulation by ``fp8_matmul`` (its XLA implementation: the Pallas kernels take
        128x128 weight blocks only).
    All FP8 operands use the forward's format (E4M3 by default: fine-grained scales let
    DeepSeek-V3 use E4M3 for gradients too, §3.3.1).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas.fp8_matmul import fp8_matmul
from kernels_pallas.qarray import QArray
from kernels_pallas.quantize import quantize_activations, quantize_blockwise, quantize_weight

BACKWARDS = ("bf16", "fp8")
GROUP = 128  # activation group / weight block edge of the DeepSeek-V3 recipe


@dataclasses.dataclass(frozen=True)
class TrainMatmulConfig:
    """How ``fp8_train_matmul`` quantizes and differentiates (a static, hashable argument)."""

    weight_block: tuple[int, int] = (GROUP, GROUP)  # (K, N) block of one weight scale
    dtype: str = "float8_e4m3fn"  # FP8 format of weights, activations and (fp8) gradients
    pow2_scales: bool = False  # weight scales rounded up to powers of two (UE8M0)
    per_tensor: bool = False  # one weight scale per matrix (overrides weight_block)
    backward: str = "bf16"  # bf16: BF16 backward GEMMs | fp8: DeepSeek-V3 FP8 dgrad and wgrad
    impl: str = "auto"  # fp8_matmul implementation of the forward and dgrad GEMMs
    interpret: bool = False  # run an explicit Pallas impl in interpret mode (CPU tests)

    def __post_init__(self):
        if self.backward not in BACKWARDS:
            raise ValueError(f"TrainMatmulConfig.backward must be one of {BACKWARDS}")


def quantize_train_weight(w_KN: jax.Array, cfg: TrainMatmulConfig) -> QArray:
    """The rollout's copy of ``w_KN``: ``quantize_weight`` with the recipe's block (K-major)."""
    block = w_KN.shape[-2:] if cfg.per_tensor else cfg.weight_block
    return quantize_weight(w_KN, block, cfg.dtype, pow2_scales=cfg.pow2_scales)


def transpose_weight(w_q: QArray) -> QArray:
    """``ŵ [N, K] -> ŵᵀ [K, N]`` with its block grid transposed (exact: no re-quantization)."""
    bn, bk = w_q.block_shape
    return QArray(w_q.values.swapaxes(-1, -2), w_q.scales.swapaxes(-1, -2), (bk, bn), w_q.dtype)


def _flat(x):
    return x.reshape(-1, x.shape[-1])


def _forward(x, w_KN, cfg: TrainMatmulConfig):
    w_q = quantize_train_weight(w_KN, cfg)
    y = fp8_matmul(x, w_q, out_dtype=x.dtype, impl=cfg.impl, interpret=cfg.interpret)
    return y, w_q


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_train_matmul(x: jax.Array, w_KN: jax.Array, cfg: TrainMatmulConfig) -> jax.Array:
    """``y = x̂ · ŵ`` in ``x``'s dtype (the rollout's W8A8 linear), straight-through gradients.

    ``x``: [..., K] (BF16/F32 activations); ``w_KN``: the training weight [K, N]. See the module
    docstring for the backward.
    """
    return _forward(x, w_KN, cfg)[0]


def _fwd(x, w_KN, cfg):
    y, w_q = _forward(x, w_KN, cfg)
    return y, (x, w_KN, w_q if cfg.backward == "fp8" else None)


def bf16_grads(x, w_KN, dy):
    """``(dy · wᵀ, xᵀ · dy)`` in the compute dtype with f32 accumulation (the BF16 GEMMs)."""
    dt = w_KN.dtype
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    dx = jnp.einsum("...n,kn->...k", dy.astype(dt), w_KN, preferred_element_type=jnp.float32,
                    precision=prec)  # fmt: skip
    dw = jnp.einsum("mk,mn->kn", _flat(x).astype(dt), _flat(dy).astype(dt),
                    preferred_element_type=jnp.float32, precision=prec)  # fmt: skip
    return dx.astype(x.dtype), dw.astype(w_KN.dtype)


def fp8_grads(x, w_q: QArray, dy, cfg: TrainMatmulConfig, *, impl=None):
    """``(dx, dw)`` by DeepSeek-V3's FP8 GEMMs (module docstring), f32 accumulation."""
    x2, dy2 = _flat(x), _flat(dy)
    dy_q = quantize_activations(dy2, GROUP, cfg.dtype)  # 1x128 along N
    dx = fp8_matmul(dy_q, transpose_weight(w_q), out_dtype=jnp.float32, impl=impl or cfg.impl,
                    interpret=cfg.interpret)  # fmt: skip
    x_t = quantize_activations(x2.T, GROUP, cfg.dtype)  # [K, M]: 128-token groups
    dy_t = quantize_blockwise(dy2.T, (1, GROUP), cfg.dtype)  # [N, M]: 128-token groups
    dw = fp8_matmul(x_t, dy_t, out_dtype=jnp.float32, impl="xla")
    return dx.reshape(x.shape).astype(x.dtype), dw


def _bwd(cfg, res, dy):
    x, w_KN, w_q = res
    if cfg.backward == "fp8":
        dx, dw = fp8_grads(x, w_q, dy, cfg)
        return dx, dw.astype(w_KN.dtype)
    return bf16_grads(x, w_KN, dy)


fp8_train_matmul.defvjp(_fwd, _bwd)
