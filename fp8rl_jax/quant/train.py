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
import functools

import jax
import jax.numpy as jnp

from fp8rl_jax.quant.params import _num_layers, path_str, should_quantize
from fp8rl_jax.quant.recipe import QuantRecipe
from kernels_pallas.decode_attention import dequantize_kv
from kernels_pallas.fp8_train_matmul import (
    TrainMatmulConfig,
    grouped_fp8_grads,
    quantize_train_weight,
)
from kernels_pallas.grouped_fp8_matmul import grouped_fp8_matmul
from kernels_pallas.qarray import SCALE_TINY, QArray, fp8_dtype, fp8_max
from kernels_pallas.quantize import quantize_activations, saturating_cast


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


def _ragged(x_RD, w_EDF, group_sizes_E):
    prec = jax.lax.Precision.HIGHEST if w_EDF.dtype == jnp.float32 else None
    return jax.lax.ragged_dot(x_RD.astype(w_EDF.dtype), w_EDF, group_sizes_E, precision=prec,
                              preferred_element_type=jnp.float32)  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x_RD, ws_EDF: tuple, group_sizes_E, cfg: TrainMatmulConfig):
    return _grouped_forward(x_RD, ws_EDF, group_sizes_E, cfg)[0]


def _grouped_forward(x_RD, ws_EDF, group_sizes_E, cfg):
    ws_q = tuple(quantize_train_weight(w, cfg) for w in ws_EDF)
    x_q = quantize_activations(x_RD, ws_q[0].block_shape[1], ws_q[0].values.dtype)
    w_arg = ws_q if len(ws_q) > 1 else ws_q[0]
    y = grouped_fp8_matmul(x_q, w_arg, group_sizes_E, out_dtype=x_RD.dtype, impl=cfg.impl,
                           interpret=cfg.interpret)  # fmt: skip
    return y, ws_q


def _grouped_fwd(x, ws, gs, cfg):
    y, ws_q = _grouped_forward(x, ws, gs, cfg)
    return y, (x, ws, gs, ws_q if cfg.backward == "fp8" else None)


def _grouped_bwd(cfg, res, dy):
    x, ws, gs, ws_q = res
    splits = [w.shape[-1] for w in ws]
    dys = jnp.split(dy, list(jnp.cumsum(jnp.array(splits))[:-1].tolist()), axis=-1)
    if cfg.backward == "fp8":  # DeepSeek-V3's FP8 dgrad / wgrad (fp8_train_matmul.grouped)
        dx, dws = grouped_fp8_grads(x, ws_q, tuple(dys), gs, cfg)
        return (
            dx.astype(x.dtype),
            tuple(d.astype(w.dtype) for d, w in zip(dws, ws, strict=True)),
            None,
        )
    dx = jnp.zeros(x.shape, jnp.float32)
    dws = []
    for w, d in zip(ws, dys, strict=True):
        _, vjp = jax.vjp(lambda a, b: _ragged(a, b, gs), x, w)  # BF16 GEMMs, f32 accumulation
        ddx, ddw = vjp(d.astype(jnp.float32))
        dx, dws = dx + ddx.astype(jnp.float32), [*dws, ddw]
    return dx.astype(x.dtype), tuple(dws), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_train_matmul(x_RD, w, group_sizes_E) -> jax.Array:
    """Sorted rows times their expert's ``TrainQWeight`` (or a tuple of them, one launch).

    Forward: ``grouped_fp8_matmul`` exactly as the rollout calls it (1x128 activation groups);
    backward: straight-through, ``jax.lax.ragged_dot`` in the compute dtype, or with
    ``fp8_backward`` the FP8 dgrad / wgrad of ``kernels_pallas.fp8_train_matmul.grouped``.
    """
    ws = w if isinstance(w, tuple) else (w,)
    return _grouped(x_RD, tuple(t.w for t in ws), group_sizes_E, ws[0].cfg)


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
