"""fp8_matmul: the reference against hand values and float64, every implementation against the
reference (one shared grid); support checks, dispatch and fallbacks are in ``test_support.py``.

Implementations run in interpret mode here: the Mosaic GPU kernel under ``plgpu.InterpretGPUParams``
(SMEM, TMA, barriers and warpgroups simulated on CPU; every CTA of the grid runs), the TPU kernel
under the HLO interpreter. The same grid runs natively with ``-m gpu`` / ``-m tpu`` on a device.
Weights are QArrays ``[N, K]`` (``quantize_weight`` of a ``[K, N]`` training weight).

CPU timing that chose the XLA implementation's CPU path (median of 7, this machine, jit):
M=16, K=N=2048: reference 19.8 ms, kblock_fp8 43.5 ms, dequant_bf16 24.4 ms; M=128: 61 / 256 /
60 ms; so ``XlaConfig(method="auto")`` is the exact reference off GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh

from kernels_pallas.fp8_matmul import (
    MgpuConfig,
    XlaConfig,
    fp8_matmul,
    fp8_matmul_reference,
)
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.qarray import QArray, dequantize
from kernels_pallas.quantize import quantize_activations, quantize_blockwise, quantize_weight

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_EPS = {E4M3: 2.0**-4, E5M2: 2.0**-3}  # half-ulp relative error, normals
_SUB = {E4M3: 2.0**-10, E5M2: 2.0**-17}  # half subnormal spacing
_H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


def _on(device):
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device))


def _operands(m, k, n, dtype=E4M3, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32)
    return x, w, quantize_activations(x, 128, dtype), quantize_weight(w, (128, 128), dtype)


def _rel_fro(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


# ---------------------------------------------------------------- the reference


def test_reference_hand_case():
    # x = [1 2 | 3 4] in groups of 2 with scales (0.5, 2); w (N=1) = [1 1 | 2 2], scales (0.25, 1):
    # y = 0.5 * 0.25 * (1 + 2) + 2 * 1 * (6 + 8) = 0.375 + 28.
    x = QArray(jnp.array([[1.0, 2, 3, 4]]).astype(E4M3), jnp.array([[0.5, 2.0]]), (2,), jnp.float32)
    w = QArray(
        jnp.array([[1.0, 1, 2, 2]]).astype(E4M3), jnp.array([[0.25, 1.0]]), (1, 2), jnp.float32
    )
    np.testing.assert_allclose(fp8_matmul_reference(x, w, out_dtype=jnp.float32), [[28.375]])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("m,k,n", [(16, 512, 256), (5, 200, 300)])
def test_reference_against_float64(m, k, n, dtype):
    x, w, xq, wq = _operands(m, k, n, dtype)
    assert wq.shape == (n, k) and wq.scales.shape == (-(-n // 128), -(-k // 128))
    y = fp8_matmul_reference(xq, wq, out_dtype=jnp.float32)
    xd, wd = np.asarray(dequantize(xq), np.float64), np.asarray(dequantize(wq), np.float64)
    assert _rel_fro(y, xd @ wd.T) < 1e-5  # FP32 accumulation of exactly dequantized inputs

    # Against the unquantized product: x̂ = x + dx with |dx| <= eps|x| + s_x*sub (RNE, incl.
    # subnormals), the same for w, so |ŷ - y| <= |dx|@|w| + |x|@|dw| + |dx|@|dw| elementwise.
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    sx = np.repeat(np.asarray(xq.scales, np.float64), 128, axis=1)[:, :k]
    sw = np.repeat(np.repeat(np.asarray(wq.scales, np.float64), 128, 0), 128, 1)[:n, :k].T
    dx = _EPS[dtype] * np.abs(x64) + _SUB[dtype] * sx
    dw = _EPS[dtype] * np.abs(w64) + _SUB[dtype] * sw
    bound = dx @ np.abs(w64) + np.abs(x64) @ dw + dx @ dw
    err = np.abs(np.asarray(y, np.float64) - x64 @ w64)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-5 * np.abs(x64) @ np.abs(w64))
    # The rounding errors are independent and zero-mean, so the relative Frobenius error is the
    # RMS relative error of one product, about sqrt(2) * 0.025 ~ 0.035 for E4M3 (twice that for
    # E5M2); the asserted values leave a ~1.7x margin.
    assert _rel_fro(y, x64 @ w64) < {E4M3: 0.06, E5M2: 0.12}[dtype]


# ---------------------------------------------------------------- every implementation

# (impl, config, interpret). Interpret mode here; natively on a device with -m gpu / -m tpu.
_IMPLS = [
    pytest.param("xla", None, False, id="xla"),
    pytest.param("xla", XlaConfig("kblock_fp8"), False, id="xla-kblock"),
    pytest.param("xla", XlaConfig("dequant_bf16"), False, id="xla-bf16"),
    pytest.param("pallas_mosaic_gpu", None, True, id="mgpu-interpret"),
    pytest.param("pallas_tpu", None, True, id="tpu-interpret"),
    pytest.param("pallas_mosaic_gpu", None, False, id="mgpu", marks=pytest.mark.gpu),
    pytest.param("pallas_tpu", None, False, id="tpu", marks=pytest.mark.tpu),
]
# (M, K, N, FP8 format, raw BF16 x): decode rows (swap-AB on Hopper), a tail M of 65, prefill
# tiles, a 2x2 CTA grid; raw x is quantized once (``quantize_activations``) at every M.
_GRID = [
    (1, 256, 128, E4M3, False),
    (16, 128, 256, E5M2, False),
    (65, 384, 128, E4M3, False),
    (128, 256, 256, E4M3, False),
    (256, 128, 256, E5M2, False),
    (1, 256, 128, E4M3, True),
    (64, 256, 256, E5M2, True),
    (130, 256, 128, E4M3, True),
    (100, 1024, 256, E4M3, True),  # swap-AB with 112 rows as the wgmma N, K split in 2
]


def _expected(x, wq, dtype, raw):
    """(reference f32 output, the quantized x it was computed from)."""
    xq = quantize_activations(x.astype(jnp.bfloat16) if raw else x, 128, dtype)
    return fp8_matmul_reference(xq, wq, out_dtype=jnp.float32), xq


def _tol_bound(xq, wq, config, out_dtype, ref, hopper_device=False):
    """Elementwise bound on |y - reference|: f32 summation order (1e-5 of Σ|x̂ s||ŵ s|) for the
    exact paths; ``dequant_bf16`` adds two BF16 roundings (2^-9 each) of the dequantized
    operands; the Hopper kernel on a device its FP8 WGMMA accumulation
    (``hopper_fp8_numerics.DEVICE_REL``); a BF16 output adds its own rounding (2^-8 relative,
    covering a nearby f32)."""
    from kernels_pallas.fp8_matmul import hopper_fp8_numerics as hw

    xa = np.abs(np.asarray(dequantize(xq), np.float64))
    wa = np.abs(np.asarray(dequantize(wq), np.float64))
    mag = xa @ wa.T
    rel = 2 * 2.0**-9 + 2.0**-17 if config == XlaConfig("dequant_bf16") else 1e-5
    rel = hw.DEVICE_REL if hopper_device else rel
    bound = rel * mag + 1e-6 * np.max(mag)
    if out_dtype == jnp.bfloat16:
        bound = bound + 2.0**-8 * np.abs(np.asarray(ref, np.float64))
    return bound


@pytest.mark.parametrize("impl,config,interpret", _IMPLS)
@pytest.mark.parametrize("m,k,n,dtype,raw", _GRID)
def test_impl_matches_reference(impl, config, interpret, m, k, n, dtype, raw):
    x, _, _, wq = _operands(m, k, n, dtype, seed=m + k + n)
    ref, xq = _expected(x, wq, dtype, raw)
    out_dtype = jnp.bfloat16 if raw else jnp.float32
    x_in = x.astype(jnp.bfloat16) if raw else xq
    y = fp8_matmul(x_in, wq, out_dtype=out_dtype, impl=impl, config=config, interpret=interpret)
    assert y.shape == (m, n) and y.dtype == out_dtype
    err = np.abs(np.asarray(y, np.float64) - np.asarray(ref, np.float64))
    hopper_device = impl == "pallas_mosaic_gpu" and not interpret
    bound = _tol_bound(xq, wq, config, out_dtype, ref, hopper_device)
    assert np.all(err <= bound), float(np.max(err / bound))


@pytest.mark.parametrize(
    "cfg,m,n",
    [  # swapped with two compute warpgroups and 3 M tiles; 64x64 tiles with a 3-stage ring;
        # the wide prefill tiles (two 64x128 sub-tiles per warpgroup) on a 2x2 CTA grid with an
        # M tail: 128x256 (two weight blocks per warpgroup), 256x128 (128 rows per warpgroup)
        (MgpuConfig(block_m=32, block_n=128, max_concurrent_steps=2, swap_ab=True), 72, 256),
        (MgpuConfig(block_m=64, block_n=64, max_concurrent_steps=3), 80, 256),
        (MgpuConfig(32, 64, max_concurrent_steps=2, swap_ab=True, split_k=3), 5, 256),
        (MgpuConfig(32, 128, max_concurrent_steps=2, swap_ab=True, split_k=3), 24, 256),  # 2 WGs
        # 128 rows as the wgmma N, two M tiles (the second a tail), K split in 3
        (MgpuConfig(128, 128, max_concurrent_steps=2, swap_ab=True, split_k=3), 200, 256),
        (MgpuConfig(block_m=128, block_n=256, max_concurrent_steps=2), 200, 512),  # f32 out: 2
        (MgpuConfig(block_m=256, block_n=128, max_concurrent_steps=2), 300, 256),
        # 2-CTA clusters along M sharing the weight tile (TMA multicast): 2 clusters x 2 N tiles
        (MgpuConfig(block_m=128, block_n=256, max_concurrent_steps=2, cluster_m=2), 300, 512),
        (MgpuConfig(block_m=128, block_n=128, max_concurrent_steps=2, cluster_m=2), 200, 256),
        # persistent grids of a few CTAs looping over snake-ordered tiles (3-tile bands): 12 tiles
        # on 5 CTAs; 128x256 tiles, 6 on 4 CTAs; 2-CTA clusters, 3 cluster tiles on 2 clusters;
        # 132 CTAs for 2 cluster tiles (the grid shrinks to the tile count)
        (MgpuConfig(128, 128, max_concurrent_steps=2, persistent=5), 300, 512),
        (MgpuConfig(128, 256, max_concurrent_steps=2, persistent=4), 300, 512),
        (MgpuConfig(128, 128, max_concurrent_steps=2, cluster_m=2, persistent=4), 300, 384),
        (MgpuConfig(128, 256, max_concurrent_steps=2, cluster_m=2, persistent=132), 200, 512),
    ],
)
def test_mosaic_gpu_explicit_configs(cfg, m, n):
    x, w, _, _ = _operands(m, 384, n, E4M3, seed=5)  # 3 K steps
    # Weight blocks 10x apart in magnitude: a sub-tile promoted with its neighbour's scale fails.
    w = w * jnp.repeat(10.0 ** jnp.arange(n // 128), 128)[None, :]
    xq, wq = quantize_activations(x, 128, E4M3), quantize_weight(w, (128, 128), E4M3)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    y = mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.float32, interpret=True, config=cfg)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))


@pytest.mark.parametrize(
    "cfg,m",
    [
        (MgpuConfig(32, 128, 2, swap_ab=True), 5),  # the smallest swap tile, two warpgroups
        (MgpuConfig(32, 64, 2, swap_ab=True), 16),
        (MgpuConfig(64, 128, 2, swap_ab=True), 40),
        (MgpuConfig(32, 128, 2, swap_ab=True, split_k=3), 9),  # partials: yᵀ, summed by XLA
        (MgpuConfig(128, 128, 2, swap_ab=True), 100),  # [128, 64] transposed store per WG
        (MgpuConfig(96, 64, 2, swap_ab=True), 96),
    ],
)
def test_mosaic_gpu_swap_tiles_write_y(cfg, m):
    """Swap-AB tiles with 16-bit output store the yᵀ accumulator through a transposed SMEM view
    and write y itself (no transpose after the kernel); each output element is its reference's
    rounded to BF16 (within one BF16 step of the F32 reference, plus f32 summation order:
    1e-5 of the largest output, as in ``test_mosaic_gpu_explicit_configs``)."""
    x, w, _, _ = _operands(m, 384, 256, E4M3, seed=9)
    w = w * jnp.repeat(10.0 ** jnp.arange(2), 128)[None, :]
    xq, wq = quantize_activations(x, 128, E4M3), quantize_weight(w, (128, 128), E4M3)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    y = mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.bfloat16, interpret=True, config=cfg)
    assert y.shape == (m, 256) and y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2**-7,
                               atol=1e-5 * np.max(np.abs(ref)))  # fmt: skip
    assert mgpu._stores_y(cfg, jnp.bfloat16) == (cfg.split_k == 1)
    assert not mgpu._stores_y(cfg, jnp.float32)  # no transposed store of 32-bit tiles


def test_mosaic_gpu_persistent_snake_bands(monkeypatch):
    """A persistent grid whose snake order has several bands (L2 budget shrunk to two M tiles of
    x rows): 5 M tiles x 3 N tiles in bands of 2, 2 and 1 M tiles, N reversed every other band,
    on 4 CTAs (and on 4 two-CTA clusters: 3 cluster rows of 256, one per band)."""
    from kernels_pallas.fp8_matmul import mgpu_config

    k = 256
    monkeypatch.setattr(mgpu_config, "_L2_BAND_BYTES", 2 * 128 * k)
    x, w, xq, wq = _operands(520, k, 384, E4M3, seed=7)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    for cfg, m_pad, band in (
        (MgpuConfig(128, 128, 2, persistent=4), 640, 2),
        (MgpuConfig(128, 128, 2, cluster_m=2, persistent=8), 768, 1),
    ):
        assert mgpu.snake_band(cfg, m_pad, k) == band
        y = mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.float32, interpret=True, config=cfg)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))


def test_mosaic_gpu_fused_kernel_explicit():
    """The fused (in-kernel quantization) prefill kernel, opt-in only: x quantized with
    ``quantize_activations``' arithmetic (``mgpu_k_step.quantize_rows``), so it equals the
    quantize-once path on the same tile bit for bit, padded rows included; and the reference
    within f32 summation order."""
    x, _, _, wq = _operands(130, 256, 128, E4M3, seed=11)
    xb = x.astype(jnp.bfloat16)
    xq = quantize_activations(xb)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    cfg = MgpuConfig(block_m=128, block_n=128, max_concurrent_steps=3)
    y = fp8_matmul(xb, wq, out_dtype=jnp.float32, impl="pallas_mosaic_gpu", config=cfg,
                   interpret=True)  # fmt: skip
    once = fp8_matmul(xq, wq, out_dtype=jnp.float32, impl="pallas_mosaic_gpu", config=cfg,
                      interpret=True)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(y), np.asarray(once))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))


def test_raw_x_is_quantized_once_by_default_outside_the_fused_rows():
    """Raw x takes the fused kernel by default at M = 16 and, where the performance model
    says, at 17-64 rows (``tile_choice.fused_wins``); never below 16 rows (x would be padded:
    a launch as costly as the one saved) or above 64 (a prefill CTA re-quantizing its x slice
    is issue-bound), on either chip."""
    from kernels_pallas.fp8_matmul import api

    for chip in ("h100", "h200"):
        assert not any(api.fused_default(m, 4096, 4096, chip) for m in (1, 8, 15, 65, 256, 4096))
        assert api.fused_default(16, 4096, 4096, chip)
    # Qwen3-8B q|o_proj: fused at 32 rows on the H100 (not padded from 17 or 33: the pad is a
    # launch when the call stands alone), quantized once at 64
    assert [api.fused_default(m, 4096, 4096, "h100") for m in (17, 32, 33, 64)] == [
        False, True, False, False]  # fmt: skip


def test_quantize_activations_multiply_matches_division():
    """x · (fp8_max / amax) vs x / (amax / fp8_max): same scales, values within one FP8 step."""
    x = jax.random.normal(jax.random.key(4), (64, 384), jnp.float32) * 3.0
    a, b = quantize_activations(x), quantize_blockwise(x, (128,))
    np.testing.assert_array_equal(a.scales, b.scales)
    va, vb = np.asarray(a.values, np.float32), np.asarray(b.values, np.float32)
    assert np.mean(va != vb) < 1e-2  # ties flipped by one f32 rounding only
    np.testing.assert_allclose(va, vb, rtol=2.0**-3, atol=2.0**-9)


@pytest.mark.parametrize("impl", ["xla", "pallas_mosaic_gpu", "pallas_tpu"])
def test_leading_dims_and_square_weight_orientation(impl):
    """[2, 3, K] x; a square weight with distinct rows and columns catches a transposed use."""
    x = jax.random.normal(jax.random.key(8), (2, 3, 256), jnp.float32)
    w = jax.random.normal(jax.random.key(9), (256, 256), jnp.float32) + jnp.arange(256.0) / 64
    wq = quantize_weight(w)
    y = fp8_matmul(x, wq, out_dtype=jnp.float32, impl=impl, interpret=True)
    assert y.shape == (2, 3, 256)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert _rel_fro(y, exact) < 0.06
    yq = fp8_matmul(quantize_activations(x), wq, out_dtype=jnp.bfloat16, impl=impl, interpret=True)
    assert yq.shape == (2, 3, 256) and yq.dtype == jnp.bfloat16


def test_gpu_interpret_under_abstract_h100_mesh():
    """The documented CPU test route for Mosaic GPU kernels (forced interpret + abstract H100)."""
    _, _, xq, wq = _operands(16, 256, 128, seed=13)
    with _on(_H100), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        y = fp8_matmul(xq, wq, out_dtype=jnp.float32)  # auto: the Hopper kernel (swap-AB)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))


def _np_operands(xq, wq):
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
    return f(xq.values), np.asarray(xq.scales), f(wq.values), np.asarray(wq.scales)


def test_device_tolerance_covers_emulated_hopper_accumulation():
    """The -m gpu tolerance (``hopper_fp8_numerics.device_bound``: 2^-11 of Σ|x̂ ŵ| s) holds for
    the emulated Hopper FP8 accumulation (14-bit block FMAs inside a 128-K step), with margin,
    where the old ``rtol=1e-4`` of |y| fails: it judged the hardware's documented rounding."""
    from kernels_pallas.fp8_matmul import hopper_fp8_numerics as hw

    _, _, xq, wq = _operands(64, 512, 128, seed=21)
    ops = _np_operands(xq, wq)
    y_hw = hw.hopper_fp8_matmul(*ops)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32), np.float64)
    err = np.abs(y_hw - ref)
    bound = hw.device_bound(*ops)
    assert np.all(err <= bound / 4), float(np.max(err / bound))
    old_tol = 1e-4 * np.abs(ref) + 1e-4 * np.max(np.abs(ref))
    assert np.any(err > old_tol)  # the old tolerance would fail a correct device
    assert np.max(err) > 0  # the emulation does round


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 512])
def test_mosaic_gpu_kernel_on_hopper_real_shapes(m):
    """On the device: within the Hopper FP8 accumulation bound (``hopper_fp8_numerics``)."""
    from kernels_pallas.fp8_matmul import hopper_fp8_numerics as hw

    x, _, xq, wq = _operands(m, 4096, 1024, seed=11)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    y = fp8_matmul(xq, wq, out_dtype=jnp.float32, impl="pallas_mosaic_gpu")
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= hw.device_bound(*_np_operands(xq, wq)))
    xb = x.astype(jnp.bfloat16)
    xq_b = quantize_activations(xb)
    ref_b = np.asarray(fp8_matmul_reference(xq_b, wq, out_dtype=jnp.float32))
    y_b = fp8_matmul(xb, wq, out_dtype=jnp.float32, impl="pallas_mosaic_gpu")
    bound_b = hw.device_bound(*_np_operands(xq_b, wq))
    assert np.all(np.abs(np.asarray(y_b, np.float64) - ref_b) <= bound_b)
