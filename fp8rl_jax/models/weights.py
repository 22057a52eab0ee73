"""The weights pytree: one schema gives shapes, logical axes and random init.

Structure (linear weights are ``[in, out]``; experts stacked ``[E, in, out]``)::

    embed [V, D]                              final_norm [D]        lm_head [D, V] (absent if tied)
    layers[i]: attn_norm [D], mlp_norm [D],
      attn: wq [D, H*C], wk [D, K*C], wv [D, K*C], wo [H*C, D],
            q_bias [H*C], k_bias [K*C], v_bias [K*C] (qkv_bias), o_bias [D] (o_bias),
            q_norm [C], k_norm [C] (qk_norm)
      mlp (dense): w_gate [D, F], w_up [D, F], w_down [F, D]
      mlp (MoE):   router [D, E], w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D]

``layers`` is a Python list (not stacked) so FP8 recipes can keep some layers BF16. Paths such as
``layers.0.attn.q_norm``, ``layers.0.mlp.router``, ``layers.0.attn.q_bias`` match the
``quantize_params`` exclusions (embed|lm_head|norm|router|bias); only the w* matrices quantize.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from fp8rl_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Shape, logical axis names and init of one weight."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names for sharding rules (None = replicated)
    init: str  # "normal" (fan-in scaled), "embed" (unit normal), "ones", "zeros"


def _attn_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    D, H, K, C = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    s = {
        "wq": ParamSpec((D, H * C), ("embed", "q_heads"), "normal"),
        "wk": ParamSpec((D, K * C), ("embed", "kv_heads"), "normal"),
        "wv": ParamSpec((D, K * C), ("embed", "kv_heads"), "normal"),
        "wo": ParamSpec((H * C, D), ("q_heads", "embed"), "normal"),
    }
    if cfg.qkv_bias:
        s["q_bias"] = ParamSpec((H * C,), ("q_heads",), "zeros")
        s["k_bias"] = ParamSpec((K * C,), ("kv_heads",), "zeros")
        s["v_bias"] = ParamSpec((K * C,), ("kv_heads",), "zeros")
    if cfg.o_bias:
        s["o_bias"] = ParamSpec((D,), ("embed",), "zeros")
    if cfg.qk_norm:
        s["q_norm"] = ParamSpec((C,), ("head_dim",), "ones")
        s["k_norm"] = ParamSpec((C,), ("head_dim",), "ones")
    return s


def _mlp_specs(cfg: ModelConfig, layer: int) -> dict[str, ParamSpec]:
    D = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        F = cfg.intermediate_size
        return {
            "w_gate": ParamSpec((D, F), ("embed", "mlp"), "normal"),
            "w_up": ParamSpec((D, F), ("embed", "mlp"), "normal"),
            "w_down": ParamSpec((F, D), ("mlp", "embed"), "normal"),
        }
    E, F = cfg.num_experts, cfg.moe_intermediate_size
    return {
        "router": ParamSpec((D, E), ("embed", None), "normal"),
        "w_gate": ParamSpec((E, D, F), ("experts", "embed", "mlp"), "normal"),
        "w_up": ParamSpec((E, D, F), ("experts", "embed", "mlp"), "normal"),
        "w_down": ParamSpec((E, F, D), ("experts", "mlp", "embed"), "normal"),
    }


def param_specs(cfg: ModelConfig) -> dict:
    """The weights pytree with a ``ParamSpec`` at every leaf."""
    D, V = cfg.hidden_size, cfg.vocab_size
    layers = [
        {
            "attn_norm": ParamSpec((D,), ("embed",), "ones"),
            "attn": _attn_specs(cfg),
            "mlp_norm": ParamSpec((D,), ("embed",), "ones"),
            "mlp": _mlp_specs(cfg, i),
        }
        for i in range(cfg.num_layers)
    ]
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), "embed"),
        "layers": layers,
        "final_norm": ParamSpec((D,), ("embed",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), "normal")
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def logical_axes(cfg: ModelConfig) -> dict:
    """Same structure as the weights; each leaf a tuple of logical axis names (None: replicated)."""
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def weight_shapes(cfg: ModelConfig) -> dict:
    """Same structure as the weights; each leaf its shape tuple."""
    return jax.tree.map(lambda s: s.shape, param_specs(cfg), is_leaf=_is_spec)


def _init_leaf(spec: ParamSpec, key, dtype):
    if spec.init == "ones":
        return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, dtype)
    # "normal": N(0, 1/fan_in) keeps activations O(1) so tests see non-trivial logits.
    std = 1.0 if spec.init == "embed" else 1.0 / math.sqrt(spec.shape[-2])
    return (std * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)


def init_weights(cfg: ModelConfig, rng: jax.Array, dtype=jnp.bfloat16, *, randomize_all=False):
    """Random weights for ``cfg``. ``randomize_all`` also perturbs norms and biases (tests)."""
    specs = param_specs(cfg)
    flat, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(rng, len(flat))
    leaves = []
    for spec, key in zip(flat, keys, strict=True):
        leaf = _init_leaf(spec, key, jnp.float32)
        if randomize_all and spec.init in ("ones", "zeros"):
            leaf = leaf + 0.1 * jax.random.normal(key, spec.shape, jnp.float32)
        leaves.append(leaf.astype(dtype))
    return jax.tree.unflatten(treedef, leaves)
