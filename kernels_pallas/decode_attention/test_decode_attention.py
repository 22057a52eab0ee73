"""Decode attention: the reference against float64 numpy and hand-computed values, the live-range
bookkeeping, the kernels against the reference (one shared grid, run per implementation); the
support checks are in ``test_support.py``."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from kernels_pallas.decode_attention import (
    DecodeBlocks,
    decode_attention,
    decode_attention_reference,
    dequantize_kv,
    live_mask,
    mgpu_swap,
)
from kernels_pallas.decode_attention import pallas_tpu as da_tpu
from kernels_pallas.decode_attention.common import combine_splits, split_ranges

F8 = jnp.float8_e4m3fn


def _np_attention(q, k, v, live, ks, vs, sm_scale):
    """float64 numpy oracle; ks/vs are None, [], [K] or [B, K, S]; ``live`` [B, S] bool."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, h, c = q.shape
    g = h // k.shape[2]
    for name, sc in (("k", ks), ("v", vs)):
        if sc is not None:
            sc = np.asarray(sc, np.float64)
            mult = np.swapaxes(sc, 1, 2)[..., None] if sc.ndim == 3 else sc[..., None]
            k, v = (k * mult, v) if name == "k" else (k, v * mult)
    out = np.zeros((b, h, c))
    for bi in range(b):
        idx = np.nonzero(np.asarray(live[bi]))[0]
        for hi in range(h):
            if len(idx):
                logits = k[bi, idx, hi // g] @ q[bi, hi] * sm_scale
                p = np.exp(logits - logits.max())
                out[bi, hi] = (p / p.sum()) @ v[bi, idx, hi // g]
    return out


# ----------------------------------------------------------------------------- the reference


def test_reference_hand_case():
    # One head, live slots 1 and 2 of [0, 4) with logits 0 and log 3: weights 1/4, 3/4.
    q = jnp.array([[[1.0, 0.0]]])
    k = jnp.array([[[[7.0, 7.0]], [[0.0, 5.0]], [[np.log(3.0), 0.0]], [[9.0, 9.0]]]])
    v = jnp.array([[[[50.0, 50.0]], [[4.0, 0.0]], [[0.0, 8.0]], [[100.0, 100.0]]]])
    lengths, starts = jnp.array([3]), jnp.array([1])
    out = decode_attention_reference(q, k, v, lengths, starts_B=starts, sm_scale=1.0)
    np.testing.assert_allclose(out, [[[1.0, 6.0]]], rtol=1e-6)
    # FP8 with static scales: K̂ = 0.75 (exact in E4M3) times 2 gives logit 1.5; V̂ · 0.5 = v.
    k8 = k.at[0, 2, 0, 0].set(0.75).astype(F8)
    out = decode_attention_reference(
        q, k8, (v * 2).astype(F8), lengths, starts_B=starts, k_scale=jnp.array([2.0]),
        v_scale=jnp.array(0.5), sm_scale=1.0,
    )  # fmt: skip
    w = np.exp(1.5) / (1 + np.exp(1.5))
    np.testing.assert_allclose(out[0, 0], [4.0 * (1 - w), 8.0 * w], rtol=1e-6)


def test_reference_empty_rows_are_zero():
    q = jnp.ones((2, 2, 4))
    k = v = jnp.ones((2, 3, 1, 4))
    out = decode_attention_reference(
        q, k, v, jnp.array([0, 2]), starts_B=jnp.array([0, 2]), sm_scale=0.5
    )
    np.testing.assert_array_equal(out, 0.0)


def _live(rows, s):
    return np.array([[a <= i < e for i in range(s)] for a, e in rows])


@pytest.mark.parametrize("kv_mode", ["f32", "tensor", "head", "dynamic"])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_vs_numpy(kv_mode, group):
    rows = [(0, 9), (2, 7), (4, 5), (3, 3)]  # full, ragged with start > 0, one slot, empty
    q, k, v, ks, vs = _operands(0, len(rows), 9, 2, group, 8, kv_mode)
    lengths, starts = (jnp.array([r[i] for r in rows]) for i in (1, 0))
    out = decode_attention_reference(
        q, k, v, lengths, starts_B=starts, k_scale=ks, v_scale=vs, sm_scale=0.3
    )
    expect = _np_attention(q, k, v, _live(rows, 9), ks, vs, 0.3)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)  # f32 vs f64 math


def test_dequantize_kv_layouts():
    x = jnp.arange(2 * 3 * 2 * 1, dtype=jnp.float32).reshape(2, 3, 2, 1)
    np.testing.assert_array_equal(dequantize_kv(x, None), x)
    np.testing.assert_array_equal(dequantize_kv(x, jnp.array(2.0)), 2 * x)
    np.testing.assert_array_equal(dequantize_kv(x, jnp.array([1.0, 10.0]))[0, 0, :, 0], [0, 10])
    s_BKS = jnp.arange(12, dtype=jnp.float32).reshape(2, 2, 3)  # [B, K, S]
    got = dequantize_kv(x, s_BKS)
    assert got[1, 2, 0, 0] == x[1, 2, 0, 0] * s_BKS[1, 0, 2]
    with pytest.raises(ValueError, match="B, K, S"):
        dequantize_kv(x, jnp.ones((2, 3, 2)))


# ------------------------------------------------------------------- live ranges and splitting


def test_live_mask_hand_case():
    got = live_mask(jnp.array([1, 0, 2]), jnp.array([3, 0, 3]), 4)
    np.testing.assert_array_equal(got, [[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]])


def test_split_ranges_hand_case():
    # block 4, 6 tiles; row 0 slots [5, 21) = tiles 1..5, 3 chunks of cdiv(5, 3) = 2 tiles.
    lo, cnt = split_ranges(jnp.array([5, 0, 9]), jnp.array([21, 0, 10]), block_s=4,
                           num_splits=3, num_tiles=6)  # fmt: skip
    np.testing.assert_array_equal(cnt, [[2, 2, 1], [0, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(lo[0], [1, 3, 5])
    assert lo[2, 0] == 2 and (lo[2, 1:] == 2).all()  # empty chunks name the last live tile


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_split_ranges_cover_exactly_the_live_tiles(splits):
    r = np.random.default_rng(splits)
    bs, tiles = 8, 6
    lengths = r.integers(0, bs * tiles + 1, 50)
    starts = np.minimum(r.integers(0, bs * tiles, 50), lengths)
    lo, cnt = split_ranges(
        jnp.asarray(starts), jnp.asarray(lengths), block_s=bs, num_splits=splits, num_tiles=tiles
    )
    lo, cnt = np.asarray(lo), np.asarray(cnt)
    for b in range(50):
        covered = [t for j in range(splits) for t in range(lo[b, j], lo[b, j] + cnt[b, j])]
        live = [t for t in range(tiles) if any(starts[b] <= s < lengths[b]
                                               for s in range(t * bs, (t + 1) * bs))]  # fmt: skip
        assert covered == live, (b, starts[b], lengths[b])
        assert (lo[b] >= 0).all() and (lo[b] < tiles).all()


def test_combine_splits_equals_one_softmax():
    # Two chunks with scores (log2 units) [1, 3] and [2], values 10, 20, 30.
    s, vals = np.array([1.0, 3.0, 2.0]), np.array([10.0, 20.0, 30.0])
    w = 2.0**s / (2.0**s).sum()
    o1 = (2.0 ** s[:2] @ vals[:2]) / (2.0 ** s[:2]).sum()
    lse = np.array([np.log2((2.0 ** s[:2]).sum()), 2.0, -np.inf])  # third chunk empty
    o = np.array([o1, 30.0, 0.0]).reshape(1, 3, 1, 1)
    got = combine_splits(
        jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32).reshape(1, 3, 1)
    )
    np.testing.assert_allclose(got[0, 0, 0], w @ vals, rtol=1e-6)


@pytest.mark.parametrize("splits", [1, 3])
def test_swapped_chunks_combine_like_the_unswapped_layout(splits):
    """``mgpu_swap.combine`` on the swap-AB kernel's transposed chunks Oᵀ [B, J, K, C, N] (and
    lse [B, J, K, N], padded columns N > group holding junk, an empty chunk at -inf) equals
    ``combine_splits`` on the same chunks as [B, J, H, C] (head h = k · group + g)."""
    b, k, c, n, group = 2, 2, 4, 8, 3
    r = np.random.default_rng(splits)
    o = r.normal(size=(b, splits, k, c, n)).astype(np.float32)
    lse = r.normal(size=(b, splits, k, n)).astype(np.float32)
    lse[0, -1, 1, :] = -np.inf  # row 0's last chunk of KV head 1 empty (its only one if J = 1)
    o[..., group:] = np.nan  # padding columns: never read
    lse[..., group:] = np.nan
    o_BJHC = np.swapaxes(o[..., :group], -1, -2).reshape(b, splits, k * group, c)
    lse_BJH = lse[..., :group].reshape(b, splits, k * group)
    want = combine_splits(jnp.asarray(o_BJHC), jnp.asarray(lse_BJH)) if splits > 1 else o_BJHC[:, 0]
    outs = [jnp.asarray(o), jnp.asarray(lse)] if splits > 1 else [jnp.asarray(o)]
    got = mgpu_swap.combine(outs, group)
    assert got.shape == (b, k * group, c)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_tpu_index_map_fetches_only_live_tiles():
    """Pallas TPU re-fetches a block only when its index changes between grid steps: replaying
    the K/V index map over the grid gives exactly the live tiles of each row, once each."""
    bs, tiles, splits = 128, 6, 2
    st = da_tpu._Static(bs=bs, n_kv=2, splits=splits, steps=3, mma_dtype=jnp.bfloat16,
                        dynamic=False, score_scale=1.0)  # fmt: skip
    _, k_spec, _ = da_tpu._specs(st, 2, 4, 128)[0]
    starts, lengths = jnp.array([0, 300, 0, 700]), jnp.array([768, 420, 0, 701])
    lo, cnt = split_ranges(starts, lengths, block_s=bs, num_splits=splits, num_tiles=tiles)
    pre = (starts, lengths, lo.reshape(-1), cnt.reshape(-1))
    fetched, prev = {b: [] for b in range(4)}, None
    for b in range(4):
        for j in range(splits):
            for t in range(st.steps):
                idx = tuple(int(x) for x in k_spec.index_map(b, j, t, *pre))
                if idx != prev:
                    fetched[b].append(idx[1])
                prev = idx
    assert fetched == {0: [0, 1, 2, 3, 4, 5], 1: [2, 3], 2: [0], 3: [5]}  # row 2 empty: 1 tile


# ------------------------------------------------------------ kernels vs reference (shared base)


def _operands(seed, b, s, n_kv, group, c, kv_mode):
    """q, k, v, k_scale, v_scale for a cache kind: f32 | bf16 | f16 (no scales), FP8 with a
    static scale per ``tensor`` [] or per ``head`` [K], or ``dynamic`` [B, K, S]."""
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(b, n_kv * group, c)), jnp.float32)
    k = jnp.asarray(r.normal(size=(b, s, n_kv, c)) * 2, jnp.float32)
    v = jnp.asarray(r.uniform(-1, 1, size=(b, s, n_kv, c)), jnp.float32)
    shape = {"tensor": (), "head": (n_kv,), "dynamic": (b, n_kv, s)}.get(kv_mode)
    ks = vs = None
    if shape is not None:
        ks, vs = (jnp.asarray(r.uniform(0.5, 2.0, shape), jnp.float32) for _ in range(2))
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}.get(kv_mode, F8)
    return q, k.astype(dtype), v.astype(dtype), ks, vs


