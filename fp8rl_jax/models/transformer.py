"""The decoder forward pass: plain functions over the weights pytree (Array or QArray leaves)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp8rl_jax.models import kv_cache as kvc
from fp8rl_jax.models import paged_kv_cache as pkv
from fp8rl_jax.models.attention import (
    attention,
    cache_mask,
    causal_segment_mask,
    fake_quantize_q,
    project_qkv,
    qkv_amax,
)
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.layers import linear, rms_norm, swiglu_mlp
from fp8rl_jax.models.moe import load_balancing_loss, moe_mlp
from fp8rl_jax.models.remat import remat_block
from fp8rl_jax.models.rope import rope_cos_sin
from kernels_pallas.backend import DEFAULT_KERNELS, KernelImpls
from kernels_pallas.decode_attention import decode_attention
from kernels_pallas.paged_attention import paged_attention


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
    cache: kvc.KVCache | pkv.PagedKVCache | None = None  # updated cache (when one was passed in)
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


def _attention_layer(p, h_BTD, layer, ctx):
    """Self-attention of one layer; returns (output [B, T, D], amax triple, cache writes)."""
    cfg, cache = ctx["cfg"], ctx["cache"]
    B, T, _ = h_BTD.shape
    kernels: KernelImpls = ctx["kernels"]
    q, k, v = project_qkv(p, h_BTD, ctx["cos"], ctx["sin"], cfg, kernels.matmul)
    amax = qkv_amax(q, k, v, ctx["valid_BT"]) if ctx["want_amax"] else None
    sm_scale = cfg.head_dim**-0.5
    if cache is None:
        o = attention(q, k, v, ctx["mask"], sm_scale=sm_scale)
        writes = None
    elif isinstance(cache, pkv.PagedKVCache):  # one query per slot over its pages
        writes = pkv.write_token(cache, layer, k, v, ctx["valid_BT"][:, 0])
        k_c, v_c, ks, vs = writes
        o = paged_attention(
            q[:, 0], k_c, v_c, ctx["paged_lengths_B"], cache.page_table_UW, k_scale=ks,
            v_scale=vs, sm_scale=sm_scale, impl=kernels.decode_attention or "xla",
            interpret=kernels.interpret,
        )[:, None]  # fmt: skip
    else:
        if cache.q_scale is not None:
            q = fake_quantize_q(q, cache.q_scale[layer])
        writes = kvc.write_layer(cache, layer, k, v, ctx["slots_BT"])
        k_c, v_c, ks, vs = writes
        if "live" in ctx:  # one query per row: the kernel op over the live slots
            starts_B, lengths_B = ctx["live"]
            o = decode_attention(
                q[:, 0], k_c, v_c, lengths_B, starts_B=starts_B, k_scale=ks, v_scale=vs,
                sm_scale=sm_scale, impl=kernels.decode_attention, interpret=kernels.interpret,
            )[:, None]  # fmt: skip
        else:
            o = attention(
                q, k_c, v_c, ctx["mask"], sm_scale=sm_scale, mode=cache.mode, k_scale=ks, v_scale=vs
            )
    o = o.reshape(B, T, cfg.num_heads * cfg.head_dim)
    o = linear(o, p["wo"], p.get("o_bias"), impl=kernels.matmul)
    return o, amax, writes


def _block(p, x_BTD, expert_ids_NK, *, layer, ctx):
    """One transformer block; returns (x', amax triple, cache writes, router stats or None)."""
    cfg, kernels = ctx["cfg"], ctx["kernels"]
    h = rms_norm(x_BTD, p["attn_norm"], cfg.rms_norm_eps)
    o, amax, writes = _attention_layer(p["attn"], h, layer, ctx)
    x_BTD = x_BTD + o
    h = rms_norm(x_BTD, p["mlp_norm"], cfg.rms_norm_eps)
    stats = None
    if cfg.is_moe_layer(layer):
        y, stats = moe_mlp(p["mlp"], h, ctx["valid_BT"], cfg, kernels, expert_ids_NK=expert_ids_NK)
    else:
        y = swiglu_mlp(p["mlp"], h, impl=kernels.matmul)
    return x_BTD + y, amax, writes, stats


def _stack_expert_ids(router: list, shape_BT) -> jax.Array | None:
    """The MoE layers' experts per token, int16 [B, T, L_moe, k] (None without MoE layers)."""
    if not router:
        return None
    ids = jnp.stack([r.expert_ids_NK for r in router], axis=1)  # [B·T, L_moe, k]
    return ids.reshape(*shape_BT, *ids.shape[1:]).astype(jnp.int16)


def _context(weights, tokens_BT, cfg, positions_BT, segment_ids_BT, cache, want_amax, kernels):
    B, T = tokens_BT.shape
    seg = jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
    valid_BT = seg != 0
    ctx = dict(cfg=cfg, cache=cache, valid_BT=valid_BT, want_amax=want_amax)
    ctx["kernels"] = kernels
    if cache is None:
        ctx["mask"] = causal_segment_mask(seg)
        default_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    elif isinstance(cache, pkv.PagedKVCache):
        if T != 1:
            raise ValueError(f"forward: a PagedKVCache takes one token per slot, got T={T}")
        default_pos = cache.lengths_U[:, None]
        # A valid slot attends over its held tokens and the new one; an invalid one over none.
        ctx["paged_lengths_B"] = jnp.where(valid_BT[:, 0], cache.lengths_U + 1, 0)
    else:
        slots = cache.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)
        ctx["slots_BT"] = slots
        valid_after = kvc.scatter_slots(cache.valid_BS, valid_BT, slots)
        if kernels.decode_attention is not None and T == 1:
            # The valid slots up to the query's own: its row's live range, computed once.
            starts_B, ends_B = kvc.live_range(valid_after)
            ctx["live"] = (starts_B, jnp.minimum(ends_B, slots[:, 0] + 1))
        else:
            ctx["mask"] = cache_mask(valid_after, slots)
        default_pos = slots
    pos = default_pos if positions_BT is None else positions_BT
    dtype = weights["embed"].dtype
    ctx["cos"], ctx["sin"] = rope_cos_sin(pos, cfg.rope, cfg.head_dim, dtype)
    return ctx


