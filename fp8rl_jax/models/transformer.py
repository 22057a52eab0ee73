"""The decoder forward pass: plain functions over the weights pytree (Array or QArray leaves)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8rl_jax.models.attention import (
    SegmentMask,
    attention,
    project_qkv,
    qkv_amax,
)
from fp8rl_jax.models.cache import Cache, CacheStep
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.fused import GATE_UP, QKV, QKV_PARTS
from fp8rl_jax.models.layers import linear, producer_dtype, rms_norm, rms_norm_for, swiglu_mlp
from fp8rl_jax.models.moe import load_balancing_loss, moe_mlp
from fp8rl_jax.models.remat import remat_block
from fp8rl_jax.models.rope import rope_cos_sin
from fp8rl_jax.models.rows import constrain_rows
from kernels_pallas.backend import DEFAULT_KERNELS, KernelImpls
from kernels_pallas.qarray import QArray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QKVAmax:
    """Per-layer max |x| of Q, K, V after QK-norm and RoPE, over valid (non-pad) tokens (f32)."""

    q_LK: jax.Array  # Q per layer and KV-head group (the H/K query heads sharing KV head k)
    k_LK: jax.Array  # K per layer and KV head
    v_LK: jax.Array  # V per layer and KV head


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOut:
    """What ``forward`` returns; optional parts are None unless asked for."""

    logits_BTV: jax.Array | None  # float32; None when return_logits=False
    cache: Cache | None = None  # updated cache (when one was passed in)
    qkv_amax: QKVAmax | None = None  # when return_qkv_amax=True
    aux_loss: jax.Array | None = None  # MoE load-balancing loss (unscaled), 0 for dense models
    hidden_BTD: jax.Array | None = None  # final-norm hidden states, when return_hidden=True
    # int16 [B, T, L_moe, k]: each token's experts per MoE layer, when return_expert_ids=True
    expert_ids_BTLK: jax.Array | None = None


def lm_head(weights: dict, h_BTD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """f32 logits ``[B, T, V]`` of final-norm hidden states (tied embedding or ``lm_head``)."""
    if cfg.tie_word_embeddings:
        emb = weights["embed"]
        prec = jax.lax.Precision.HIGHEST if emb.dtype == jnp.float32 else None
        return jnp.einsum(
            "btd,vd->btv", h_BTD, emb, preferred_element_type=jnp.float32, precision=prec
        )
    return linear(h_BTD, weights["lm_head"]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Uncached:
    """The ``CacheStep`` of a forward without a cache: causal attention within segments."""

    mask: SegmentMask  # causal within segments, its rows made per query block
    positions_BT: jax.Array
    kv_quant: object = None  # quant.KVFakeQuant: K/V as the rollout's FP8 cache holds them

    def attend(self, layer, q_BTHC, k_BTKC, v_BTKC, sm_scale, quant_out=None):
        del quant_out  # the output stays BF16: the o_proj quantizes it
        if self.kv_quant is not None:  # rl.train_precision="fp8_rollout"
            k_BTKC, v_BTKC = self.kv_quant(layer, k_BTKC, v_BTKC)
        return attention(q_BTHC, k_BTKC, v_BTKC, self.mask, sm_scale=sm_scale), None

    def advance(self, writes):
        return None


def _uncached(segment_ids_BT: jax.Array, kv_quant=None) -> _Uncached:
    B, T = segment_ids_BT.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return _Uncached(SegmentMask(segment_ids_BT), pos, kv_quant)


class _Inputs(NamedTuple):
    """What every layer of one forward call shares."""

    cfg: ModelConfig
    kernels: KernelImpls
    step: CacheStep  # the cache's view of this call (``models.cache``)
    cos_BTC: jax.Array
    sin_BTC: jax.Array
    valid_BT: jax.Array  # bool: real tokens
    want_amax: bool


class _LayerOut(NamedTuple):
    amax: tuple | None  # (q, k, v) max |x| [K] each, when asked for
    kv: object  # the cache's buffers of this layer (None without a cache)
    router: object | None  # MoE routing statistics (None for a dense MLP)


def _attention(p: dict, h_BTD: jax.Array, layer: int, inp: _Inputs):
    """Self-attention of one layer over the cache step; (output [B, T, D], amax, cache writes)."""
    cfg, kernels = inp.cfg, inp.kernels
    B, T, _ = h_BTD.shape
    q, k, v = project_qkv(p, h_BTD, inp.cos_BTC, inp.sin_BTC, cfg, kernels.matmul)
    amax = qkv_amax(q, k, v, inp.valid_BT) if inp.want_amax else None
    # an FP8 o_proj: the cache's attention may hand its output over quantized (one launch)
    quant = producer_dtype(h_BTD, p["wo"], impl=kernels.matmul)
    o, kv = inp.step.attend(layer, q, k, v, cfg.head_dim**-0.5, quant_out=quant)
    if not isinstance(o, QArray):
        o = o.reshape(B, T, cfg.num_heads * cfg.head_dim)
    y = linear(o, p["wo"], p.get("o_bias"), impl=kernels.matmul)
    return y.reshape(B, T, y.shape[-1]), amax, kv


def _consumers(p: dict, parts: tuple[str, ...], fused: str) -> tuple:
    """The weights of the GEMMs a norm's output feeds (one fused weight, or its parts)."""
    return (p[fused],) if fused in p else tuple(p.get(n) for n in parts)