# (cache kind, rows as (start, length) in units of block_s "T" plus slots, KV heads, group,
# splits). Rows: full; start > 0 inside a tile; one slot; empty; ragged across chunks.
CASES = {
    "bf16-g8": ("bf16", [(0, "2T"), (5, "T+9")], 1, 8, 1),
    "fp8-head-g4-split": ("head", [(3, "2T-1"), ("T+2", "T+3"), (7, 7)], 2, 4, 2),
    "fp8-tensor-g1": ("tensor", [("T-1", "2T"), (0, 1)], 2, 1, 1),
    "fp8-dynamic-g4-split3": ("dynamic", [(0, "2T"), (9, "T+40")], 1, 4, 3),
    "16bit-g2": (None, [(1, "2T-3")], 2, 2, 1),  # f16 (GPU) / f32 (TPU) caches
    # four KV heads: on TPU two units of two heads side by side, each query row scaled by its
    # own head's per-slot scales (pallas_tpu.head_pairs)
    "fp8-dynamic-kv4-g2": ("dynamic", [(0, "2T"), (9, "T+40")], 4, 2, 1),
}
# impl: (block_s, head_dim, the 16-bit cache kind, MMA unit roundoff by cache kind)
KERNELS = {
    "pallas_mosaic_gpu": (64, 64, "f16", {"bf16": 2**-8}),  # FP8 and F16 run f16 MMAs
    "pallas_tpu": (128, 128, "f32", {"f32": 0.0}),  # FP8 and BF16 run bf16 MMAs
}
RUNS = [
    pytest.param("pallas_mosaic_gpu", True, id="mgpu-interpret"),
    pytest.param("pallas_tpu", True, id="tpu-interpret"),
    pytest.param("pallas_mosaic_gpu", False, id="mgpu-device", marks=pytest.mark.gpu),
    pytest.param("pallas_tpu", False, id="tpu-device", marks=pytest.mark.tpu),
]


