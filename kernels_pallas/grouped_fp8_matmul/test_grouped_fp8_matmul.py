"""grouped_fp8_matmul: the reference against hand values and float64, every implementation
against the reference (one shared grid), support checks, dispatch, operand rules (the tile map:
``test_tiles.py``).

Kernels run in interpret mode here (Mosaic GPU under ``plgpu.InterpretGPUParams``, every CTA of
the grid simulated on CPU; Mosaic TPU under the HLO interpreter); the same grid runs natively with
``-m gpu`` / ``-m tpu``. Weights are expert stacks, QArrays ``[E, N, K]`` (``quantize_weight`` of
``[E, K, N]``); rows of x are sorted by expert.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from kernels_pallas.grouped_fp8_matmul import (
    IMPLEMENTATIONS,
    MgpuConfig,
    TpuConfig,
    XlaConfig,
    grouped_fp8_matmul,
    grouped_fp8_matmul_reference,
    num_tiles,
)
from kernels_pallas.grouped_fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.qarray import QArray, dequantize
from kernels_pallas.quantize import quantize_activations, quantize_weight

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
_V6E = AbstractDevice(device_kind="TPU v6 lite", platform="tpu", num_cores=1)


def _on(device):
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device))


# Jitted once per shape: eager quantization compiles every primitive on its own (slow on CPU).
_quantize_x = jax.jit(quantize_activations, static_argnums=(1, 2))
_quantize_w = jax.jit(quantize_weight, static_argnums=(1, 2))
_reference = jax.jit(grouped_fp8_matmul_reference, static_argnames="out_dtype")


def _operands(m, k, n, sizes, dtype=E4M3, seed=0):
    """x [M, K], group sizes, x_q, and w_q: a QArray [E, N, K], or a tuple of stacks for a
    tuple ``n``."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    ws = []
    for i, n_i in enumerate(n if isinstance(n, tuple) else (n,)):
        # Distinct experts and stacks (offsets) so that a row times a wrong weight shows.
        w = jax.random.normal(jax.random.fold_in(kw, i), (len(sizes), k, n_i), jnp.float32)
        w = w + (jnp.arange(len(sizes), dtype=jnp.float32)[:, None, None] + i) / 2
        ws.append(_quantize_w(w, (128, 128), dtype))
    gs = jnp.asarray(sizes, jnp.int32)
    return x, gs, _quantize_x(x, 128, dtype), tuple(ws) if len(ws) > 1 else ws[0]


def _dq(q) -> np.ndarray:
    """Exact dequantization (FP8 value times FP32 scale); stacks concatenated along N."""
    qs = q if isinstance(q, tuple) else (q,)
    return np.concatenate([np.asarray(dequantize(a), np.float64) for a in qs], axis=-2)


def _float64_grouped(xd, wd, sizes):
    """Per-group loop in float64 numpy: x [M, K], w [E, N, K]."""
    y = np.zeros((xd.shape[0], wd.shape[1]))
    start = 0
    for e, size in enumerate(sizes):
        y[start : start + size] = xd[start : start + size] @ wd[e].T
        start += size
    return y


# ---------------------------------------------------------------- the reference


def test_reference_hand_case():
    # K=4 in groups of 2. Expert 0 (row 0): w0 = [1 1 | 2 2] with block scales (0.25, 1);
    # expert 1 (rows 1-2): w1 = [1 0 | 0 1] with scales (2, 4). x rows [1 2 | 3 4] with scales
    # (0.5, 2), [1 1 | 1 1] with (1, 1), [2 0 | 0 2] with (1, 0.5); row 3 is past Σ sizes.
    # y0 = 0.5*0.25*3 + 2*1*14 = 28.375; y1 = 1*2*1 + 1*4*1 = 6; y2 = 1*2*2 + 0.5*4*2 = 8.
    xv = jnp.array([[1.0, 2, 3, 4], [1, 1, 1, 1], [2, 0, 0, 2], [5, 5, 5, 5]]).astype(E4M3)
    x = QArray(xv, jnp.array([[0.5, 2], [1, 1], [1, 0.5], [1, 1]]), (2,), jnp.float32)
    wv = jnp.array([[[1.0, 1, 2, 2]], [[1, 0, 0, 1]]]).astype(E4M3)
    w = QArray(wv, jnp.array([[[0.25, 1]], [[2, 4]]]), (1, 2), jnp.float32)
    y = grouped_fp8_matmul_reference(x, w, jnp.array([1, 2]), out_dtype=jnp.float32)
    np.testing.assert_allclose(y, [[28.375], [6], [8], [0]])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("sizes", [(3, 0, 9, 4), (0, 16, 0, 0), (5, 0, 2, 0)])
