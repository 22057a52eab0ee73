"""``decode_attention``: validates operands and dispatches to the reference or a Pallas kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.backend import IMPLS, Impl, default_impl
from kernels_pallas.decode_attention.common import DEFAULT_BLOCKS, DecodeBlocks
from kernels_pallas.decode_attention.reference import decode_attention_reference


def _check(q_BHC, k_BSKC, v_BSKC, valid_BS, k_scale, v_scale) -> None:
    if q_BHC.ndim != 3 or k_BSKC.ndim != 4 or v_BSKC.shape != k_BSKC.shape:
        raise ValueError(
            f"decode_attention: need q [B, H, C] and k, v [B, S, K, C]; got {q_BHC.shape}, "
            f"{k_BSKC.shape}, {v_BSKC.shape}"
        )
    b, h, c = q_BHC.shape
    bk, s, n_kv, ck = k_BSKC.shape
    if (bk, ck) != (b, c) or h % n_kv:
        raise ValueError(f"decode_attention: q {q_BHC.shape} does not match k {k_BSKC.shape}")
    if valid_BS.shape != (b, s):
        raise ValueError(f"decode_attention: valid_BS must be {(b, s)}, got {valid_BS.shape}")
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None and jnp.shape(sc) not in ((), (n_kv,), (b, s, n_kv)):
            raise ValueError(
                f"decode_attention: {name} must be [], [K]={n_kv} or [B, S, K]={(b, s, n_kv)}, "
                f"got {jnp.shape(sc)}"
            )


def decode_attention(
    q_BHC: jax.Array,
    k_BSKC: jax.Array,
    v_BSKC: jax.Array,
    valid_BS: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float,
    impl: Impl = "auto",
    blocks: DecodeBlocks = DEFAULT_BLOCKS,
    interpret: bool = False,
) -> jax.Array:
    """Single-query attention over a (possibly FP8) KV cache; see ``decode_attention_reference``.

    K/V may be BF16/F32 (scales None) or FP8 with static scales ([] or [K]) or dynamic ones
    ([B, S, K]). ``impl="auto"`` picks the Pallas kernel for the backend, the jnp reference on CPU.
    """
    if impl not in IMPLS:
        raise ValueError(f"decode_attention: unknown impl {impl!r}; expected one of {IMPLS}")
    _check(q_BHC, k_BSKC, v_BSKC, valid_BS, k_scale, v_scale)
    impl = default_impl() if impl == "auto" else impl
    kw = dict(k_scale=k_scale, v_scale=v_scale, sm_scale=float(sm_scale))
    if impl == "xla":
        return decode_attention_reference(q_BHC, k_BSKC, v_BSKC, valid_BS, **kw)
    if impl == "pallas_mosaic_gpu":
        from kernels_pallas.decode_attention import pallas_mosaic_gpu

        fn = pallas_mosaic_gpu.decode_attention_mgpu
    else:
        from kernels_pallas.decode_attention import pallas_tpu

        fn = pallas_tpu.decode_attention_tpu
    return fn(q_BHC, k_BSKC, v_BSKC, valid_BS, **kw, blocks=blocks, interpret=interpret)
