"""Mixture of experts (Qwen3-MoE): top-k softmax routing, dropless grouped SwiGLU experts.

Tokens are sorted by expert and the experts run as ``jax.lax.ragged_dot`` over the groups (no
token dropping, no capacity factor). FP8 experts (QArray ``[E, out, in]``, K-major like every
QArray weight, one 128x128 block grid per expert) run an emulated W8A8 grouped matmul: activations
are quantized per token in 1x128 groups of the weight's K block, both operands are dequantized in
f32 and ragged_dot accumulates in f32. That equals the per-K-group two-scale sum of DESIGN.md §4.3
up to f32 rounding (it is the numerics of ``fp8_matmul_reference``); a real FP8 grouped GEMM kernel
can replace it later.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8rl_jax.models.config import ModelConfig
from kernels_pallas.qarray import QArray, dequantize, dequantize_weight
from kernels_pallas.quantize import quantize_activations


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """Per-layer sums for the load-balancing loss (HF ``load_balancing_loss_func``)."""

    counts_E: jax.Array  # Σ over valid tokens of top-k assignments to each expert
    probs_E: jax.Array  # Σ over valid tokens of the router probability of each expert
    rows: jax.Array  # number of valid tokens


def route(x_ND: jax.Array, router_DE: jax.Array, cfg: ModelConfig):
    """(top-k weights [N, k] f32, expert ids [N, k], probs [N, E] f32); router math in f32.

    ``p = softmax(x W_r)``; the top-k probabilities are renormalized to sum to 1 when
    ``cfg.norm_topk_prob`` (Qwen3-MoE).
    """
    logits = jnp.dot(
        x_ND.astype(jnp.float32),
        router_DE.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w, top_i, probs


def router_stats(top_i_NK, probs_NE, valid_N) -> RouterStats:
    E = probs_NE.shape[-1]
    w = valid_N.astype(jnp.float32)
    counts = jnp.sum(jax.nn.one_hot(top_i_NK, E, dtype=jnp.float32) * w[:, None, None], axis=(0, 1))
    return RouterStats(counts, jnp.sum(probs_NE * w[:, None], axis=0), jnp.sum(w))


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> jax.Array:
    """``E · Σ_e f_e · P_e`` over the valid tokens of all MoE layers (Switch, arXiv 2101.03961).

    ``f_e``: fraction of top-k assignments to expert e (sums to k), ``P_e``: mean router
    probability; layers are pooled before the product, as HF Qwen3-MoE does. Unscaled: the trainer
    multiplies by ``cfg.router_aux_loss_coef``.
    """
    if not stats:
        return jnp.zeros((), jnp.float32)
    rows = jnp.maximum(sum(s.rows for s in stats), 1.0)
    f = sum(s.counts_E for s in stats) / rows
    p = sum(s.probs_E for s in stats) / rows
    return num_experts * jnp.sum(f * p)


def _grouped_matmul(x_MD: jax.Array, w_EDF, group_sizes_E: jax.Array) -> jax.Array:
    """Rows of ``x`` sorted by expert times their expert's weight (``[E, D, F]``, or a QArray
    ``[E, F, D]``: emulated W8A8)."""
    if isinstance(w_EDF, QArray):
        x_q = quantize_activations(x_MD, w_EDF.block_shape[1], w_EDF.values.dtype)
        y = jax.lax.ragged_dot(
            dequantize(x_q, jnp.float32),
            dequantize_weight(w_EDF, jnp.float32),
            group_sizes_E,
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        return y.astype(x_MD.dtype)
    prec = jax.lax.Precision.HIGHEST if w_EDF.dtype == jnp.float32 else None
    y = jax.lax.ragged_dot(
        x_MD.astype(w_EDF.dtype),
        w_EDF,
        group_sizes_E,
        precision=prec,
        preferred_element_type=jnp.float32,
    )
    return y.astype(x_MD.dtype)


def moe_mlp(p: dict, x_BTD: jax.Array, valid_BT: jax.Array, cfg: ModelConfig):
    """Dropless top-k MoE SwiGLU block: (y [B, T, D], RouterStats)."""
    B, T, D = x_BTD.shape
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    x = x_BTD.reshape(B * T, D)
    top_w, top_i, probs = route(x, p["router"], cfg)
    flat_e = top_i.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    xs = x[token]
    h = jax.nn.silu(_grouped_matmul(xs, p["w_gate"], group_sizes))
    h = h * _grouped_matmul(xs, p["w_up"], group_sizes)
    ys = _grouped_matmul(h, p["w_down"], group_sizes)
    # Routing weights are cast to the compute dtype before the combine, as HF does.
    ys = ys * top_w.reshape(-1)[order].astype(x.dtype)[:, None]
    y = jnp.zeros_like(x).at[token].add(ys)
    return y.reshape(B, T, D), router_stats(top_i, probs, valid_BT.reshape(-1))


def _dense_expert_matmul(x, w, spec: str):
    """f32 einsum; a QArray weight also fake-quantizes ``x`` per token (the W8A8 semantics)."""
    if isinstance(w, QArray):
        x = dequantize(quantize_activations(x, w.block_shape[1], w.values.dtype), jnp.float32)
        w = dequantize_weight(w, jnp.float32)
    return jnp.einsum(spec, x, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def moe_mlp_dense_reference(p: dict, x_BTD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Every expert on every token in f32, combined with the (zero-filled) top-k weights."""
    B, T, D = x_BTD.shape
    x = x_BTD.reshape(B * T, D).astype(jnp.float32)
    top_w, top_i, _ = route(x, p["router"], cfg)
    combine_NE = jnp.sum(jax.nn.one_hot(top_i, cfg.num_experts) * top_w[..., None], axis=1)
    hi = jax.lax.Precision.HIGHEST
    g = _dense_expert_matmul(x, p["w_gate"], "nd,edf->enf")
    u = _dense_expert_matmul(x, p["w_up"], "nd,edf->enf")
    y_END = _dense_expert_matmul(jax.nn.silu(g) * u, p["w_down"], "enf,efd->end")
    y = jnp.einsum("end,ne->nd", y_END, combine_NE, precision=hi)
    return y.reshape(B, T, D).astype(x_BTD.dtype)
