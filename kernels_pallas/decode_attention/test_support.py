"""Decode attention's support checks, which ``auto`` relies on: what each kernel accepts (and
the reason it names when it does not), the dispatch's fallback and errors, and the AOT cases
spanning every configuration the checks accept (``test_decode_attention.py``: the kernels'
numerics)."""

import logging

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import aot
from kernels_pallas.decode_attention import TABLE, DecodeBlocks
from kernels_pallas.decode_attention import pallas_tpu as da_tpu

F8 = jnp.float8_e4m3fn


def _on(target: str):
    """The support checks and the GPU interpreter read the target from an abstract mesh."""
    return jax.sharding.use_abstract_mesh(aot.abstract_mesh(target))


def _sds(b, s, n_kv, group, c, kv_dtype, dynamic=False):
    q = jax.ShapeDtypeStruct((b, n_kv * group, c), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, n_kv, c), kv_dtype)
    ln = jax.ShapeDtypeStruct((b,), jnp.int32)
    sc = jax.ShapeDtypeStruct((b, n_kv, s) if dynamic else (n_kv,), jnp.float32)
    scales = (sc, sc) if kv_dtype == F8 else (None, None)
    return (q, kv, kv, ln), dict(starts_B=ln, k_scale=scales[0], v_scale=scales[1], sm_scale=0.1)


def _reason(impl, args, kw, config=None, interpret=False):
    return TABLE.impls[impl].supports(*args, **kw, config=config, interpret=interpret)


def test_mosaic_gpu_support_check():
    with _on("h100"):
        assert _reason("pallas_mosaic_gpu", *_sds(256, 32768, 8, 8, 128, F8, True)) is None
        assert _reason("pallas_mosaic_gpu", *_sds(4, 4096, 8, 4, 128, jnp.bfloat16)) is None
        assert "multiple of block_s" in _reason("pallas_mosaic_gpu", *_sds(4, 100, 8, 4, 128, F8))
        assert "head_dim" in _reason("pallas_mosaic_gpu", *_sds(4, 128, 8, 4, 96, F8))
        assert "cache dtype" in _reason("pallas_mosaic_gpu", *_sds(4, 128, 8, 4, 128, jnp.float32))
        # group 62: the second head's window would start at row 56 + 6 and overrun 64 rows;
        # swapped it is a 64-wide wgmma N, and 72 is over the widest compiled N.
        g62 = _sds(4, 128, 2, 62, 128, F8)
        assert _reason("pallas_mosaic_gpu", *g62) is None
        assert "window" in _reason("pallas_mosaic_gpu", *g62, DecodeBlocks(swap_ab=False))
        assert "wgmma N 64" in _reason("pallas_mosaic_gpu", *_sds(4, 128, 2, 72, 128, F8))
        args, kw = _sds(4, 128, 8, 4, 128, F8)
        assert "block_s" in _reason("pallas_mosaic_gpu", args, kw, DecodeBlocks(block_s=256))
        # 128 FP8 slots per tile: swap-AB with wgmma N <= 16 only (K's upcast tile in registers)
        wide = DecodeBlocks(block_s=128)
        assert _reason("pallas_mosaic_gpu", args, kw, wide) is None  # group 4: N = 8
        assert _reason("pallas_mosaic_gpu", *_sds(4, 128, 8, 16, 128, F8), wide) is None
        assert "block_s 128" in _reason("pallas_mosaic_gpu", *_sds(4, 128, 8, 24, 128, F8), wide)
        unswapped = DecodeBlocks(block_s=128, swap_ab=False)
        assert "block_s 128" in _reason("pallas_mosaic_gpu", args, kw, unswapped)
    # Not interpreting and no Hopper target (this CPU): the kernel cannot compile.
    assert "Hopper" in _reason("pallas_mosaic_gpu", *_sds(4, 128, 8, 4, 128, F8))


def test_tpu_support_check():
    args, kw = _sds(2, 4096, 8, 4, 128, F8, True)
    assert _reason("pallas_tpu", args, kw, interpret=True) is None
    assert "needs a TPU" in _reason("pallas_tpu", args, kw)
    assert "block_s" in _reason("pallas_tpu", *_sds(2, 200, 8, 4, 128, F8), interpret=True)
    assert "head_dim" in _reason("pallas_tpu", *_sds(2, 256, 8, 4, 64, F8), interpret=True)
    assert da_tpu.resolve_blocks(None, *args[:2]).block_s == 512


