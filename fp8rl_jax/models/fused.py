"""Fused rollout projections: q|k|v and gate|up as one FP8 weight each, one GEMM per group.

At decode sizes (M <= 64 tokens) a GEMM streams its weight once and is bound by HBM latency
and by how many SMs its grid fills: Qwen3-8B's k_proj and v_proj (N = 1024) fill 16 of 132
H100 SMs and are predicted 0.6x a BF16 ``jnp.dot`` (``experiments/results/perf_model.md``).
One GEMM over the concatenated weights (N = 6144) fills 96 SMs, reads the activations once
and quantizes them once: predicted 1.7x the BF16 GEMM of the same fused shape. vLLM does the
same (``QKVParallelLinear``, ``MergedColumnParallelLinear``).

``fuse_projections`` runs once per step in the weight sync (``generation.rollout_weights``,
after the quantized weights are pinned to the rollout layout), not per decode step. It fuses
only QArray weights whose parts concatenate exactly, block for block (each part's rows whole
128-blocks), so the fused GEMM computes the same sums per output column as the separate ones:

- ``attn.wqkv`` ``[K·(G+2)·C, D]`` from ``wq`` ``[H·C, D]``, ``wk``/``wv`` ``[K·C, D]`` (QArray
  layout ``[N, K]``), grouped per KV head ``g``: the ``G = H/K`` query heads that read ``g``,
  then ``k_g``, then ``v_g``. Needs ``C % block_n == 0``.
- ``mlp.w_gate_up`` ``[2F, D]`` from ``w_gate``/``w_up`` ``[F, D]``, interleaved per
  ``block_n`` rows: gate block ``j`` then up block ``j``. Needs ``F % block_n == 0``.

Both orders keep every tensor-parallel shard whole: a shard of whole KV groups (or whole
gate/up block pairs) holds exactly the rows the separate weights' shards hold, so the split
after the GEMM needs no communication (``train.sharding`` gives the fused dims the logical
names ``qkv_groups`` and ``mlp_pairs``, whose shards are whole groups / pairs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.models.config import ModelConfig
from kernels_pallas.act_quantize.reference import split_gate_up  # noqa: F401  (re-exported)
from kernels_pallas.qarray import QArray

QKV, GATE_UP = "wqkv", "w_gate_up"
QKV_PARTS, GATE_UP_PARTS = ("wq", "wk", "wv"), ("w_gate", "w_up")
# Logical axis names of the fused weights (training layout [in, out], as ``logical_axes``).
QKV_AXES, GATE_UP_AXES = ("embed", "qkv_groups"), ("embed", "mlp_pairs")


def _concatenable(parts: list) -> bool:
    """Same-format 2-D-blocked QArrays over the same input dim K."""
    if not all(isinstance(w, QArray) and len(w.block_shape) == 2 for w in parts):
        return False
    first = parts[0]
    return all(
        w.block_shape == first.block_shape
        and w.dtype == first.dtype
        and w.values.dtype == first.values.dtype
        and w.values.shape[:-2] == first.values.shape[:-2]
        and w.values.shape[-1] == first.values.shape[-1]
        for w in parts
    )


def _split_rows(a: jax.Array, groups: int) -> jax.Array:
    """``[..., R, X] -> [..., groups, R / groups, X]``."""
    *lead, r, x = a.shape
    return a.reshape(*lead, groups, r // groups, x)


def _join_rows(a: jax.Array) -> jax.Array:
    """``[..., A, B, X] -> [..., A·B, X]``."""
    *lead, g, r, x = a.shape
    return a.reshape(*lead, g * r, x)


def _concat_groups(parts: list[QArray], groups: int) -> QArray:
    """Rows of each part cut into ``groups`` equal runs; run ``g`` of every part, in order,
    then run ``g + 1``: values and scales alike (each run is whole ``block_n`` blocks)."""
    vals = jnp.concatenate([_split_rows(w.values, groups) for w in parts], axis=-2)
    scales = jnp.concatenate([_split_rows(w.scales, groups) for w in parts], axis=-2)
    first = parts[0]
    return QArray(_join_rows(vals), _join_rows(scales), first.block_shape, first.dtype)


def can_fuse_qkv(p: dict, cfg: ModelConfig) -> bool:
    parts = [p.get(n) for n in QKV_PARTS]
    return _concatenable(parts) and cfg.head_dim % parts[0].block_shape[0] == 0


def can_fuse_gate_up(p: dict) -> bool:
    parts = [p.get(n) for n in GATE_UP_PARTS]
    return (
        _concatenable(parts)
        and parts[0].values.ndim == 2  # dense MLP (MoE experts fuse in grouped_fp8_matmul)
        and parts[0].shape == parts[1].shape
        and parts[0].shape[-2] % parts[0].block_shape[0] == 0
    )


def fuse_qkv(wq: QArray, wk: QArray, wv: QArray, cfg: ModelConfig) -> QArray:
    """``wqkv`` (module docstring): per KV head, its query heads, its key, its value."""
    return _concat_groups([wq, wk, wv], cfg.num_kv_heads)


def fuse_gate_up(w_gate: QArray, w_up: QArray) -> QArray:
    """``w_gate_up`` (module docstring): gate and up interleaved per ``block_n`` rows."""
    return _concat_groups([w_gate, w_up], w_gate.shape[-2] // w_gate.block_shape[0])


def split_qkv(y: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x @ wqkv`` ``[..., K·(G+2)·C]`` -> q ``[..., H, C]``, k and v ``[..., K, C]``."""
    K, C = cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // K
    y = y.reshape(*y.shape[:-1], K, G + 2, C)
    q = y[..., :G, :].reshape(*y.shape[:-3], K * G, C)  # query head g·G + j reads KV head g
    return q, y[..., G, :], y[..., G + 1, :]


