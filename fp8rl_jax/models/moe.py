"""Mixture of experts (Qwen3-MoE): top-k softmax routing, dropless grouped SwiGLU experts.

``moe_mlp`` composes the steps of ``experts.py`` (route, dispatch, experts, combine) on one
device, or, under a mesh with ``expert`` > 1, through ``moe_parallel.expert_parallel_mlp``
(the experts sharded, tokens exchanged by all-to-all).
"""

from __future__ import annotations

import jax

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.experts import (
    REPLAY_NONE,
    RouterStats,
    combine,
    dispatch,
    experts,
    load_balancing_loss,
    moe_mlp_dense_reference,
    route,
    router_stats,
)
from fp8rl_jax.models.moe_parallel import expert_mesh, expert_parallel_mlp
from kernels_pallas.backend import DEFAULT_KERNELS, KernelImpls

__all__ = [
    "REPLAY_NONE",
    "RouterStats",
    "load_balancing_loss",
    "moe_mlp",
    "moe_mlp_dense_reference",
    "route",
]


def moe_mlp(
    p: dict,
    x_BTD: jax.Array,
    valid_BT: jax.Array,
    cfg: ModelConfig,
    kernels: KernelImpls = DEFAULT_KERNELS,
    expert_ids_NK: jax.Array | None = None,
):
    """Dropless top-k MoE SwiGLU block: (y [B, T, D], RouterStats).

    ``expert_ids_NK`` ([B·T, k], optional): route with these experts (routing replay, ``route``).
    Under a mesh with ``expert`` > 1 the experts run sharded (``moe_parallel``).
    """
    B, T, D = x_BTD.shape
    x = x_BTD.reshape(B * T, D)
    top_w, top_i, probs = route(x, p["router"], cfg, expert_ids_NK)
    if (mesh := expert_mesh(cfg.num_experts)) is not None:
        y = expert_parallel_mlp(p, x, top_w, top_i, mesh, kernels)
    else:
        d = dispatch(top_i, cfg.num_experts)
        y = combine(experts(p, x, d, kernels), top_w, d)
    return y.reshape(B, T, D), router_stats(top_i, probs, valid_BT.reshape(-1))