def test_reference_against_float64(sizes, dtype):
    """Empty experts, one expert holding every row, and rows past Σ sizes (zero)."""
    m = 16
    _, gs, xq, wq = _operands(m, 256, 200, sizes, dtype)
    y = np.asarray(_reference(xq, wq, gs, out_dtype=jnp.float32), np.float64)
    ref = _float64_grouped(_dq(xq), _dq(wq), sizes)
    np.testing.assert_array_equal(y[sum(sizes) :], 0)
    # FP32 accumulation of exactly dequantized inputs: 1e-6 of Σ|x̂ s||ŵ s| bounds the rounding.
    mag = _float64_grouped(np.abs(_dq(xq)), np.abs(_dq(wq)), sizes)
    assert np.all(np.abs(y - ref) <= 1e-6 * mag)


# ---------------------------------------------------------------- every implementation

_XLA_METHODS = [  # the XLA path's GPU methods, on the grid entries marked below
    pytest.param("xla", XlaConfig("kblock_fp8", tile_m=8), False, id="xla-kblock"),
    pytest.param("xla", XlaConfig("dequant_bf16", tiles_per_step=2), False, id="xla-bf16"),
]
_IMPLS = [
    pytest.param("xla", None, False, id="xla"),
    pytest.param("pallas_mosaic_gpu", None, True, id="mgpu-interpret"),
    pytest.param("pallas_tpu", None, True, id="tpu-interpret"),
    pytest.param("pallas_mosaic_gpu", None, False, id="mgpu", marks=pytest.mark.gpu),
    pytest.param("pallas_tpu", None, False, id="tpu", marks=pytest.mark.tpu),
]
# (M, K, N, group sizes, FP8 format, raw F32 x). Decode-sized groups (swap-AB on Hopper), empty
# experts, one expert holding every row, ragged tails and rows past Σ sizes, a 2-tile N grid,
# two weight stacks in one call (gate and up: N = 128 + 256).
_GRID = [
    (8, 256, 128, (0, 3, 0, 5), E4M3, False),
    (40, 128, 256, (40, 0, 0), E5M2, False),
    (150, 384, 128, (70, 1, 0, 66), E4M3, True),
    (300, 128, 128, (0, 129, 0, 0, 171), E4M3, False),
    (24, 256, (128, 256), (9, 0, 11), E4M3, False),
    # prefill-sized groups (Hopper: ragged stores of wide 128x256 tiles), rows past Σ sizes
    (330, 256, 256, (0, 129, 0, 0, 150), E4M3, False),
    (330, 256, (256, 256), (70, 129, 3, 0, 100), E5M2, True),
]
_GRID_XLA_METHODS = [_GRID[2], _GRID[4]]


def _tol_bound(xq, wq, gs, config, hopper_device=False):
    """Elementwise bound on |y - reference|: f32 summation order (1e-5 of Σ|x̂ s||ŵ s|) for the
    exact paths; ``dequant_bf16`` adds two BF16 roundings (2^-9 each) of the operands; the
    Hopper kernel on a device its FP8 WGMMA accumulation (``hopper_fp8_numerics.DEVICE_REL``,
    as the dense kernel's test: on an H200 the 1e-5 bound failed by 5-15x, inside 2^-11)."""
    from kernels_pallas.fp8_matmul import hopper_fp8_numerics as hw

    mag = _float64_grouped(np.abs(_dq(xq)), np.abs(_dq(wq)), [int(s) for s in gs])
    bf16 = config is not None and config.method == "dequant_bf16"
    rel = 2 * 2.0**-9 + 2.0**-17 if bf16 else 1e-5
    rel = hw.DEVICE_REL if hopper_device else rel
    return rel * mag + 1e-6 * np.max(mag)


