"""Paged decode attention: the reference against a float64 numpy oracle over a shuffled page
pool (BF16/F32, FP8 static and dynamic scales), the XLA window ladder against the reference, and
every Pallas kernel against the reference from one shared table (``KERNEL_CASES``)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import (
    PagedBlocks,
    paged_attention,
    paged_attention_reference,
    window_ladder,
)

F8 = jnp.float8_e4m3fn
X, Y, K, C, H, W = 13, 4, 2, 16, 4, 5  # pool pages, page size, KV heads, head dim, q heads, table


def _case(seed, lengths, dtype=jnp.float32, scales="none"):
    """A shuffled pool: row b's pages are distinct random pages; entries past them are junk."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    perm = rng.permutation(X)
    table = np.stack([np.roll(perm, 3 * i)[:W] for i in range(b)]).astype(np.int32)
    q = rng.standard_normal((b, H, C)).astype(np.float32)
    k = rng.standard_normal((X, Y, K, C)).astype(np.float32)
    v = rng.standard_normal((X, Y, K, C)).astype(np.float32)
    ks = vs = None
    if scales == "static":
        ks, vs = (rng.uniform(0.5, 2.0, (K,)).astype(np.float32) for _ in range(2))
    elif scales == "dynamic":
        ks, vs = (rng.uniform(0.5, 2.0, (X, K, Y)).astype(np.float32) for _ in range(2))
    kq, vq = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    return dict(
        q=jnp.asarray(q), k=kq, v=vq, lengths=jnp.asarray(lengths, jnp.int32),
        table=jnp.asarray(table), ks=None if ks is None else jnp.asarray(ks),
        vs=None if vs is None else jnp.asarray(vs),
    )  # fmt: skip