def forward(
    weights: dict,
    tokens_BT: jax.Array,
    cfg: ModelConfig,
    *,
    positions_BT: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
    cache: kvc.KVCache | None = None,
    return_qkv_amax: bool = False,
    return_hidden: bool = False,
    last_logits_only: bool = False,
    kernels: KernelImpls = DEFAULT_KERNELS,
    expert_ids_BTLK: jax.Array | None = None,
    return_expert_ids: bool = False,
    return_logits: bool = True,
    remat: str = "none",
) -> ForwardOut:
    """Causal LM forward; returns a ``ForwardOut`` (logits f32, cache, Q/K/V amax, aux loss).

    ``segment_ids_BT``: 0 marks padding; without a cache tokens attend within their segment
    (packing), causally by index. ``positions_BT`` default: ``arange(T)`` (no cache) or the write
    slots ``lengths_B + arange(T)`` (with cache). With a cache the T tokens of row b are written at
    slots ``lengths_B[b] + arange(T)`` (pad tokens written but invalid) and attend over the valid
    slots up to their own; the returned cache has ``lengths_B + T``. The compute dtype is that of
    ``weights["embed"]``; norms, softmax and router run in f32. ``kernels`` picks the
    implementation of each kernel op: ``matmul`` for QArray (W8A8) weights; ``decode_attention``
    (None: the jnp ``attention``) for one-token steps over a cache, through
    ``kernels_pallas.decode_attention``. ``last_logits_only``: logits of the last position only
    ([B, 1, V]; a prefill needs no more, and [B, T, V] f32 logits of a long prompt batch are GBs).
    MoE routing replay: ``expert_ids_BTLK`` ([B, T, L_moe, k], the MoE layers in order) routes
    each token with the given experts (``moe.route``; ``moe.REPLAY_NONE`` entries route as
    usual); ``return_expert_ids`` returns the experts every MoE layer used (int16, same layout;
    None for a dense model). Both are ignored by dense models.
    With a ``PagedKVCache`` (T = 1, one row per decode slot), a valid row's token is written at
    its slot's ``lengths_U`` (also its default position) and attends over its pages through
    ``kernels_pallas.paged_attention`` (``decode_attention`` None: the ``xla`` implementation);
    only valid rows write and advance.
    ``return_logits=False``: no lm_head (``logits_BTV`` None), for callers that take the
    log-probs from ``hidden_BTD`` in chunks (``rl.chunked``). ``remat`` (``models.remat``):
    ``jax.checkpoint`` policy per block in a forward without a cache (a training forward).
    """
    ctx = _context(
        weights, tokens_BT, cfg, positions_BT, segment_ids_BT, cache, return_qkv_amax, kernels
    )
    x = weights["embed"][tokens_BT]
    amaxes, writes, router = [], [], []
    for i, p in enumerate(weights["layers"]):
        ids = None
        if cfg.is_moe_layer(i) and expert_ids_BTLK is not None:
            ids = expert_ids_BTLK[:, :, len(router)].reshape(-1, cfg.num_experts_per_tok)
        block = functools.partial(_block, layer=i, ctx=ctx)
        # Rematerialization only where a backward pass can follow (no cache: training forwards).
        x, amax, w, stats = remat_block(block, remat if cache is None else "none")(p, x, ids)
        amaxes.append(amax)
        writes.append(w)
        if stats is not None:
            router.append(stats)
    h = rms_norm(x, weights["final_norm"], cfg.rms_norm_eps)
    new_cache = None
    if isinstance(cache, pkv.PagedKVCache):
        new_k, new_v, new_ks, new_vs = (list(c) for c in zip(*writes, strict=True))
        new_cache = pkv.advance(cache, new_k, new_v, new_ks, new_vs, ctx["valid_BT"][:, 0])
    elif cache is not None:
        new_k, new_v, new_ks, new_vs = (list(c) for c in zip(*writes, strict=True))
        new_cache = kvc.advance(
            cache, new_k, new_v, new_ks, new_vs, ctx["slots_BT"], ctx["valid_BT"]
        )
    stats = None
    if return_qkv_amax:
        stats = QKVAmax(*(jnp.stack(a) for a in zip(*amaxes, strict=True)))
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