@functools.cache
def _grid_case(m, k, n, sizes, dtype):
    """Operands and reference of one grid entry, shared by every implementation."""
    x, gs, xq, wq = _operands(m, k, n, sizes, dtype, seed=m + k + len(sizes))
    ref = np.asarray(_reference(xq, wq, gs, out_dtype=jnp.float32), np.float64)
    return x, gs, xq, wq, ref


def _cross(impls, grid):
    return [
        pytest.param(*i.values, *g, marks=i.marks, id=f"{i.id}-{g[0]}x{g[1]}x{g[2]}")
        for i in impls
        for g in grid
    ]


@pytest.mark.parametrize(
    "impl,config,interpret,m,k,n,sizes,dtype,raw",
    _cross(_IMPLS, _GRID) + _cross(_XLA_METHODS, _GRID_XLA_METHODS),
)
def test_impl_matches_reference(impl, config, interpret, m, k, n, sizes, dtype, raw):
    x, gs, xq, wq, ref = _grid_case(m, k, n, sizes, dtype)
    y = grouped_fp8_matmul(x if raw else xq, wq, gs, out_dtype=jnp.float32, impl=impl,
                           config=config, interpret=interpret)  # fmt: skip
    assert y.shape == (m, sum(n) if isinstance(n, tuple) else n) and y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y)[sum(sizes) :], 0)
    err = np.abs(np.asarray(y, np.float64) - ref)
    bound = _tol_bound(xq, wq, gs, config, impl == "pallas_mosaic_gpu" and not interpret)
    assert np.all(err <= bound), float(np.max(err / bound))


@pytest.mark.parametrize(
    "impl,cfg",
    [  # 64-row tiles, one compute warpgroup; swap-AB 32-row tiles, two compute warpgroups;
        # 256x128 tiles, two 64-row sub-tiles per warpgroup, the ragged stores of each.
        ("pallas_mosaic_gpu", MgpuConfig(block_m=64, block_n=64, max_concurrent_steps=2)),
        ("pallas_mosaic_gpu", MgpuConfig(block_m=32, block_n=128, swap_ab=True)),
        ("pallas_mosaic_gpu", MgpuConfig(block_m=256, block_n=128, max_concurrent_steps=3)),
    ],
)
def test_kernel_explicit_configs_bf16_out(impl, cfg):
    _, gs, xq, wq = _operands(72, 384, 128, (30, 0, 22, 20), seed=5)
    ref = np.asarray(_reference(xq, wq, gs, out_dtype=jnp.float32))
    y = grouped_fp8_matmul(xq, wq, gs, impl=impl, config=cfg, interpret=True)
    assert y.dtype == jnp.bfloat16
    # BF16 output: 2^-8 relative rounding of each output on top of f32 summation order.
    np.testing.assert_allclose(
        np.asarray(y, np.float32), ref, rtol=2**-8, atol=1e-5 * abs(ref).max()
    )


def test_tpu_native_fp8_packed_groups_two_n_and_k_steps():
    """FP8 into the dot, two K groups per 256-deep dot (block-diagonal x per row tile), 2 N
    tiles x 2 K steps, an empty group, f32 out."""
    _, gs, xq, wq = _operands(72, 512, 256, (30, 0, 22, 20), seed=6)
    ref = np.asarray(_reference(xq, wq, gs, out_dtype=jnp.float32))
    cfg = TpuConfig(block_m=32, block_n=128, block_k=256, compute_dtype="native", pack=2)
    y = grouped_fp8_matmul(xq, wq, gs, out_dtype=jnp.float32, impl="pallas_tpu", config=cfg,
                           interpret=True)  # fmt: skip
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * abs(ref).max())


