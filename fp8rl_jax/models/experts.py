"""The steps of a mixture-of-experts layer (Qwen3-MoE), each replaceable on its own; ``moe.py``
composes them (locally or expert-parallel, ``moe_parallel.py``):

  * ``route``: router logits in f32 from a high-precision router (a QArray router is an error:
    DESIGN.md §4.4), top-k and Qwen3-MoE's renormalization. Given ``expert_ids_NK`` it routes
    with those ids instead of its own top-k, the gate weights still coming from its own router
    probabilities renormalized over the given experts: rollout routing replay (R3, arXiv
    2510.11370) needs only that the caller pass the rollout's ids for each MoE layer.
  * ``dispatch``: the (token, expert) assignments sorted by expert: the row order, the token of
    each sorted row and the group sizes. With expert parallelism this is where the sorted rows
    go to their expert's shard (an all-to-all by expert-shard counts); the grouped GEMMs
    accept fewer live rows than rows (``Σ group_sizes <= M``), as a fixed-size receive buffer
    needs.
  * ``experts``: gate/up/down over the sorted rows, no token dropping, no capacity factor.
    Training weights (BF16/F32 ``[E, D, F]``) run ``kernels_pallas.grouped_matmul``
    (differentiable: ``jax.lax.ragged_dot``, or on Hopper BF16 kernels that compute only the live
    rows, forward and backward, where XLA:GPU expands ``ragged_dot`` densely:
    ``KernelImpls.expert_matmul``). FP8
    rollout weights (QArrays ``[E, F, D]``, K-major, one 128x128 block grid per expert) run the
    grouped blockwise W8A8 GEMM ``kernels_pallas.grouped_fp8_matmul`` (Mosaic GPU on Hopper,
    Mosaic TPU on TPU, the XLA row-tile path elsewhere: ``KernelImpls.grouped_matmul``). Gate
    and up run as one GEMM over both stacks (``[E, 2F, D]`` as far as the kernel's N tiles
    go; the weights stay two leaves, so the rollout copy keeps the training tree's structure
    and sharding): one launch instead of two, twice the CTAs for decode-sized groups. The
    activations are quantized per token in 1x128 groups once, before the rows are gathered
    (quantization is per row, so gathering commutes with it), and the down projection's input
    per sorted row.
  * ``combine``: rows weighted by their gate weight and summed back per token (the reverse
    all-to-all under expert parallelism).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.quant import TrainQWeight, grouped_train_matmul
from kernels_pallas.backend import DEFAULT_KERNELS, KernelImpls
from kernels_pallas.grouped_fp8_matmul import grouped_fp8_matmul
from kernels_pallas.grouped_matmul import grouped_matmul
from kernels_pallas.qarray import QArray, dequantize, dequantize_weight
from kernels_pallas.quantize import quantize_activations

REPLAY_NONE = -1  # a recorded expert id meaning "not recorded: route this token yourself"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """What one layer's router did: the sums of the load-balancing loss (HF
    ``load_balancing_loss_func``) and the experts each token went to (routing replay)."""

    counts_E: jax.Array  # Σ over valid tokens of top-k assignments to each expert
    probs_E: jax.Array  # Σ over valid tokens of the router probability of each expert
    rows: jax.Array  # number of valid tokens
    expert_ids_NK: jax.Array | None = None  # int32 experts of each token (all tokens, pads too)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatch:
    """The N·k (token, expert) assignments sorted by expert (R = N·k sorted rows)."""

    order_R: jax.Array  # flat assignment index (token · k + slot) of each sorted row
    token_R: jax.Array  # token of each sorted row
    group_sizes_E: jax.Array  # int32 rows per expert, in expert order


def route(x_ND: jax.Array, router_DE: jax.Array, cfg: ModelConfig, expert_ids_NK=None):
    """(top-k weights [N, k] f32, expert ids [N, k], probs [N, E] f32); router math in f32.

    ``p = softmax(x W_r)``; ``w_{n,j} = p_{n,i_j}`` over the top-k experts ``i_j`` (or over the
    given ``expert_ids_NK``: routing replay), renormalized ``w / Σ_j w`` when
    ``cfg.norm_topk_prob`` (Qwen3-MoE). A token whose given ids are negative (``REPLAY_NONE``:
    padding, or a token the rollout never ran through the model) takes its own top-k.
    """
    if isinstance(router_DE, QArray):
        raise TypeError(
            "moe.route: the router is a QArray; the MoE router stays high precision "
            "(DESIGN.md §4.4: keep 'router' in QuantRecipe.exclude)"
        )
    logits = jnp.dot(
        x_ND.astype(jnp.float32),
        router_DE.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if expert_ids_NK is not None:
        replay_N1 = expert_ids_NK[:, :1] >= 0
        top_i = jnp.where(replay_N1, expert_ids_NK.astype(jnp.int32), top_i)
        top_w = jnp.take_along_axis(probs, top_i, axis=-1)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w, top_i, probs


def router_stats(top_i_NK, probs_NE, valid_N) -> RouterStats:
    E = probs_NE.shape[-1]
    w = valid_N.astype(jnp.float32)
    counts = jnp.sum(jax.nn.one_hot(top_i_NK, E, dtype=jnp.float32) * w[:, None, None], axis=(0, 1))
    return RouterStats(counts, jnp.sum(probs_NE * w[:, None], axis=0), jnp.sum(w), top_i_NK)


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


def dispatch(top_i_NK: jax.Array, num_experts: int) -> Dispatch:
    """Sorts the assignments by expert (stable: tokens keep their order within an expert)."""
    flat_e = top_i_NK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    group_sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    return Dispatch(order, order // top_i_NK.shape[-1], group_sizes)


def combine(ys_RD: jax.Array, top_w_NK: jax.Array, d: Dispatch) -> jax.Array:
    """``y_n = Σ_j w_{n,j} · expert_{i_j}(x_n)`` from the sorted rows' outputs."""
    # Routing weights are cast to the compute dtype before the combine, as HF does.
    w_R = top_w_NK.reshape(-1)[d.order_R].astype(ys_RD.dtype)
    n = top_w_NK.shape[0]
    return jnp.zeros((n, ys_RD.shape[-1]), ys_RD.dtype).at[d.token_R].add(ys_RD * w_R[:, None])


