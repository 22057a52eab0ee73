"""Decode attention autotuning: candidates, choice and cache with an injected timer (CPU, the
Hopper target as an abstract device: the support checks run, nothing is timed on a GPU)."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from kernels_pallas import attention_autotune as at
from kernels_pallas.decode_attention import DecodeBlocks
from kernels_pallas.decode_attention import pallas_mosaic_gpu as dense
from kernels_pallas.paged_attention.common import PagedBlocks

F8 = jnp.float8_e4m3fn
_H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


def _on_h100():
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=_H100))


def test_split_choices_and_blocks_around_the_default():
    assert at.split_choices(4, 64) == [4, 2, 8, 16]
    assert at.split_choices(1, 64) == [1, 2, 4]  # half of 1 is 1: no duplicate
    assert at.split_choices(8, 12) == [8, 4, 12]  # clipped to the tiles a row has
    d = DecodeBlocks(block_s=64, num_splits=2, num_stages=3, swap_ab=True)
    got = [at.name(c) for c in at.blocks(d, 64, (2, 3))]
    assert got == ["J=2/st3/swap", "J=1/st3/swap", "J=4/st3/swap", "J=8/st3/swap",
                   "J=2/st2/swap", "J=2/st3/unswapped"]  # fmt: skip
    wide = [at.name(c) for c in at.blocks(d, 64, (2, 3), (128,))]
    assert wide == [*got, "J=2/st3/swap/bs128"]  # the default's twin at 128 slots, last
    assert at.blocks(d, 64, (2, 3), (128,))[-1] == DecodeBlocks(128, 2, 3, True)
    p = PagedBlocks(num_splits=1, num_stages=2, swap_ab=True)
    assert [at.name(c) for c in at.blocks(p, 8, (2, 3))] == [
        "J=1/st2/swap",
        "J=2/st2/swap",
        "J=4/st2/swap",
        "J=1/st3/swap",
        "J=1/st2/unswapped",
    ]


def test_off_by_default_in_interpret_mode_and_without_a_gpu(monkeypatch):
    monkeypatch.delenv("FP8RL_AUTOTUNE", raising=False)
    assert not at.enabled_for("auto", None, False)
    monkeypatch.setenv("FP8RL_AUTOTUNE", "1")
    assert not at.enabled_for("auto", None, True)  # interpret mode
    assert not at.enabled_for("auto", DecodeBlocks(num_splits=2), False)  # a config given
    assert not at.enabled_for("xla", None, False)
    with _on_h100():  # a deviceless compile for an H100: nothing to time on
        assert not at.enabled_for("auto", None, False)


def test_dense_config_times_the_legal_candidates_once_and_caches_the_fastest(cache):
    """Qwen3-8B widths, B = 32, 8K slots, an FP8 cache with per-head scales: the default
    (chunks for one wave of 2 x 132 CTAs: 1; a 5-stage ring) and the candidates around it, all
    legal on H100 (the shallower rings, the unswapped kernel at its own 3-stage default and the
    128-slot FP8 tile too: a query group of 4 is wgmma N = 8); the injected timer makes 2 chunks
    fastest; a second call reads the cache."""
    run_file, inject = cache
    calls = inject({"J=2/st5/swap": 0.5})
    q = jax.ShapeDtypeStruct((32, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((32, 8192, 8, 128), F8)
    kw = dict(k_scale=jnp.ones((8,)), v_scale=jnp.ones((8,)), sm_scale=0.088, quant_out=F8)

    def run(*a, **k):
        raise AssertionError("the injected timer runs nothing")

    with _on_h100():
        assert dense.resolve_blocks(None, q, k).num_splits == 1
        got = at.dense_config(q, k, k, **kw, run=run)
        assert calls == ["J=1/st5/swap", "J=2/st5/swap", "J=4/st5/swap", "J=1/st2/swap",
                         "J=1/st3/swap", "J=1/st4/swap", "J=1/st3/unswapped",
                         "J=1/st5/swap/bs128"]  # fmt: skip
        assert got == DecodeBlocks(block_s=64, num_splits=2, num_stages=5, swap_ab=True)
        assert at.dense_config(q, k, k, **kw, run=run) == got
    assert len(calls) == 8  # the second call read the cache
    rec = next(iter(json.loads(run_file.read_text()).values()))
    assert rec["choice"] == "J=2/st5/swap" and len(rec["times_s"]) == 8
    assert rec["candidates"] == calls[:8]  # in order, the default first


def test_dense_wide_fp8_tile_only_for_narrow_query_groups(cache):
    """128-slot FP8 tiles take wgmma N <= 16 (K's upcast tile is 64 registers): a group of 32
    queries per KV head (N = 32) gets no 128-slot candidate; the timer can pick the wide tile
    where it is offered."""
    calls = cache[1]({"J=1/st5/swap/bs128": 0.1})
    k = jax.ShapeDtypeStruct((32, 8192, 8, 128), F8)
    kw = dict(k_scale=jnp.ones((8,)), v_scale=jnp.ones((8,)), sm_scale=0.088, quant_out=None)
    with _on_h100():
        assert dense.block_sizes(F8, True, 32) == (64,)
        q32 = jax.ShapeDtypeStruct((32, 256, 128), jnp.bfloat16)
        at.dense_config(q32, k, k, **kw, run=None)
        assert calls and not any(c.endswith("bs128") for c in calls)
        calls.clear()
        q16 = jax.ShapeDtypeStruct((32, 128, 128), jnp.bfloat16)  # N = 16: the widest at 128
        got = at.dense_config(q16, k, k, **kw, run=None)
    assert calls[-1] == "J=1/st5/swap/bs128"
    assert got == DecodeBlocks(block_s=128, num_splits=1, num_stages=5, swap_ab=True)


def test_paged_config_keys_by_pool_and_table(cache):
    calls = cache[1]({"J=1/st5/swap": 0.1})
    q = jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((4096, 64, 8, 128), F8)
    kw = dict(k_scale=jnp.ones((8,)), v_scale=jnp.ones((8,)), sm_scale=0.088, quant_out=None)
    with _on_h100():
        small = at.paged_config(q, pages, pages, jnp.zeros((64, 64), jnp.int32), **kw, run=None)
        assert small == PagedBlocks(num_splits=1, num_stages=5, swap_ab=True)
        n = len(calls)
        at.paged_config(q, pages, pages, jnp.zeros((64, 128), jnp.int32), **kw, run=None)
    assert len(calls) == 2 * n  # a wider table is another shape: tuned again


def test_no_candidate_runs_leaves_the_default(cache):
    cache[1](RuntimeError("no GPU"))
    q = jax.ShapeDtypeStruct((8, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((8, 1024, 8, 128), jnp.bfloat16)
    kw = dict(k_scale=None, v_scale=None, sm_scale=0.088, quant_out=None)
    with _on_h100():
        assert at.dense_config(q, k, k, **kw, run=None) is None


@pytest.mark.parametrize("op", at.OPS)
def test_the_ops_ask_for_a_tuned_config_only_when_enabled(monkeypatch, op):
    """``impl="auto"`` without a config asks ``attention_autotune`` when ``enabled_for`` says
    so (on CPU the XLA path then runs: the config does not change the result)."""
    import numpy as np

    from kernels_pallas.decode_attention import decode_attention
    from kernels_pallas.paged_attention import paged_attention

    asked = []
    monkeypatch.setattr(at, "dense_config", lambda *a, **k: asked.append("dense"))
    monkeypatch.setattr(at, "paged_config", lambda *a, **k: asked.append("paged"))
    q = jax.random.normal(jax.random.key(0), (2, 4, 64), jnp.bfloat16)
    kv = jax.random.normal(jax.random.key(1), (2, 128, 2, 64), jnp.bfloat16)
    lengths = jnp.array([100, 128], jnp.int32)
    table = jnp.arange(4, dtype=jnp.int32).reshape(2, 2)
    call = (lambda: decode_attention(q, kv, kv, lengths, sm_scale=0.125)) if op == at.OPS[0] \
        else (lambda: paged_attention(q, kv, kv, lengths, table, sm_scale=0.125))  # fmt: skip
    want = np.asarray(call())
    assert asked == []  # off by default
    monkeypatch.setattr(at, "enabled_for", lambda *a: True)
    np.testing.assert_array_equal(np.asarray(call()), want)
    assert asked == ["dense" if op == at.OPS[0] else "paged"]


_V6E = AbstractDevice(device_kind="TPU v6 lite", platform="tpu", num_cores=1)


def _on_v6e():
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=_V6E))


def test_tpu_tilings_dense_and_paged(cache):
    """On a TPU the TPU kernels' tilings: the dense kernel's default (512-slot tiles, one chunk)
    first, then each tile of 128 / 256 / 512 slots dividing S with one and two chunks; the
    paged kernel's 1, 2 and 4 chunks. Recorded under the TPU kernel's impl."""
    run_file, inject = cache
    calls = inject({"tpu:J=1/bs256": 0.5, "tpu:J=2": 0.5})
    q = jax.ShapeDtypeStruct((32, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((32, 8192, 8, 128), F8)
    kw = dict(k_scale=jnp.ones((8,)), v_scale=jnp.ones((8,)), sm_scale=0.088, quant_out=None)
    with _on_v6e():
        got = at.dense_config(q, k, k, **kw, run=None)
        assert calls == ["tpu:J=1/bs512", "tpu:J=1/bs128", "tpu:J=2/bs128", "tpu:J=1/bs256",
                         "tpu:J=2/bs256", "tpu:J=2/bs512"]  # fmt: skip
        assert got == DecodeBlocks(block_s=256, num_splits=1)
        calls.clear()
        pages = jax.ShapeDtypeStruct((4096, 64, 8, 128), F8)
        table = jnp.zeros((64, 64), jnp.int32)
        q64 = jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16)
        assert at.paged_config(q64, pages, pages, table, **kw, run=None) == PagedBlocks(2)
    assert calls == ["tpu:J=1", "tpu:J=2", "tpu:J=4"]
    assert {r["impl"] for r in json.loads(run_file.read_text()).values()} == {"pallas_tpu"}


def test_every_tpu_dense_tiling_computes_the_same_attention():
    """Each tiling the TPU tuner times gives the reference's output in interpret mode (chunks
    change the order of the softmax's sums: agreement to f32 rounding)."""
    import numpy as np

    from kernels_pallas.decode_attention import decode_attention, decode_attention_reference

    keys = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(keys[0], (2, 8, 128), jnp.float32)
    k, v = (jax.random.normal(kk, (2, 1024, 2, 128), jnp.float32) for kk in keys[1:])
    lengths = jnp.array([700, 1024], jnp.int32)
    kw = dict(k_scale=None, v_scale=None, sm_scale=128**-0.5, quant_out=None)
    with _on_v6e():
        cands = at._tpu_dense_candidates(q, k, v, lengths, kw)  # noqa: SLF001
    assert len(cands) == 6
    want = np.asarray(decode_attention_reference(q, k, v, lengths, sm_scale=kw["sm_scale"]))
    for cfg in cands:
        got = decode_attention(q, k, v, lengths, sm_scale=kw["sm_scale"], impl="pallas_tpu",
                               config=cfg, interpret=True)  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=str(cfg))


