"""The trainer's forward in the rollout's own FP8 numerics (``rl.train_precision="fp8_rollout"``).

A params transformation plus one attention hook, so the model code does not change:

  * ``train_weights`` swaps each weight ``quantize_params`` would quantize for a ``TrainQWeight``
    (the compute-dtype weight + the recipe). ``quant.matmul`` runs it through
    ``kernels_pallas.fp8_train_matmul`` (the rollout's ``quantize_weight`` + ``fp8_matmul``,
    straight-through gradients to the weight); MoE expert stacks run ``grouped_train_matmul``
    (the rollout's ``grouped_fp8_matmul``, same estimator).
  * ``KVFakeQuant`` (``models.forward(kv_quant=...)``) rounds K and V through the rollout's FP8
    cache before the no-cache attention: ``dequantize_kv(quantize_kv(k))`` in f32, with the
    rollout's static scales or per-token dynamic ones, again straight-through.

Straight-through estimator (Bengio et al. 2013, arXiv 1308.3432): every quantizer's Jacobian is
the identity, so gradients reach the FP32 master weights (through the cast to the compute dtype)
as if the forward had not been quantized; the backward GEMMs are BF16 (or FP8 with
``fp8_backward``: ``kernels_pallas.fp8_train_matmul``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8rl_jax.quant.params import _num_layers, path_str, should_quantize
from fp8rl_jax.quant.recipe import QuantRecipe
from kernels_pallas.decode_attention import dequantize_kv
from kernels_pallas.fp8_train_matmul import (
    TrainMatmulConfig,
    grouped_fp8_train_matmul,
    quantize_train_weight,
)
from kernels_pallas.qarray import SCALE_TINY, QArray, fp8_dtype, fp8_max
from kernels_pallas.quantize import saturating_cast


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainQWeight:
    """A training weight ``[..., K, N]`` that multiplies as its rollout FP8 copy."""

    w: jax.Array  # compute-dtype weight (differentiable), training layout [..., K, N]
    cfg: TrainMatmulConfig = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.w.shape

    @property
    def ndim(self):
        return self.w.ndim

    @property
    def dtype(self):
        return self.w.dtype

    def quantized(self) -> QArray:
        """The rollout's QArray ``[..., N, K]`` (``quantize_params``' leaf, bit for bit)."""
        return quantize_train_weight(self.w, self.cfg)


def matmul_config(recipe: QuantRecipe, *, fp8_backward: bool = False, impl="auto"):
    """The ``fp8_train_matmul`` config of a rollout recipe."""
    return TrainMatmulConfig(
        weight_block=tuple(recipe.weight_block), dtype=recipe.dtype,
        pow2_scales=recipe.pow2_scales, per_tensor=recipe.per_tensor,
        backward="fp8" if fp8_backward else "bf16", impl=impl,
    )  # fmt: skip


def train_weights(params, recipe: QuantRecipe | None, *, fp8_backward=False, impl="auto"):
    """``params`` with every weight ``quantize_params`` quantizes wrapped in a ``TrainQWeight``.

    Run it on the compute-dtype weights (after ``cast_floats``), inside the loss function: the
    wrapped weights quantize exactly as the rollout's ``quantize_params`` does. ``recipe=None``
    (BF16 rollout) returns ``params``.
    """
    if recipe is None:
        return params
    cfg = matmul_config(recipe, fp8_backward=fp8_backward, impl=impl)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [path_str(p) for p, _ in flat]
    n_layers = _num_layers(names)
    out = [
        TrainQWeight(leaf, cfg) if should_quantize(name, leaf, recipe, n_layers) else leaf
        for name, (_, leaf) in zip(names, flat, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


# --- MoE expert stacks: the rollout's grouped GEMM, straight-through ---


def grouped_train_matmul(x_RD, w, group_sizes_E) -> jax.Array:
    """Sorted rows times their expert's ``TrainQWeight`` (or a tuple of them, one launch).

    ``kernels_pallas.fp8_train_matmul.grouped_fp8_train_matmul``: the forward exactly as the
    rollout's ``grouped_fp8_matmul`` call, straight-through BF16 or (``fp8_backward``) FP8 GEMMs.
    """
    ws = w if isinstance(w, tuple) else (w,)
    return grouped_fp8_train_matmul(x_RD, tuple(t.w for t in ws), group_sizes_E, ws[0].cfg)


# --- K/V through the rollout's FP8 cache ---


@jax.custom_vjp
def _st(x, x_hat):
    """``x_hat`` forward, identity gradient to ``x`` (exact: no ``x + (x̂ − x)`` rounding)."""
    return x_hat


def _st_fwd(x, x_hat):
    return x_hat, jnp.zeros((), x.dtype)


def _st_bwd(dtype_ref, g):
    return g.astype(dtype_ref.dtype), jnp.zeros_like(g)


_st.defvjp(_st_fwd, _st_bwd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVFakeQuant:
    """K/V as the rollout's FP8 cache holds them: ``x̂ · s`` in f32 (``kv_cache.quantize_kv``)."""

    k_scale_LK: jax.Array | None  # static mode: the rollout's per-layer, per-head scales
    v_scale_LK: jax.Array | None
    dtype: str = dataclasses.field(default="float8_e4m3fn", metadata=dict(static=True))
    # static | dynamic | none (a BF16/F32 cache: K/V only upcast to f32)
    mode: str = dataclasses.field(default="static", metadata=dict(static=True))

    def _one(self, x_BTKC, scale_K):
        x = x_BTKC.astype(jnp.float32)
        if self.mode == "none":  # a BF16/F32 cache: the decode attention's f32 math
            return x
        if self.mode == "static":
            x_hat = dequantize_kv(saturating_cast(x / scale_K[:, None], self.dtype), scale_K)
        else:  # per written vector: s = max(amax_C |x|, tiny) / fp8_max (kv_cache.quantize_kv)
            s_BTK = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), SCALE_TINY) / fp8_max(self.dtype)
            x_hat = saturating_cast(x / s_BTK[..., None], self.dtype).astype(jnp.float32)
            x_hat = x_hat * s_BTK[..., None]
        return _st(x_BTKC, jax.lax.stop_gradient(x_hat))

    def __call__(self, layer: int, k_BTKC, v_BTKC):
        """(k̂, v̂) f32 of one layer; gradients pass straight through to k and v."""
        ks = None if self.k_scale_LK is None else self.k_scale_LK[layer]
        vs = None if self.v_scale_LK is None else self.v_scale_LK[layer]
        return self._one(k_BTKC, ks), self._one(v_BTKC, vs)


def kv_fake_quant(kv_cache_dtype: str, kv_scale_mode: str, kv_scales) -> KVFakeQuant:
    """The ``KVFakeQuant`` of a rollout's KV-cache settings.

    A BF16/F32 cache gives ``mode="none"``: K/V upcast to f32, because the rollout's response
    tokens come from the decode attention, which computes ``softmax(q Kᵀ) V`` in f32 (its XLA
    reference; the jnp attention of a BF16 forward rounds the probabilities to BF16).
    """
    if not kv_cache_dtype.startswith("float8"):
        return KVFakeQuant(None, None, kv_cache_dtype, "none")
    fp8_dtype(kv_cache_dtype)
    if kv_scale_mode == "static":
        if kv_scales is None:
            raise ValueError("fp8_rollout training with a static FP8 KV cache needs the KV scales")
        return KVFakeQuant(kv_scales.k, kv_scales.v, kv_cache_dtype, "static")
    return KVFakeQuant(None, None, kv_cache_dtype, "dynamic")
