"""Several 128-K slices per pipeline step in the Hopper fp8_matmul: the prefill tiles'
promotions under the next slice's wgmma (``MgpuConfig.overlap``, ``mgpu_k_step.k_pair_overlap``)
and the decode tiles' two- or four-slice stages (``MgpuConfig.k_slices``). Each gives the bits
of one slice per step (interpret mode here, ``-m gpu`` on a device), its legality rules, and
the default dispatch reaching it."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.fp8_matmul import fp8_matmul, fp8_matmul_reference
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.fp8_matmul.mgpu_config import MgpuConfig
from kernels_pallas.quantize import quantize_activations, quantize_weight

E4M3 = jnp.float8_e4m3fn


def _operands(m, k, n, seed):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32)
    return x, w, quantize_activations(x, 128, E4M3), quantize_weight(w, (128, 128), E4M3)


def _weighted(m, k, n, seed):
    """``_operands`` with the weight's 128x128 blocks 10x apart in magnitude along K and N: a
    slice promoted with a neighbouring slice's (or block's) scale differs by far more than
    rounding."""
    x, w, _, _ = _operands(m, k, n, seed)
    w = w * 10.0 ** (jnp.arange(k) // 128 % 3)[:, None] \
        * jnp.repeat(10.0 ** (jnp.arange(-(-n // 128)) % 2), 128)[None, :n]  # fmt: skip
    return x, w, quantize_activations(x, 128, E4M3), quantize_weight(w, (128, 128), E4M3)


@pytest.mark.parametrize(
    "cfg,m,n",
    [
        (MgpuConfig(128, 128, 2, overlap=True), 200, 256),  # 2 M tiles (the second a tail)
        (MgpuConfig(128, 128, 2, cluster_m=2, overlap=True), 300, 256),  # 2 clusters x 2 N tiles
        (MgpuConfig(64, 128, 3, overlap=True), 72, 128),  # one compute warpgroup
        (MgpuConfig(128, 64, 3, cluster_m=2, overlap=True), 130, 192),  # N % 128 != 0
    ],
)
def test_mosaic_gpu_overlapped_promotion_equals_the_plain_kernel(cfg, m, n):
    """``MgpuConfig.overlap`` (each step's promotion under the next step's wgmma, the step's
    scales carried to it) promotes every 128-K product with its own step's scales in the same
    order as the plain kernel: the outputs are equal bit for bit. Weight blocks differ 10x in
    magnitude along K and N, so a product promoted with a neighbouring step's (or block's) scale
    would differ by far more than rounding; 7 slices (3.5 steps: K = 896 is not a multiple of
    256) are rejected, 8 (4 steps) run through a 2-3 slot ring; the reference bounds both."""
    x, w, xq, wq = _weighted(m, 1024, n, seed=11)
    plain = dataclasses.replace(cfg, overlap=False)
    with pytest.raises(ValueError, match="multiple of 256"):
        mgpu.fp8_matmul_mgpu(quantize_activations(x[:, :896], 128, E4M3),
                             quantize_weight(w[:896], (128, 128), E4M3), interpret=True,
                             config=cfg)  # fmt: skip
    y = mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.float32, interpret=True, config=cfg)
    y0 = mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.float32, interpret=True, config=plain)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))


@pytest.mark.parametrize(
    "cfg,m,n,out",
    [
        (MgpuConfig(32, 128, 2, swap_ab=True, k_slices=2), 5, 256, jnp.float32),  # 2 WGs, 4 steps
        (MgpuConfig(32, 64, 3, swap_ab=True, k_slices=4), 40, 128, jnp.bfloat16),  # 2 steps, y
        # K split in 2 (f32 partials summed by XLA) and in-cluster; 2 M tiles, the second a tail
        (MgpuConfig(64, 64, 2, swap_ab=True, split_k=2, k_slices=2), 100, 192, jnp.float32),
        (
            MgpuConfig(32, 128, 2, swap_ab=True, split_k=2, cluster_k=True, k_slices=4),
            16,
            256,
            jnp.bfloat16,
        ),
    ],
)
def test_mosaic_gpu_swap_k_slices_equal_one_slice_per_step(cfg, m, n, out):
    """Swap-AB tiles with ``k_slices`` 128-K slices per pipeline step (256-512 B of every
    weight row per TMA stage) promote each slice with its own x and weight scales in the same
    order as one slice per step: the outputs are equal bit for bit. Weight blocks differ 10x
    in magnitude along K and N, so a slice promoted with a neighbour's scale would show; K =
    640 (5 slices) is rejected, with the reason."""
    _, _, xq, wq = _weighted(m, 1024, n, seed=13)
    run = functools.partial(mgpu.fp8_matmul_mgpu, xq, wq, out_dtype=out, interpret=True)
    y, y0 = run(config=cfg), run(config=dataclasses.replace(cfg, k_slices=1))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    tol = 1e-5 if out == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=tol,
                               atol=1e-5 * np.max(np.abs(ref)))  # fmt: skip
    assert "must divide the 5" in mgpu.supports(
        m, 640, n, cfg, fused=False, x_itemsize=1, out_itemsize=2)  # fmt: skip


def test_k_slices_config_legality():
    """``k_slices`` takes 1, 2 or 4 slices on swap-AB tiles only (the prefill tiles' two slices
    per step are ``overlap``); the ring's SMEM grows with the slices (x, weight and x-scale
    stages), so the deepest ring of 128-row tiles stops fitting."""
    assert MgpuConfig(32, 128, 4, swap_ab=True, k_slices=2).invalid() is None
    for bad in (MgpuConfig(32, 128, 4, swap_ab=True, k_slices=3),
                MgpuConfig(128, 128, 4, k_slices=2)):  # fmt: skip
        assert "k_slices" in bad.invalid()
    one, two = (MgpuConfig(64, 128, 4, swap_ab=True, k_slices=s) for s in (1, 2))
    assert mgpu.smem_bytes(two, 4096, 1, 2, False) - mgpu.smem_bytes(one, 4096, 1, 2, False) == \
        4 * (64 * 128 + 128 * 128 + 64 * 4)  # fmt: skip
    deep = MgpuConfig(128, 128, 6, swap_ab=True, k_slices=4)
    assert "SMEM" in mgpu.supports(128, 4096, 4096, deep, fused=False, x_itemsize=1,
                                   out_itemsize=2)  # fmt: skip


def test_default_dispatch_reaches_the_overlapped_tiles():
    """``fp8_matmul``'s default on a prefill grid that clusters (2 M tiles x 44 N tiles = 88
    CTAs) runs the overlapped tiles through the API (M = 200 padded to the cluster's 256 rows;
    QArray x with F32 out, BF16 x quantized by the API with BF16 out) and matches the
    reference (BF16 out: within one BF16 rounding of it)."""
    m, k, n = 200, 256, 5632
    assert mgpu.default_config(m, n, k).overlap
    x, w, _, _ = _operands(m, k, n, seed=17)
    xq, wq = quantize_activations(x, 128, E4M3), quantize_weight(w, (128, 128), E4M3)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    y = fp8_matmul(xq, wq, out_dtype=jnp.float32, impl="pallas_mosaic_gpu", interpret=True)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))
    xb = x.astype(jnp.bfloat16)
    ref_b = np.asarray(fp8_matmul_reference(quantize_activations(xb, 128, E4M3), wq,
                                            out_dtype=jnp.float32))  # fmt: skip
    y_b = fp8_matmul(xb, wq, out_dtype=jnp.bfloat16, impl="pallas_mosaic_gpu", interpret=True)
    np.testing.assert_allclose(np.asarray(y_b, np.float32), ref_b, rtol=2**-7,
                               atol=1e-5 * np.max(np.abs(ref_b)))  # fmt: skip


def test_overlap_config_legality():
    """The overlapped promotion needs one sub-tile per warpgroup (the pending 64x128 product
    beside the running and fresh accumulators would not fit the wide tiles' registers), a
    prefill tile, no persistent grid and FP8 x (no fused BF16-x variant)."""
    ok = MgpuConfig(128, 128, 4, cluster_m=2, overlap=True)
    assert ok.invalid() is None
    for bad in (
        MgpuConfig(128, 256, 3, overlap=True),
        MgpuConfig(256, 128, 3, overlap=True),
        MgpuConfig(64, 128, 4, swap_ab=True, overlap=True),
        MgpuConfig(128, 128, 4, persistent=132, overlap=True),
    ):
        assert "overlap" in bad.invalid()
    alone = MgpuConfig(128, 128, 3, overlap=True)  # no cluster: the fused kernel has none
    assert "overlap" in mgpu.supports(4096, 4096, 4096, alone, fused=True, x_itemsize=2,
                                      out_itemsize=2)  # fmt: skip
    three = dataclasses.replace(ok, max_concurrent_steps=3)  # 3 x 64 KiB of tiles: the deepest
    assert mgpu.supports(4096, 4096, 4096, three, fused=False, x_itemsize=1, out_itemsize=2) is None
    assert "SMEM" in mgpu.supports(4096, 4096, 4096, ok, fused=False, x_itemsize=1,
                                   out_itemsize=2)  # fmt: skip


@pytest.mark.gpu
def test_overlapped_prefill_default_on_hopper_equals_the_plain_tiles():
    """On the device: the prefill default with promotions under the wgmmas (128x128 in 2-CTA
    clusters) gives the bits of the tiles before it (128x256): each element's products are
    promoted with the same scales in the same K order, and both run m64n128k32 wgmmas."""
    m, k, n = 2048, 4096, 4096
    _, _, xq, wq = _operands(m, k, n, seed=13)
    cfg, plain = (mgpu.default_config(m, n, k, overlap=o) for o in (True, False))
    assert cfg.overlap and cfg.cluster_m == 2 and not plain.overlap and plain.block_n == 256
    y, y0 = (mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.bfloat16, config=c) for c in (cfg, plain))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(16, 4096), (64, 6144)])
def test_two_slice_decode_default_on_hopper_equals_one_slice_per_step(m, n):
    """On the device: the decode default with two 128-K slices per pipeline step gives the bits
    of one slice per step (the same m64nMk32 wgmmas, each slice promoted with its own scales in
    the same K order; o_proj-shaped: 2 K chunks summed in-cluster; q|k|v-shaped: 64-row tiles)."""
    k = 4096
    _, _, xq, wq = _operands(m, k, n, seed=19)
    cfg, one = (mgpu.default_config(m, n, k, k_slices=s) for s in (True, False))
    assert (cfg.k_slices, one.k_slices) == (2, 1) and cfg.swap_ab
    y, y0 = (mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.bfloat16, config=c) for c in (cfg, one))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))