def test_tpu_dequant_bf16_stacks_two_n_and_k_steps():
    """compute_dtype="dequant_bf16" (v6e prefill): both operands to BF16 in VMEM, one 256-deep dot
    per step; gate+up stacks, 2 K steps, an empty group. With power-of-two scales every
    dequantized element is exact in BF16, so the result is the reference's up to f32 order."""
    _, gs, xq, (wg, wu) = _operands(72, 512, (128, 128), (30, 0, 22, 20), seed=7)
    pow2 = lambda q: QArray(q.values, 2.0 ** jnp.ceil(jnp.log2(q.scales)), q.block_shape,  # noqa: E731
                            q.dtype)  # fmt: skip
    xq, wg, wu = pow2(xq), pow2(wg), pow2(wu)
    ref = np.asarray(_reference(xq, (wg, wu), gs, out_dtype=jnp.float32))
    cfg = TpuConfig(block_m=32, block_n=128, block_k=256, compute_dtype="dequant_bf16")
    y = grouped_fp8_matmul(xq, (wg, wu), gs, out_dtype=jnp.float32, impl="pallas_tpu",
                           config=cfg, interpret=True)  # fmt: skip
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-6 * abs(ref).max())


def test_tpu_plan_dequantizes_prefill_tiles_on_an_fp8_mxu():
    from kernels_pallas.grouped_fp8_matmul import pallas_tpu as gtpu

    ns = (768, 768)  # Qwen3-30B-A3B gate+up, 128 experts
    assert gtpu.plan(65536, 2048, ns, 128, None, fp8_mxu=True).compute_dtype == "dequant_bf16"
    assert gtpu.plan(65536, 2048, ns, 128, None, fp8_mxu=False).compute_dtype == "bfloat16"
    assert gtpu.plan(8, 2048, ns, 128, None, fp8_mxu=True).compute_dtype == "native"
    bad = TpuConfig(compute_dtype="dequant_bf16", pack=2)
    assert "pack=2" in gtpu.plan(4096, 2048, ns, 128, bad, fp8_mxu=True)


def test_stacks_equal_the_concatenated_weight():
    """A tuple of stacks is one product over their concatenation along N; with N blocks that
    are not whole (F=96), the XLA path multiplies stack by stack."""
    _, gs, xq, (wg, wu) = _operands(20, 128, (96, 64), (7, 13), seed=9)
    y = grouped_fp8_matmul(xq, (wg, wu), gs, out_dtype=jnp.float32, impl="xla")
    yg = grouped_fp8_matmul(xq, wg, gs, out_dtype=jnp.float32, impl="xla")
    yu = grouped_fp8_matmul(xq, wu, gs, out_dtype=jnp.float32, impl="xla")
    np.testing.assert_array_equal(y, jnp.concatenate([yg, yu], axis=-1))


def test_xla_path_is_tiled_not_ragged_dot():
    """The XLA path lowers to one batched dot over the row tiles, never to ``ragged_dot`` (which
    XLA:GPU expands into E dense dots); E=64 experts, 16 rows: 16 tiles of 8 rows, not 64."""
    _, gs, xq, wq = _operands(16, 256, 128, (2,) * 8 + (0,) * 56)
    cfg = XlaConfig("kblock_fp8", tile_m=8)
    hlo = jax.jit(lambda *a: grouped_fp8_matmul(*a, impl="xla", config=cfg)).lower(xq, wq, gs)
    text = hlo.as_text()
    assert "ragged" not in text
    t = num_tiles(16, 64, 8)
    assert t == 17  # cdiv(16, 8) + min(64, 16) - 1
    assert f"tensor<{t}x2x8x128xf32>" in text  # [tiles, K blocks, tm, N]


# ---------------------------------------------------------------- support checks and dispatch