def _oracle(c):
    """float64: gather row b's first ``len_b`` slots page by page, dequantize, softmax."""
    q = np.asarray(c["q"], np.float64)
    k = np.asarray(c["k"].astype(jnp.float32), np.float64)
    v = np.asarray(c["v"].astype(jnp.float32), np.float64)
    out = np.zeros(q.shape)
    for b, n in enumerate(np.asarray(c["lengths"])):
        for h in range(H):
            kk = K * h // H
            ks_, vs_ = [], []
            for s in range(n):
                page, off = int(c["table"][b, s // Y]), s % Y
                sk = sv = 1.0
                if c["ks"] is not None:
                    sk = float(c["ks"][kk] if c["ks"].ndim == 1 else c["ks"][page, kk, off])
                    sv = float(c["vs"][kk] if c["vs"].ndim == 1 else c["vs"][page, kk, off])
                ks_.append(k[page, off, kk] * sk)
                vs_.append(v[page, off, kk] * sv)
            if n:
                logits = np.stack(ks_) @ q[b, h] / np.sqrt(C)
                p = np.exp(logits - logits.max())
                out[b, h] = (p / p.sum()) @ np.stack(vs_)
    return out


def _run(c, fn=paged_attention_reference, **kw):
    return fn(c["q"], c["k"], c["v"], c["lengths"], c["table"], k_scale=c["ks"],
              v_scale=c["vs"], sm_scale=1.0 / np.sqrt(C), **kw)  # fmt: skip


LENGTHS = [0, 1, 4, 7, 20]  # empty row, one slot, a full page, a partial page, the whole table


@pytest.mark.parametrize(
    "dtype,scales,tol",
    [(jnp.float32, "none", 1e-5), (jnp.bfloat16, "none", 1e-5), (F8, "static", 1e-5),
     (F8, "dynamic", 1e-5)],
)  # fmt: skip
def test_reference_matches_float64_oracle(dtype, scales, tol):
    c = _case(0, LENGTHS, dtype, scales)
    np.testing.assert_allclose(_run(c), _oracle(c), atol=tol, rtol=tol)
    assert not np.asarray(_run(c)[0]).any()  # a row of length 0 gives zeros


def test_window_ladder_covers_every_row_within_twice_its_pages():
    assert window_ladder(1) == (1,)
    assert window_ladder(5) == (1, 2, 3, 5)
    for w in range(1, 40):
        ladder = window_ladder(w)
        assert ladder[-1] == w and list(ladder) == sorted(set(ladder))
        for need in range(1, w + 1):
            assert min(x for x in ladder if x >= need) < 2 * need or need == w


@pytest.mark.parametrize("lengths", [[1, 3, 2, 0, 4], [5, 8, 1, 0, 2], LENGTHS])
@pytest.mark.parametrize("scales", ["none", "dynamic"])
def test_xla_window_equals_reference(lengths, scales):
    """Every ladder branch (longest row: 1, 2 and 5 pages) gives the reference's output."""
    c = _case(1, lengths, F8 if scales == "dynamic" else jnp.float32, scales)
    want = _run(c)
    got = jax.jit(lambda c: _run(c, paged_attention, impl="xla"))(c)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    fixed = _run(c, paged_attention, impl="xla", config=PagedBlocks(window_pages=W))
    np.testing.assert_allclose(fixed, want, atol=1e-6, rtol=1e-6)


def test_bad_operands_raise_naming_the_operand():
    c = _case(2, [1, 2])
    with pytest.raises(ValueError, match="lengths_B"):
        paged_attention(c["q"], c["k"], c["v"], c["lengths"][:1], c["table"], sm_scale=1.0)
    with pytest.raises(ValueError, match="page_table_BW"):
        paged_attention(c["q"], c["k"], c["v"], c["lengths"], c["table"][:1], sm_scale=1.0)
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(c["q"], c["k"], c["v"], c["lengths"], c["table"],
                        k_scale=jnp.ones((3,)), v_scale=jnp.ones((3,)), sm_scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="unknown impl"):
        paged_attention(c["q"], c["k"], c["v"], c["lengths"], c["table"], sm_scale=1.0,
                        impl="nope")  # fmt: skip


# ------------------------------------------------------------------ the Pallas kernels' operands


def _tpu_case(seed, lengths, dtype, scales, y=128, c=128, n_kv=1):
    """Pool of 7 pages of 128 slots, table of 3 entries per row, ``n_kv`` KV heads of 2 queries."""
    rng = np.random.default_rng(seed)
    b, x, w, h = len(lengths), 7, 3, 2 * n_kv
    table = np.stack([rng.permutation(x)[:w] for _ in range(b)]).astype(np.int32)
    mk = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    ks = vs = None
    if scales == "static":
        ks, vs = (jnp.asarray(rng.uniform(0.5, 2.0, (n_kv,)), jnp.float32) for _ in range(2))
    elif scales == "dynamic":
        ks, vs = (jnp.asarray(rng.uniform(0.5, 2.0, (x, n_kv, y)), jnp.float32) for _ in "kv")
    return dict(
        q=jnp.asarray(mk(b, h, c)), k=jnp.asarray(mk(x, y, n_kv, c), dtype),
        v=jnp.asarray(mk(x, y, n_kv, c), dtype), lengths=jnp.asarray(lengths, jnp.int32),
        table=jnp.asarray(table), ks=ks, vs=vs,
    )  # fmt: skip


# ------------------------------------------------------------ every kernel against the reference

_H100 = "NVIDIA H100 80GB HBM3"


def _kernel_case(impl, seed, dtype, scales, y=64):
    """Each kernel's block layout: TPU pages of 128 slots, head dim 128, 2 KV heads (one unit of
    two side by side: ``decode_attention.pallas_tpu.head_pairs``) of 2 queries, rows of 0, 1,
    129 (two pages), 384 (all) slots; Mosaic GPU pages of ``y`` slots (64 unless asked), head
    dim 64, 4 queries per KV head, rows of 0, 1, y + 1, 3y (all) slots."""
    if impl == "pallas_tpu":
        return _tpu_case(seed, [0, 1, 129, 384], dtype, scales, n_kv=2)
    c = _tpu_case(seed, [0, 1, y + 1, 3 * y], dtype, scales, y=y, c=64)
    c["q"] = jnp.concatenate([c["q"]] * 2, axis=1)[:, :4]  # 4 query heads over 1 KV head
    return c


def _on_target(impl):
    """Mosaic GPU kernels lower for an (abstract) H100; the TPU interpreter needs no device."""
    from jax.sharding import AbstractDevice, AbstractMesh

    if impl != "pallas_mosaic_gpu":
        return contextlib.nullcontext()
    dev = AbstractDevice(device_kind=_H100, platform="gpu", num_cores=132)
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev))


