"""``paged_attention``: validates operands and runs an implementation from its ``ImplTable``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import attention_autotune
from kernels_pallas.backend import Impl, Implementation, ImplTable
from kernels_pallas.decode_attention.common import quantize_output
from kernels_pallas.paged_attention.common import PagedBlocks
from kernels_pallas.paged_attention.reference import is_page_scale
from kernels_pallas.paged_attention.xla import paged_attention_xla
from kernels_pallas.qarray import QArray, fp8_dtype


def _check(q_BHC, k_pages, v_pages, lengths_B, page_table_BW, k_scale, v_scale) -> None:
    if q_BHC.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"paged_attention: need q [B, H, C] and k, v pages [X, Y, K, C]; got {q_BHC.shape}, "
            f"{k_pages.shape}, {v_pages.shape}"
        )
    b, h, c = q_BHC.shape
    x, y, n_kv, ck = k_pages.shape
    if ck != c or h % n_kv:
        raise ValueError(f"paged_attention: q {q_BHC.shape} does not match pages {k_pages.shape}")
    if jnp.shape(lengths_B) != (b,) or not jnp.issubdtype(lengths_B.dtype, jnp.integer):
        raise ValueError(f"paged_attention: lengths_B must be integer [B]={b}, got {lengths_B!r}")
    if jnp.ndim(page_table_BW) != 2 or jnp.shape(page_table_BW)[0] != b:
        raise ValueError(
            f"paged_attention: page_table_BW must be [B={b}, W], got {jnp.shape(page_table_BW)}"
        )
    if not jnp.issubdtype(page_table_BW.dtype, jnp.integer):
        raise ValueError(
            f"paged_attention: page_table_BW must be integer, got {page_table_BW.dtype}"
        )
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None and jnp.shape(sc) not in ((), (n_kv,), (x, n_kv, y)):
            raise ValueError(
                f"paged_attention: {name} must be [], [K]={n_kv} or [X, K, Y]={(x, n_kv, y)}, "
                f"got {jnp.shape(sc)}"
            )
    if is_page_scale(k_scale) != is_page_scale(v_scale):
        raise ValueError("paged_attention: k_scale and v_scale must both be dynamic or neither")


def _run_xla(q, k, v, lengths_B, table, *, config, interpret, quant_out, **kw):
    del interpret
    window = None if config is None else config.window_pages
    o = paged_attention_xla(q, k, v, lengths_B, table, **kw, window_pages=window)
    return quantize_output(o, quant_out)


def _run_tpu(*args, quant_out, **kw):
    from kernels_pallas.paged_attention import pallas_tpu

    return quantize_output(pallas_tpu.run(*args, **kw), quant_out)


def _implementations() -> list[Implementation]:
    from kernels_pallas.paged_attention import pallas_mosaic_gpu, pallas_tpu

    return [
        Implementation("xla", _run_xla),
        Implementation("pallas_mosaic_gpu", pallas_mosaic_gpu.run, pallas_mosaic_gpu.supports),
        Implementation("pallas_tpu", _run_tpu, pallas_tpu.supports),
    ]


TABLE = ImplTable("paged_attention", _implementations())


def paged_attention(
    q_BHC: jax.Array,
    k_pages_XYKC: jax.Array,
    v_pages_XYKC: jax.Array,
    lengths_B: jax.Array,
    page_table_BW: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sm_scale: float,
    impl: Impl = "auto",
    config: PagedBlocks | None = None,
    quant_out=None,
    interpret: bool = False,
) -> jax.Array | QArray:
    """Single-query attention over each row's paged slots ``[0, lengths_B[b])``.

    See ``paged_attention_reference`` for the math. Pages may be BF16/F16/F32 (scales None) or
    FP8 with static scales ([] or [K]) or dynamic ones ([X, K, Y], one per cached vector). The
    kernels read only the pages a row holds; ``xla`` reads a window of the table covering the
    longest row. ``impl="auto"`` runs the target's kernel where its support check passes, else
    ``xla`` (one log line); ``config`` (``PagedBlocks``; None: the default, or with
    ``FP8RL_AUTOTUNE=1`` on a Hopper GPU the fastest tiling timed there:
    ``kernels_pallas.attention_autotune``) sets the tiling. ``quant_out``: as
    ``decode_attention``'s (a QArray ``[B, H·C]`` for an FP8 o_proj).
    """
    _check(q_BHC, k_pages_XYKC, v_pages_XYKC, lengths_B, page_table_BW, k_scale, v_scale)
    kw = dict(k_scale=k_scale, v_scale=v_scale, sm_scale=float(sm_scale))
    args = (q_BHC, k_pages_XYKC, v_pages_XYKC, lengths_B, page_table_BW)
    quant_out = None if quant_out is None else fp8_dtype(quant_out)
    if attention_autotune.enabled_for(impl, config, interpret):
        config = attention_autotune.paged_config(
            q_BHC, k_pages_XYKC, v_pages_XYKC, page_table_BW, k_scale=k_scale, v_scale=v_scale,
            sm_scale=float(sm_scale), quant_out=quant_out, run=paged_attention,
        )  # fmt: skip
    chosen = TABLE.select(impl, *args, **kw, config=config, interpret=interpret)
    return chosen.run(*args, **kw, config=config, quant_out=quant_out, interpret=interpret)