def _sds(m, k, n, e, dtype=E4M3, w_block=(128, 128)):
    sds = jax.ShapeDtypeStruct
    x = QArray(sds((m, k), dtype), sds((m, -(-k // 128)), jnp.float32), (128,), jnp.bfloat16)
    nb, kb = -(-n // w_block[0]), -(-k // w_block[1])
    w = QArray(sds((e, n, k), dtype), sds((e, nb, kb), jnp.float32), w_block, jnp.bfloat16)
    return x, w, sds((e,), jnp.int32)


def _supports(impl, x, w, gs, config=None, out_dtype=jnp.bfloat16, interpret=False):
    return IMPLEMENTATIONS.impls[impl].supports(
        x, w, gs, config=config, out_dtype=jnp.dtype(out_dtype), interpret=interpret
    )


def test_mosaic_gpu_support_check_and_defaults():
    with _on(_H100):
        for m in (8, 512, 65536):  # Qwen3-30B-A3B decode and prefill rows (E=128)
            assert _supports("pallas_mosaic_gpu", *_sds(m, 2048, 1536, 128)) is None
            assert _supports("pallas_mosaic_gpu", *_sds(m, 768, 2048, 128)) is None
        assert "K=200" in _supports("pallas_mosaic_gpu", *_sds(16, 200, 256, 4))
        assert "N=200" in _supports("pallas_mosaic_gpu", *_sds(16, 256, 200, 4))
        assert "blocks" in _supports("pallas_mosaic_gpu", *_sds(16, 256, 256, 4, w_block=(64, 128)))
        x5, _, _ = _sds(16, 256, 256, 4, E5M2)
        assert "formats differ" in _supports("pallas_mosaic_gpu", x5, *_sds(16, 256, 256, 4)[1:])
        small = MgpuConfig(block_m=16, block_n=64, swap_ab=True)  # 64-B TMA stages of scales
        assert "multiple of 32" in _supports("pallas_mosaic_gpu", *_sds(16, 256, 256, 4), small)
        assert "MgpuConfig" in _supports("pallas_mosaic_gpu", *_sds(16, 256, 256, 4), TpuConfig())
        x, w, gs = _sds(512, 2048, 768, 128)
        assert _supports("pallas_mosaic_gpu", x, (w, w), gs) is None  # gate+up in one launch
        assert "at most 2" in _supports("pallas_mosaic_gpu", x, (w, w, w), gs)
        # A pipeline per stack: 6 stages spill registers with two stacks (ptxas), 5 do not.
        deep = MgpuConfig(32, 128, 6, True)
        assert _supports("pallas_mosaic_gpu", x, w, gs, deep) is None
        assert "<= 5" in _supports("pallas_mosaic_gpu", x, (w, w), gs, deep)
        # the dense kernel's several 128-K slices per step: refused, not run on one-slice steps
        sliced = MgpuConfig(32, 128, 4, True, k_slices=2)
        assert "k_slices" in _supports("pallas_mosaic_gpu", x, w, gs, sliced)
        dependent = MgpuConfig(32, 128, 4, True, pdl=True)  # the dense decode tiles' launch
        assert "pdl" in _supports("pallas_mosaic_gpu", x, w, gs, dependent)
        # the dense kernel's wide tiles run here too (ragged stores); its clusters do not
        wide = MgpuConfig(128, 256, 3)
        assert _supports("pallas_mosaic_gpu", *_sds(65536, 2048, 1536, 128), wide) is None
        assert "block_n=256" in _supports("pallas_mosaic_gpu", *_sds(65536, 2048, 384, 128), wide)
        clustered = MgpuConfig(128, 128, 4, cluster_m=2)
        assert "cluster_m" in _supports(
            "pallas_mosaic_gpu", *_sds(65536, 2048, 1536, 128), clustered
        )
    assert "Hopper" in _supports("pallas_mosaic_gpu", *_sds(16, 256, 256, 4))  # CPU target
    # Decode-sized groups swap A and B with 32..64-row tiles (>= twice the mean group size);
    # large groups get 128x128 CTAs; both 128 weight rows per CTA (two compute warpgroups)
    # where every stack's N % 128 == 0, else 64.
    assert mgpu.default_config(8, (768, 768), 2048, 128) == MgpuConfig(32, 128, 4, True)
    assert mgpu.default_config(8, (2048, 64), 768, 128) == MgpuConfig(32, 64, 4, True)
    assert mgpu.default_config(2048, (768, 768), 2048, 128).block_m == 32  # 16 rows per group
    assert mgpu.default_config(4096, (768, 768), 2048, 128).block_m == 64
    # Prefill: the wide 128x256 tiles where every N % 256 == 0, as deep as SMEM allows (3 stages
    # of 48 KiB beside the 64 KiB output tile); with F32 outputs (128 KiB) two stages fit.
    assert mgpu.default_config(65536, (768, 768), 2048, 128) == MgpuConfig(128, 256, 3, False)
    assert mgpu.default_config(65536, (2048,), 768, 128, out_itemsize=4) == MgpuConfig(128, 256, 2)
    assert mgpu.default_config(8192, (384,), 2048, 128) == MgpuConfig(128, 128, 4, False)
    assert mgpu.default_config(65536, (2048, 64), 768, 128).block_n == 64


def test_tpu_support_check():
    with _on(_V6E):
        assert _supports("pallas_tpu", *_sds(8, 2048, 1536, 128)) is None
        assert _supports("pallas_tpu", *_sds(65536, 768, 2048, 128)) is None
        assert "N=200" in _supports("pallas_tpu", *_sds(16, 256, 200, 4))
        assert "block_m" in _supports("pallas_tpu", *_sds(16, 256, 256, 4), TpuConfig(block_m=48))
    assert "needs a TPU" in _supports("pallas_tpu", *_sds(16, 256, 256, 4))


def test_auto_takes_the_kernel_or_falls_back_with_one_log_line(caplog):
    pick = lambda *ops: (
        IMPLEMENTATIONS.select("auto", *ops, config=None, out_dtype=jnp.dtype(jnp.bfloat16)).name
    )
    with _on(_H100):
        assert pick(*_sds(512, 2048, 1536, 128)) == "pallas_mosaic_gpu"
        with caplog.at_level(logging.WARNING, logger="kernels_pallas.backend"):
            assert pick(*_sds(16, 2048, 1000, 128)) == "xla"
            assert pick(*_sds(16, 2048, 1000, 128)) == "xla"
    lines = [r.getMessage() for r in caplog.records if "N=1000" in r.getMessage()]
    assert len(lines) == 1 and "falling back to xla" in lines[0]
    with _on(_V6E):
        assert pick(*_sds(512, 2048, 1536, 128)) == "pallas_tpu"
    assert pick(*_sds(512, 2048, 1536, 128)) == "xla"  # this CPU machine


def test_operand_errors():
    _, gs, xq, wq = _operands(8, 256, 128, (4, 4))
    with pytest.raises(ValueError, match="unknown impl"):
        grouped_fp8_matmul(xq, wq, gs, impl="cuda")
    with pytest.raises(ValueError, match="contracting dims differ"):
        grouped_fp8_matmul(quantize_activations(jnp.ones((8, 384))), wq, gs)
    with pytest.raises(ValueError, match="group_sizes_E"):
        grouped_fp8_matmul(xq, wq, jnp.array([8]))
    with pytest.raises(ValueError, match="group_sizes_E"):
        grouped_fp8_matmul(xq, wq, jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match="rank-3"):
        grouped_fp8_matmul(xq, wq[0], gs)
    with pytest.raises(ValueError, match="group"):
        grouped_fp8_matmul(quantize_activations(jnp.ones((8, 256)), 64), wq, gs)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        grouped_fp8_matmul(jnp.ones((2, 4, 256)), wq, gs)
    with pytest.raises(ValueError, match="share E, K"):
        grouped_fp8_matmul(xq, (wq, quantize_weight(jnp.ones((2, 384, 128)))), gs)
    with pytest.raises(ValueError, match="share E, K"):
        grouped_fp8_matmul(xq, (wq, quantize_weight(jnp.ones((2, 256, 128)), dtype=E5M2)), gs)
    with pytest.raises(ValueError, match="pallas_mosaic_gpu.*Hopper"):
        grouped_fp8_matmul(xq, wq, gs, impl="pallas_mosaic_gpu")