def _layer(p: dict, x_BTD: jax.Array, layer: int, inp: _Inputs, ids_NK):
    """One decoder block: pre-norm attention and MLP (dense or MoE), each with its residual."""
    cfg = inp.cfg
    impl, eps = inp.kernels.matmul, cfg.rms_norm_eps
    qkv = _consumers(p["attn"], QKV_PARTS, QKV)
    h = rms_norm_for(x_BTD, p["attn_norm"], eps, qkv, impl=impl)
    o, amax, kv = _attention(p["attn"], h, layer, inp)
    x_BTD = x_BTD + o
    moe = cfg.is_moe_layer(layer)
    mlp = () if moe else _consumers(p["mlp"], ("w_gate", "w_up"), GATE_UP)
    h = rms_norm_for(x_BTD, p["mlp_norm"], eps, mlp, impl=impl)
    router = None
    if moe:
        y, router = moe_mlp(p["mlp"], h, inp.valid_BT, cfg, inp.kernels, expert_ids_NK=ids_NK)
    else:
        y = swiglu_mlp(p["mlp"], h, impl=inp.kernels.matmul)
    return x_BTD + y, _LayerOut(amax, kv, router)


def _stack_expert_ids(router: list, shape_BT) -> jax.Array | None:
    """The MoE layers' experts per token, int16 [B, T, L_moe, k] (None without MoE layers)."""
    if not router:
        return None
    ids = jnp.stack([r.expert_ids_NK for r in router], axis=1)  # [B·T, L_moe, k]
    return ids.reshape(*shape_BT, *ids.shape[1:]).astype(jnp.int16)


def _rows(x_BTD, cache):
    """A forward without a cache (scoring, training) keeps its rows split over the mesh's batch
    axes at every block, inside a rematerialized block too (``models.rows``); a rollout's cache
    places its rows itself."""
    return constrain_rows(x_BTD) if cache is None else x_BTD