# (impl, dtype, scales, splits, tol), interpret mode (semantics only). TPU: bf16 MXU inputs (q
# rounded to bf16) for non-F32 pages, tolerance 2e-2, f32 pages 1e-5. Mosaic GPU: Q and P enter
# bf16 (BF16 pages) or f16 (FP8 pages) MMAs: measured max error 4.5e-3 / 1.3e-3 (max|o| ~3.5);
# tolerance 1e-2 / 5e-3, a few units of roundoff x max|V|.
KERNEL_CASES = [
    ("pallas_tpu", jnp.float32, "none", 1, 1e-5),
    ("pallas_tpu", jnp.bfloat16, "none", 2, 2e-2),
    ("pallas_tpu", F8, "static", 1, 2e-2),
    ("pallas_tpu", F8, "dynamic", 3, 2e-2),
    ("pallas_mosaic_gpu", jnp.bfloat16, "none", 1, 1e-2),
    ("pallas_mosaic_gpu", F8, "static", 2, 5e-3),
]
# the Hopper kernel's unswapped form (the query group padded to a 64-row M tile)
UNSWAPPED = [(jnp.bfloat16, "none", 2, 1e-2), (F8, "static", 1, 5e-3)]


@pytest.mark.parametrize("impl,dtype,scales,splits,tol", KERNEL_CASES)
def test_kernel_interpret_matches_reference(impl, dtype, scales, splits, tol):
    _check_kernel(impl, dtype, scales, PagedBlocks(num_splits=splits), tol)


@pytest.mark.parametrize("dtype,scales,splits,tol", UNSWAPPED)
def test_mosaic_gpu_unswapped_interpret_matches_reference(dtype, scales, splits, tol):
    _check_kernel("pallas_mosaic_gpu", dtype, scales, PagedBlocks(splits, swap_ab=False), tol)


@pytest.mark.parametrize("stages", [4, 5])
def test_mosaic_gpu_deep_rings_match_reference(stages):
    """FP8 pages through 4- and 5-stage rings (the autotuner's deeper candidates), 2 chunks."""
    _check_kernel("pallas_mosaic_gpu", F8, "static", PagedBlocks(2, stages), 5e-3)


@pytest.mark.parametrize("dtype,scales,splits,tol", [(F8, "static", 2, 5e-3)])
def test_mosaic_gpu_pages_of_128_slots_match_reference(dtype, scales, splits, tol):
    """FP8 pages of 128 slots: one page per tile of the swap-AB kernel (a query group of 4)."""
    _check_kernel("pallas_mosaic_gpu", dtype, scales, PagedBlocks(splits), tol, y=128)


def test_mosaic_gpu_support_check_page_sizes():
    """128-slot FP8 pages need the swap-AB kernel and a query group of at most 16; 16-bit pages
    take 64 or 128 with either kernel; other sizes are refused with the allowed ones named."""
    from kernels_pallas.paged_attention import pallas_mosaic_gpu as mgpu

    def reason(dtype, y, group, config=None):
        q = jax.ShapeDtypeStruct((2, 2 * group, 128), jnp.bfloat16)
        pages = jax.ShapeDtypeStruct((16, y, 2, 128), dtype)
        ks = jnp.ones((2,)) if dtype == F8 else None
        with _on_target("pallas_mosaic_gpu"):
            return mgpu.supports(q, pages, pages, None, None, k_scale=ks, v_scale=ks,
                                 sm_scale=0.1, config=config, interpret=True)  # fmt: skip

    assert reason(F8, 128, 4) is None and reason(F8, 128, 16) is None
    assert "(64,)" in reason(F8, 128, 32)  # wgmma N = 32: K's upcast tile does not fit
    assert "unswapped" in reason(F8, 128, 4, PagedBlocks(swap_ab=False))
    assert reason(jnp.bfloat16, 128, 4, PagedBlocks(swap_ab=False)) is None
    assert "page_size 32" in reason(jnp.bfloat16, 32, 4)


