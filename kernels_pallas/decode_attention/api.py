"""``decode_attention``: validates operands and runs an implementation from its ``ImplTable``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import attention_autotune
from kernels_pallas.backend import Impl, Implementation, ImplTable
from kernels_pallas.decode_attention import pallas_mosaic_gpu as mgpu
from kernels_pallas.decode_attention import pallas_tpu as tpu
from kernels_pallas.decode_attention.common import DecodeBlocks, is_slot_scale, quantize_output
from kernels_pallas.decode_attention.reference import decode_attention_reference
from kernels_pallas.qarray import QArray, fp8_dtype


def _check(q_BHC, k_BSKC, v_BSKC, lengths_B, starts_B, k_scale, v_scale) -> None:
    if q_BHC.ndim != 3 or k_BSKC.ndim != 4 or v_BSKC.shape != k_BSKC.shape:
        raise ValueError(
            f"decode_attention: need q [B, H, C] and k, v [B, S, K, C]; got {q_BHC.shape}, "
            f"{k_BSKC.shape}, {v_BSKC.shape}"
        )
    b, h, c = q_BHC.shape
    bk, s, n_kv, ck = k_BSKC.shape
    if (bk, ck) != (b, c) or h % n_kv:
        raise ValueError(f"decode_attention: q {q_BHC.shape} does not match k {k_BSKC.shape}")
    for name, x in (("lengths_B", lengths_B), ("starts_B", starts_B)):
        if x is not None and (jnp.shape(x) != (b,) or not jnp.issubdtype(x.dtype, jnp.integer)):
            raise ValueError(f"decode_attention: {name} must be integer [B]={b}, got {x!r}")
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None and jnp.shape(sc) not in ((), (n_kv,), (b, n_kv, s)):
            raise ValueError(
                f"decode_attention: {name} must be [], [K]={n_kv} or [B, K, S]={(b, n_kv, s)}, "
                f"got {jnp.shape(sc)}"
            )
    if is_slot_scale(k_scale) != is_slot_scale(v_scale):
        raise ValueError("decode_attention: k_scale and v_scale must both be dynamic or neither")


def _run_xla(q, k, v, lengths_B, *, config, interpret, quant_out, **kw):
    del config, interpret  # the reference has no tiling
    return quantize_output(decode_attention_reference(q, k, v, lengths_B, **kw), quant_out)


def _run_mgpu(q, k, v, lengths_B, *, config, interpret, quant_out, **kw):
    blocks = mgpu.resolve_blocks(config, q, k)
    return mgpu.decode_attention_mgpu(q, k, v, lengths_B, **kw, blocks=blocks,
                                      quant_out=quant_out, interpret=interpret)  # fmt: skip


def _run_tpu(q, k, v, lengths_B, *, config, interpret, quant_out, **kw):
    blocks = tpu.resolve_blocks(config, q, k)
    o = tpu.decode_attention_tpu(q, k, v, lengths_B, **kw, blocks=blocks, interpret=interpret)
    return quantize_output(o, quant_out)


TABLE = ImplTable(
    "decode_attention",
    [
        Implementation("xla", _run_xla),
        Implementation("pallas_mosaic_gpu", _run_mgpu, mgpu.supports),
        Implementation("pallas_tpu", _run_tpu, tpu.supports),
    ],
)


def decode_attention(
    q_BHC: jax.Array,
    k_BSKC: jax.Array,
    v_BSKC: jax.Array,
    lengths_B: jax.Array,
    *,
    starts_B: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float,
    impl: Impl = "auto",
    config: DecodeBlocks | None = None,
    quant_out=None,
    interpret: bool = False,
) -> jax.Array | QArray:
    """Single-query attention over the live slots ``[starts_B, lengths_B)`` of a KV cache.

    See ``decode_attention_reference`` for the math. K/V may be BF16/F16/F32 (scales None) or
    FP8 with static scales ([] or [K]) or dynamic ones ([B, K, S]). The kernels read only the
    cache tiles that hold live slots. ``impl="auto"`` runs the target's kernel where its support
    check passes, else the XLA reference (one log line); ``config`` (``DecodeBlocks``, None: the
    per-shape default, or with ``FP8RL_AUTOTUNE=1`` on a Hopper GPU the fastest tiling timed
    there: ``kernels_pallas.attention_autotune``) sets the kernels' tiling. ``quant_out`` (an
    FP8 dtype) returns the output quantized for an FP8 o_proj: a QArray ``[B, H·C]``, per token
    in 1x128 groups, of the output in q's dtype; the Hopper kernel does it in the launch that
    combines its chunks (``act_quantize.fused.combine_quantize_triton``).
    """
    _check(q_BHC, k_BSKC, v_BSKC, lengths_B, starts_B, k_scale, v_scale)
    kw = dict(starts_B=starts_B, k_scale=k_scale, v_scale=v_scale, sm_scale=float(sm_scale))
    quant_out = None if quant_out is None else fp8_dtype(quant_out)
    if attention_autotune.enabled_for(impl, config, interpret):
        config = attention_autotune.dense_config(
            q_BHC, k_BSKC, v_BSKC, k_scale=k_scale, v_scale=v_scale, sm_scale=float(sm_scale),
            quant_out=quant_out, run=decode_attention,
        )  # fmt: skip
    chosen = TABLE.select(
        impl, q_BHC, k_BSKC, v_BSKC, lengths_B, **kw, config=config, interpret=interpret
    )
    return chosen.run(q_BHC, k_BSKC, v_BSKC, lengths_B, **kw, config=config, quant_out=quant_out,
                      interpret=interpret)  # fmt: skip