def forward(
    weights: dict,
    tokens_BT: jax.Array,
    cfg: ModelConfig,
    *,
    positions_BT: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
    cache: Cache | None = None,
    return_qkv_amax: bool = False,
    return_hidden: bool = False,
    last_logits_only: bool = False,
    kernels: KernelImpls = DEFAULT_KERNELS,
    expert_ids_BTLK: jax.Array | None = None,
    return_expert_ids: bool = False,
    kv_quant=None,
    return_logits: bool = True,
    remat: str = "none",
) -> ForwardOut:
    """Causal LM forward; returns a ``ForwardOut`` (logits f32, cache, Q/K/V amax, aux loss).

    ``segment_ids_BT``: 0 marks padding; without a cache tokens attend within their segment
    (packing), causally by index. ``positions_BT`` default: ``arange(T)`` (no cache) or the
    cache's write positions. ``cache``: any ``models.cache.Cache`` (``generation.kv``: the dense
    ``KVCache`` writes row b's T tokens at ``lengths_B[b] + arange(T)``, pads written but
    invalid; the paged ``PagedKVCache`` takes one token per slot); each layer attends over it
    through the cache's own kernel call, and ``ForwardOut.cache`` is the cache after the call.
    The compute dtype is that of ``weights["embed"]``; norms, softmax and router run in f32.
    ``kernels`` picks the implementation of each kernel op: ``matmul`` for QArray (W8A8) weights;
    ``decode_attention`` for the caches' one-token steps (None: the dense cache runs the jnp
    ``attention``). ``last_logits_only``: logits of the last position only ([B, 1, V]; a prefill
    needs no more, and [B, T, V] f32 logits of a long prompt batch are GBs).
    MoE routing replay: ``expert_ids_BTLK`` ([B, T, L_moe, k], the MoE layers in order) routes
    each token with the given experts (``moe.route``; ``moe.REPLAY_NONE`` entries route as
    usual); ``return_expert_ids`` returns the experts every MoE layer used (int16, same layout;
    None for a dense model). Both are ignored by dense models.
    ``kv_quant`` (no cache only; ``quant.KVFakeQuant``): ``kv_quant(layer, k, v) -> (k̂, v̂)``
    rounds K/V through the rollout's FP8 cache before attention (``rl.train_precision``).
    ``return_logits=False``: no lm_head (``logits_BTV`` None), for callers that take the
    log-probs from ``hidden_BTD`` in chunks (``rl.chunked``). ``remat`` (``models.remat``):
    ``jax.checkpoint`` policy per block in a forward without a cache (a training forward).
    """
    B, T = tokens_BT.shape
    seg = jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
    valid_BT = seg != 0
    step = _uncached(seg, kv_quant) if cache is None else cache.prepare(valid_BT, kernels)
    pos = step.positions_BT if positions_BT is None else positions_BT
    cos, sin = rope_cos_sin(pos, cfg.rope, cfg.head_dim, weights["embed"].dtype)
    inp = _Inputs(cfg, kernels, step, cos, sin, valid_BT, return_qkv_amax)
    x = weights["embed"][tokens_BT]
    outs: list[_LayerOut] = []
    for i, p in enumerate(weights["layers"]):
        ids = None
        if expert_ids_BTLK is not None and cfg.is_moe_layer(i):
            n_moe = sum(o.router is not None for o in outs)
            ids = expert_ids_BTLK[:, :, n_moe].reshape(-1, cfg.num_experts_per_tok)
        # Rematerialization only where a backward pass can follow (no cache: training forwards).
        block = remat_block(
            lambda p, x, ids, i=i: _layer(p, _rows(x, cache), i, inp, ids),
            remat if cache is None else "none",
        )
        x, out = block(p, _rows(x, cache), ids)
        outs.append(out)
    h = rms_norm(x, weights["final_norm"], cfg.rms_norm_eps)
    new_cache = None if cache is None else step.advance([o.kv for o in outs])
    router = [o.router for o in outs if o.router is not None]
    stats = None
    if return_qkv_amax:
        stats = QKVAmax(*(jnp.stack(a) for a in zip(*(o.amax for o in outs), strict=True)))
    ids_BTLK = _stack_expert_ids(router, tokens_BT.shape) if return_expert_ids else None
    logits_BTV = None
    if return_logits:
        logits_BTV = lm_head(weights, h[:, -1:] if last_logits_only else h, cfg)
    return ForwardOut(
        logits_BTV=logits_BTV,
        cache=new_cache,
        qkv_amax=stats,
        aux_loss=load_balancing_loss(router, cfg.num_experts),
        hidden_BTD=h if return_hidden else None,
        expert_ids_BTLK=ids_BTLK,
    )