def _ragged(x_RD, w_EDF, group_sizes_E, kernels: KernelImpls) -> jax.Array:
    """Sorted rows times their expert's training weight ``[E, D, F]`` (f32 accumulation)."""
    return grouped_matmul(x_RD, w_EDF, group_sizes_E, impl=kernels.expert_matmul,
                          interpret=kernels.interpret)  # fmt: skip


def experts(p: dict, x_ND: jax.Array, d: Dispatch, kernels: KernelImpls = DEFAULT_KERNELS):
    """SwiGLU of each sorted row with its expert: ``W_down (silu(x W_gate) ⊙ x W_up)`` [R, D].

    With FP8 weights ``x_ND`` may be a QArray already quantized per token in 1x128 groups.
    """
    gs = d.group_sizes_E
    if isinstance(p["w_gate"], TrainQWeight):  # fp8_rollout training: the rollout's FP8 GEMM
        xs = x_ND[d.token_R]
        gate_up = grouped_train_matmul(xs, (p["w_gate"], p["w_up"]), gs)
        f = p["w_gate"].shape[-1]
        return grouped_train_matmul(jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:], p["w_down"], gs)
    if not isinstance(p["w_gate"], QArray):
        xs = x_ND[d.token_R]
        g, u = (_ragged(xs, p[name], gs, kernels) for name in ("w_gate", "w_up"))
        return _ragged(jax.nn.silu(g) * u, p["w_down"], gs, kernels)
    w_g, w_u, w_d = p["w_gate"], p["w_up"], p["w_down"]
    x_q = x_ND
    if not isinstance(x_q, QArray):  # else quantized already (expert parallelism gathers FP8)
        x_q = quantize_activations(x_ND, w_g.block_shape[1], w_g.values.dtype)
    xs_q = QArray(x_q.values[d.token_R], x_q.scales[d.token_R], x_q.block_shape, x_q.dtype)

    def gemm(x, w):
        impl = kernels.grouped_matmul
        return grouped_fp8_matmul(x, w, gs, out_dtype=x_ND.dtype, impl=impl)

    gate_up = gemm(xs_q, (w_g, w_u))  # one launch over both stacks: [R, 2F]
    f = w_g.shape[1]
    h = jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]
    return gemm(h, w_d)


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
