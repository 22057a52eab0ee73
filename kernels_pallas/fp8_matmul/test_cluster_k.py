"""In-cluster split-K of the Hopper fp8_matmul (``MgpuConfig.cluster_k``, ``mgpu_cluster_k.py``):
the owner/slot map, the chunks summed in GPU interpret mode (through its GMEM stand-in for the
SM-to-SM network) against the reference, and (``-m gpu``) the DSMEM path on a device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.fp8_matmul import fp8_matmul_reference
from kernels_pallas.fp8_matmul import mgpu_cluster_k as cluster_k
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.fp8_matmul.mgpu_config import MgpuConfig
from kernels_pallas.quantize import quantize_activations, quantize_weight

E4M3 = jnp.float8_e4m3fn


def _operands(m, k, n, seed):
    """x̂ [M, K] (1x128 groups) and ŵ [N, K] (128x128 blocks), the weight blocks' columns 10x
    apart in magnitude: a chunk summed into the wrong tile or warpgroup fails."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32)
    w = w * jnp.repeat(10.0 ** jnp.arange(n // 128), 128)[None, :]
    return quantize_activations(x, 128, E4M3), quantize_weight(w, (128, 128), E4M3)


@pytest.mark.parametrize("split", [2, 3, 4, 8])
@pytest.mark.parametrize("nwg", [1, 2])
def test_mosaic_gpu_cluster_k_roles(split, nwg):
    """In-cluster split-K (``cluster_k``): for every warpgroup tile, one owner CTA (``wg %
    split``) and the other chunks' slots are exactly 0 .. split - 2, distinct (the owner's
    barrier counts split - 1 stores); no CTA owns more than ceil(nwg / split) tiles."""
    owned = [0] * split
    for wg in range(nwg):
        roles = [cluster_k.cluster_roles(kp, wg, split) for kp in range(split)]
        owner = roles[0][0]
        assert owner == wg % split and all(o == owner for o, _ in roles)
        assert sorted(int(s) for kp, (_, s) in enumerate(roles) if kp != owner) == \
            list(range(split - 1))  # fmt: skip
        owned[owner] += 1
    assert max(owned) == -(-nwg // split)


@pytest.mark.parametrize(
    "cfg,m,out",
    [  # 3 chunks, two warpgroups (owners CTA 0 and 1), y written by the owners; one warpgroup,
        # f32 out (yᵀ); 2 chunks of 128-row tiles, two M tiles (the second a tail)
        (MgpuConfig(32, 128, 2, swap_ab=True, split_k=3, cluster_k=True), 9, jnp.bfloat16),
        (MgpuConfig(32, 64, 2, swap_ab=True, split_k=3, cluster_k=True), 16, jnp.float32),
        (MgpuConfig(128, 128, 2, swap_ab=True, split_k=3, cluster_k=True), 200, jnp.bfloat16),
    ],
)
def test_mosaic_gpu_cluster_k_sums_the_chunks(cfg, m, out):
    """K chunks summed in their cluster (``cluster_k``). GPU interpret mode has no DSMEM store
    (``async_store_smem``): there each chunk's accumulator passes through a GMEM buffer and a
    cluster barrier into its owner's SMEM slot, and the owner sums and stores as on the GPU
    (same roles, slots, order). Weight blocks 10x apart: a chunk summed into the wrong tile or
    warpgroup fails. The DSMEM path itself is checked by the deviceless H100 compile
    (``aot_cases.TILES``: st.async into the owner's slot, 128 arrivals per sending warpgroup) and,
    on a device, by ``-m gpu``."""
    xq, wq = _operands(m, 384, 256, seed=9)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    y = mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=out, interpret=True, config=cfg)
    assert y.shape == (m, 256) and y.dtype == out
    rtol = 2**-7 if out == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=rtol,
                               atol=1e-5 * np.max(np.abs(ref)))  # fmt: skip
    assert mgpu._stores_y(cfg, jnp.bfloat16) and not mgpu._stores_y(cfg, jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg,m",
    [  # the decode default's 2 chunks (32 and 64 rows, two 128-row M tiles), and 8 chunks
        (MgpuConfig(32, 128, 4, swap_ab=True, split_k=2, cluster_k=True), 16),
        (MgpuConfig(64, 128, 4, swap_ab=True, split_k=2, cluster_k=True), 64),
        (MgpuConfig(128, 128, 3, swap_ab=True, split_k=2, cluster_k=True), 200),
        (MgpuConfig(32, 128, 4, swap_ab=True, split_k=8, cluster_k=True), 5),
    ],
)
def test_mosaic_gpu_cluster_k_on_hopper(cfg, m):
    """On the device, the DSMEM path interpret mode cannot run (``st.async`` into the summing
    CTA's SMEM): F32 out within the Hopper FP8 accumulation bound, BF16 out (y written by the
    summing CTAs) that rounded."""
    from kernels_pallas.fp8_matmul import hopper_fp8_numerics as hw

    xq, wq = _operands(m, 4096, 1024, seed=13)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    f64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
    ops = f64(xq.values), np.asarray(xq.scales), f64(wq.values), np.asarray(wq.scales)
    bound = hw.device_bound(*ops)
    y = mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.float32, config=cfg)
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= bound)
    y16 = mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.bfloat16, config=cfg)
    assert np.all(np.abs(np.asarray(y16, np.float64) - ref) <= bound + 2**-8 * np.abs(ref))