def _map_layers(tree, attn_fn, mlp_fn):
    """Applies ``attn_fn`` / ``mlp_fn`` to every layer's ``attn`` / ``mlp`` dict (``tree`` itself
    when no dict changed)."""
    layers = tree.get("layers") if isinstance(tree, dict) else None
    if not isinstance(layers, list | tuple):
        return tree
    out, changed = [], False
    for layer in layers:
        layer = dict(layer)
        for key, fn in (("attn", attn_fn), ("mlp", mlp_fn)):
            if isinstance(layer.get(key), dict):
                new = fn(layer[key])
                changed |= new is not layer[key]
                layer[key] = new
        out.append(layer)
    return {**tree, "layers": type(layers)(out)} if changed else tree


def _replace(p: dict, parts: tuple[str, ...], name: str, value) -> dict:
    """``p`` with ``parts`` removed and ``name`` added where the first part was (key order is
    the pytree's leaf order)."""
    out = {}
    for key, v in p.items():
        if key == parts[0]:
            out[name] = value
        elif key not in parts:
            out[key] = v
    return out


def fuse_projections(weights: dict, cfg: ModelConfig) -> dict:
    """Rollout weights with q|k|v and gate|up fused where their QArrays allow (module docstring);
    anything else (BF16 weights, per-tensor scales, ``head_dim % 128``, MoE experts) unchanged
    (``weights`` itself when nothing fuses)."""

    def attn(p):
        if not can_fuse_qkv(p, cfg):
            return p
        return _replace(p, QKV_PARTS, QKV, fuse_qkv(*(p[n] for n in QKV_PARTS), cfg))

    def mlp(p):
        if not can_fuse_gate_up(p):
            return p
        return _replace(p, GATE_UP_PARTS, GATE_UP, fuse_gate_up(*(p[n] for n in GATE_UP_PARTS)))

    return _map_layers(weights, attn, mlp)


def fused_axes(axes: dict, weights: dict) -> dict:
    """``logical_axes(cfg)`` rewritten for the fused leaves ``weights`` holds (same tree)."""
    w_layers = weights.get("layers") if isinstance(weights, dict) else None
    if not isinstance(w_layers, list | tuple) or not isinstance(axes.get("layers"), list | tuple):
        return axes
    out = []
    for ax, w in zip(axes["layers"], w_layers, strict=True):
        ax = dict(ax)
        if QKV in w.get("attn", {}):
            ax["attn"] = _replace(ax["attn"], QKV_PARTS, QKV, QKV_AXES)
        if GATE_UP in w.get("mlp", {}):
            ax["mlp"] = _replace(ax["mlp"], GATE_UP_PARTS, GATE_UP, GATE_UP_AXES)
        out.append(ax)
    return {**axes, "layers": type(axes["layers"])(out)}