def test_auto_picks_the_kernel_only_where_it_compiles(caplog):
    args, kw = _sds(4, 4096, 8, 4, 128, F8)
    assert TABLE.select("auto", *args, **kw, config=None).name == "xla"  # CPU
    with _on("h100"):
        assert TABLE.select("auto", *args, **kw, config=None).name == "pallas_mosaic_gpu"
        bad_args, bad_kw = _sds(4, 100, 8, 4, 128, F8)
        with caplog.at_level(logging.WARNING, logger="kernels_pallas.backend"):
            for _ in range(2):
                assert TABLE.select("auto", *bad_args, **bad_kw, config=None).name == "xla"
        assert len([r for r in caplog.records if "decode_attention" in r.message]) == 1
        with pytest.raises(ValueError, match="multiple of block_s"):
            TABLE.select("pallas_mosaic_gpu", *bad_args, **bad_kw, config=None)


def _fits(mod, block_s: int, stages) -> bool:
    """Whether some cache dtype takes this tile and depth within the SMEM budget (Mosaic GPU;
    the TPU kernel has no stages)."""
    if stages is None:
        return True
    blocks = DecodeBlocks(block_s, 1, stages, True)
    return any(mod.smem_bytes(blocks, 128, dt, False, 4) <= 227 * 1024 for dt in (F8, jnp.bfloat16))


def test_aot_cases_cover_everything_the_support_checks_accept():
    """Every AOT case passes its support check on its target, and the cases span the accepted
    block sizes, stages, dtypes and head dims: each configuration ``auto`` can pick compiles."""
    from kernels_pallas.decode_attention import aot_cases, mgpu_swap
    from kernels_pallas.decode_attention import pallas_mosaic_gpu as da_mgpu

    seen = {"pallas_mosaic_gpu": set(), "pallas_tpu": set()}
    for case in aot_cases.cases():
        if case.impl == "xla":
            continue
        q, k, v, lengths, starts, ks, vs = case.args
        config = case.fn.keywords["config"]
        with _on(case.target):
            kw = dict(starts_B=starts, k_scale=ks, v_scale=vs, sm_scale=0.1)
            assert _reason(case.impl, (q, k, v, lengths), kw, config) is None, case.label
        mod = da_mgpu if case.impl == "pallas_mosaic_gpu" else da_tpu
        bl = mod.resolve_blocks(config, q, k)
        s = seen[case.impl]
        s |= {("blocks", bl.block_s, bl.num_stages if mod is da_mgpu else None)}
        s |= {("kv", k.dtype), ("q", q.dtype), ("c", k.shape[-1])}
        if mod is da_mgpu:  # both kernels, each at both block sizes, FP8 and 16-bit caches
            s |= {("swap", bl.swap_ab, bl.block_s, k.dtype.itemsize)}
            s |= {("group", mgpu_swap.swap_n(q.shape[1] // k.shape[2]))} if bl.swap_ab else set()
    for mod, impl in ((da_mgpu, "pallas_mosaic_gpu"), (da_tpu, "pallas_tpu")):
        stages = getattr(mod, "_STAGES", (None,))
        sizes = {*getattr(mod, "_BLOCK_S_FP8_SWAP", ()), *mod._BLOCK_S}
        want = {("blocks", b, st) for b in sizes for st in stages if _fits(mod, b, st)}
        want |= {("kv", d) for d in mod._KV_DTYPES} | {("q", d) for d in mod._Q_DTYPES}
        want |= {("c", c) for c in mod._HEAD_DIMS}
        if mod is da_mgpu:
            want |= {("swap", sw, b, 2) for sw in (True, False) for b in mod._BLOCK_S}
            want |= {("swap", sw, b, 1) for sw in (True, False) for b in mod._BLOCK_S_FP8}
            want |= {("swap", True, b, 1) for b in mod._BLOCK_S_FP8_SWAP}
            want |= {("group", mgpu_swap.MAX_N)}
        assert want <= seen[impl], want - seen[impl]