def _slot(x, bs: int) -> int:
    if isinstance(x, int):
        return x
    base, _, off = x.partition("T")
    return (int(base) if base else 1) * bs + (int(off) if off else 0)


@contextlib.contextmanager
def _target(impl: str, interpret: bool):
    """The GPU interpreter and the support check need an H100 as the (abstract) device."""
    if impl != "pallas_mosaic_gpu" or not interpret:
        yield
        return
    dev = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
        yield


def _poison(x, live_BS, bs):
    """``x`` [B, S, K, C] with NaN in the tiles of ``bs`` slots that hold no live slot and 64
    (exact in FP8) at the other dead slots."""
    b, s = live_BS.shape
    tile_live = jnp.repeat(live_BS.reshape(b, s // bs, bs).any(-1), bs, axis=1)
    x = jnp.where(tile_live[:, :, None, None], x, jnp.asarray(jnp.nan, x.dtype))
    return jnp.where((live_BS | ~tile_live)[:, :, None, None], x, jnp.asarray(64.0, x.dtype))


def _tolerance(impl, kv, v_deq) -> float:
    """Q and P enter the MMAs rounded to the MMA type (unit roundoff u): each rounding moves the
    softmax weights by a relative ~u (and the logits by ~u · Σ|q k| · sm_scale, here < 2), so o
    moves by a few u · max|V|; 6 u max|V| bounds it. F32 MMAs: f32 reordering only."""
    u = KERNELS[impl][3].get(kv, 2**-11 if impl == "pallas_mosaic_gpu" else 2**-8)
    return max(6 * u * float(jnp.max(jnp.abs(v_deq))), 2e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl,interpret", RUNS)
def test_kernel_matches_reference(impl, interpret, case):
    _check_case(impl, interpret, case)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "interpret",
    [pytest.param(True, id="interpret"), pytest.param(False, id="device", marks=pytest.mark.gpu)],
)
def test_mosaic_gpu_unswapped_kernel_matches_reference(interpret, case):
    """The Hopper kernel with the query group padded to a 64-row M tile (``swap_ab=False``)."""
    _check_case("pallas_mosaic_gpu", interpret, case, swap_ab=False)


@pytest.mark.parametrize("case", ["fp8-head-g4-split", "fp8-dynamic-g4-split3"])
@pytest.mark.parametrize(
    "interpret",
    [pytest.param(True, id="interpret"), pytest.param(False, id="device", marks=pytest.mark.gpu)],
)
def test_mosaic_gpu_wide_fp8_tiles_match_reference(interpret, case):
    """Swap-AB over 128-slot FP8 tiles (the attention autotuner's wide candidate): the same
    rows (ragged, split, dead tiles poisoned) in units of 128 slots."""
    _check_case("pallas_mosaic_gpu", interpret, case, block_s=128)


@pytest.mark.parametrize("stages", [4, 5])
def test_mosaic_gpu_deep_rings_match_reference(stages):
    """4- and 5-stage K/V rings (the autotuner's deeper candidates) over the ragged, split FP8
    rows: more tiles in flight than a chunk has at its shortest rows (1-2 tiles)."""
    _check_case("pallas_mosaic_gpu", True, "fp8-dynamic-g4-split3", stages=stages)


def _check_case(impl, interpret, case, swap_ab=None, block_s=None, stages=None):
    kv, rows, n_kv, group, splits = CASES[case]
    bs, c, kv16, _ = KERNELS[impl]
    bs = block_s or bs
    kv = kv or kv16
    scale_up = 1 if interpret else 16  # on a device: longer caches, same patterns, C = 128
    c = c if interpret else 128
    s = 2 * bs * scale_up
    rows = [(_slot(a, bs * scale_up), _slot(e, bs * scale_up)) for a, e in rows]
    q, k, v, ks, vs = _operands(hash(case) % 1000, len(rows), s, n_kv, group, c, kv)
    starts, lengths = (jnp.array([r[i] for r in rows], jnp.int32) for i in (0, 1))
    kw = dict(starts_B=starts, k_scale=ks, v_scale=vs, sm_scale=c**-0.5)
    expect = decode_attention_reference(q, k, v, lengths, **kw)
    # Dead slots hold large values inside live tiles and NaN in dead tiles: a kernel that reads
    # or weighs a slot outside [start, length) gives a wrong or NaN output.
    live = live_mask(starts, lengths, s)
    k_p, v_p = (_poison(x, live, bs) for x in (k, v))
    with _target(impl, interpret):
        out = decode_attention(
            q, k_p, v_p, lengths, **kw, impl=impl,
            config=DecodeBlocks(bs, splits, stages, swap_ab), interpret=interpret,
        )  # fmt: skip
    tol = _tolerance(impl, kv, dequantize_kv(v, vs))
    np.testing.assert_allclose(out, expect, rtol=0, atol=tol)


@pytest.mark.parametrize("k_scale", [3e5, 1e-7])
def test_mosaic_gpu_static_k_scale_outside_f16_range(k_scale):
    """A static K scale folded into q before its f16 cast would overflow (3e5 · |q| > 65,504:
    inf, NaN out) or flush q to f16 subnormals (1e-7 · |q|); folded into the f32 softmax scale
    the kernel matches the reference. sm_scale compensates so the logits stay O(1)."""
    q, k, v, _, vs = _operands(7, 1, 128, 2, 4, 64, "head")
    ks = jnp.full((2,), k_scale, jnp.float32)
    lengths = jnp.array([128], jnp.int32)
    kw = dict(starts_B=jnp.zeros((1,), jnp.int32), k_scale=ks, v_scale=vs,
              sm_scale=64**-0.5 / k_scale)  # fmt: skip
    expect = decode_attention_reference(q, k, v, lengths, **kw)
    with _target("pallas_mosaic_gpu", True):
        out = decode_attention(q, k, v, lengths, **kw, impl="pallas_mosaic_gpu",
                               config=DecodeBlocks(64, 1), interpret=True)  # fmt: skip
    assert np.all(np.isfinite(np.asarray(out)))
    tol = _tolerance("pallas_mosaic_gpu", "head", dequantize_kv(v, vs))
    np.testing.assert_allclose(out, expect, rtol=0, atol=tol)


def test_dispatch_rejects_bad_operands():
    q, k, v, _, _ = _operands(3, 1, 4, 2, 1, 8, "head")
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention(q, k, v, jnp.array([4]), k_scale=jnp.ones(3), sm_scale=1.0)
    with pytest.raises(ValueError, match="lengths_B"):
        decode_attention(q, k, v, jnp.array([4, 4]), sm_scale=1.0)
    with pytest.raises(ValueError, match="both be dynamic"):
        decode_attention(q, k, v, jnp.array([4]), k_scale=jnp.ones((1, 2, 4)), sm_scale=1.0)