def test_enabled_for_names_the_platform(monkeypatch):
    """``platform`` narrows it to one device kind; this CPU is neither a GPU nor a TPU."""
    monkeypatch.setenv("FP8RL_AUTOTUNE", "1")
    for platform in (None, "gpu", "tpu", "cpu"):
        assert not at.enabled_for("auto", None, False, platform)


def test_paged_tuning_times_a_bounded_pool(cache, monkeypatch):
    """The paged tuner times on a pool of at most ``TIMING_POOL_BYTES`` (rows' tables wrap
    around it), not a copy of the engine's pool, which fills most of the memory left; the
    record keeps the call's own pool shape. Per-vector scales [X, K, Y] follow the pool (the
    TPU kernel takes them; the Mosaic GPU one does not yet)."""
    run_file, inject = cache
    seen = []

    def timer(c):
        c.run()
        return 1.0

    def run(q_, k_, v_, lengths, table, *, k_scale, **kw):
        seen.append((k_.shape, int(table.max()), jnp.shape(k_scale)))
        return q_

    monkeypatch.setattr(at.autotune, "device_timer", timer)
    monkeypatch.setattr(at, "TIMING_POOL_BYTES", 8 * 64 * 2 * 128)  # 8 pages: 64 x 2 x 128 FP8
    q = jax.ShapeDtypeStruct((4, 4, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((100_000, 64, 2, 128), F8)
    table = jnp.zeros((4, 6), jnp.int32)
    with _on_h100():
        at.paged_config(q, pool, pool, table, k_scale=jnp.ones((2,)), v_scale=jnp.ones((2,)),
                        sm_scale=0.088, quant_out=None, run=run)  # fmt: skip
    assert seen and all(s == ((8, 64, 2, 128), 7, (2,)) for s in seen)
    assert ",100000,64,2,128," in next(iter(json.loads(run_file.read_text())))
    seen.clear()
    scale = jax.ShapeDtypeStruct((100_000, 2, 64), jnp.float32)
    with _on_v6e():
        at.paged_config(q, pool, pool, table, k_scale=scale, v_scale=scale, sm_scale=0.088,
                        quant_out=None, run=run)  # fmt: skip
    assert seen and all(s == ((8, 64, 2, 128), 7, (8, 2, 64)) for s in seen)