def _check_kernel(impl, dtype, scales, config, tol, y=64):
    c = _kernel_case(impl, 3 if impl == "pallas_tpu" else 5, dtype, scales, y)
    want = _run(c)
    with _on_target(impl):
        got = _run(c, paged_attention, impl=impl, interpret=True, config=config)
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- Mosaic TPU kernel


def test_tpu_kernel_refuses_a_page_size_that_is_not_a_block():
    c = _tpu_case(4, [1, 2], jnp.float32, "none", y=4)  # pages of 4 slots
    with pytest.raises(ValueError, match="page_size 4 is not a kernel block size"):
        paged_attention(c["q"], c["k"], c["v"], c["lengths"], c["table"], sm_scale=1.0,
                        impl="pallas_tpu", interpret=True)  # fmt: skip


# ----------------------------------------------------------------------------- Mosaic GPU kernel


@pytest.mark.parametrize("k_scale", [3e5, 1e-7])
def test_mosaic_gpu_static_k_scale_outside_f16_range(k_scale):
    """The static K scale goes into the f32 softmax scale, not into q before its f16 cast (which
    overflows at 3e5 · |q| > 65,504 and flushes 1e-7 · |q| to subnormals)."""
    c = _kernel_case("pallas_mosaic_gpu", 6, F8, "static")
    c["ks"] = jnp.full((1,), k_scale, jnp.float32)
    args = (c["q"], c["k"], c["v"], c["lengths"], c["table"])
    kw = dict(k_scale=c["ks"], v_scale=c["vs"], sm_scale=64**-0.5 / k_scale)
    want = paged_attention_reference(*args, **kw)
    with _on_target("pallas_mosaic_gpu"):
        got = paged_attention(*args, **kw, impl="pallas_mosaic_gpu", interpret=True)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(got, want, atol=5e-3, rtol=5e-3)


def test_mosaic_gpu_default_splits_fill_a_wave():
    """Unset num_splits: chunks fill 2 x 132 CTAs over B x K, >= 4 pages each (hand values)."""
    from kernels_pallas.paged_attention import pallas_mosaic_gpu as mgpu

    assert mgpu.default_splits(1, 512, 8) == 33  # 264 // 8
    assert mgpu.default_splits(8, 512, 8) == 4
    assert mgpu.default_splits(32, 512, 8) == 1
    assert mgpu.default_splits(1, 8, 8) == 2  # 8 pages: at least 4 per chunk


@pytest.mark.parametrize("dtype,stages", [(F8, 5), (jnp.bfloat16, 2)])
def test_mosaic_gpu_default_stages_are_the_dense_kernels(monkeypatch, dtype, stages):
    """Unset num_stages: the dense kernel's rule (5 pages in flight on an FP8 pool, ~101 KB of
    SMEM, two CTAs per SM; 2 on a 16-bit one), in the support check, the run and the
    autotuner's default candidate."""
    from kernels_pallas import attention_autotune
    from kernels_pallas.paged_attention import pallas_mosaic_gpu as mgpu

    seen = {}
    monkeypatch.setattr(mgpu, "paged_attention_mgpu", lambda *a, **kw: seen.update(kw))
    c = _case(0, [6, 9], dtype, "static" if dtype == F8 else "none")
    mgpu.run(c["q"], c["k"], c["v"], c["lengths"], c["table"], config=None, interpret=True,
             k_scale=c["ks"], v_scale=c["vs"], sm_scale=0.25)  # fmt: skip
    assert seen["stages"] == stages
    tuned = {}
    monkeypatch.setattr(attention_autotune, "tuned",
                        lambda op, shape, cands, run_with, **kw: tuned.update(c=cands))  # fmt: skip
    monkeypatch.setattr(mgpu, "supports", lambda *a, **kw: None)
    attention_autotune.paged_config(c["q"], c["k"], c["v"], c["table"], k_scale=c["ks"],
                                    v_scale=c["vs"], sm_scale=0.25, quant_out=None,
                                    run=None)  # fmt: skip
    assert tuned["c"][0].num_stages == stages
