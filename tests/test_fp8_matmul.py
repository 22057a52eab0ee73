"""fp8_matmul: reference vs float64, Pallas kernels vs reference (CPU interpret), dispatcher.

Interpret modes: the Mosaic GPU kernel runs under ``plgpu.InterpretGPUParams`` (SMEM, TMA, barriers
and warpgroups simulated on CPU; every CTA of the grid runs, M=256/N=256 gives a 2x2 grid), the TPU
kernel under the generic HLO interpreter (``interpret=True``) and ``pltpu.InterpretParams``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.fp8_matmul import fp8_matmul, fp8_matmul_reference
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.fp8_matmul import pallas_tpu as tpu
from kernels_pallas.qarray import QArray, dequantize
from kernels_pallas.quantize import quantize_activations, quantize_blockwise

_EPS = {jnp.float8_e4m3fn: 2.0**-4, jnp.float8_e5m2: 2.0**-3}  # half-ulp relative error, normals
_SUB = {jnp.float8_e4m3fn: 2.0**-10, jnp.float8_e5m2: 2.0**-17}  # half subnormal spacing


def _operands(m, k, n, dtype=jnp.float8_e4m3fn, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32)
    return x, w, quantize_activations(x, 128, dtype), quantize_blockwise(w, (128, 128), dtype)


def _rel_fro(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("m,k,n", [(16, 512, 256), (3, 1024, 128)])
def test_reference_against_float64(m, k, n, dtype):
    x, w, xq, wq = _operands(m, k, n, dtype)
    y = fp8_matmul_reference(xq, wq, out_dtype=jnp.float32)
    xd, wd = np.asarray(dequantize(xq), np.float64), np.asarray(dequantize(wq), np.float64)
    assert _rel_fro(y, xd @ wd) < 1e-5  # FP32 accumulation of exactly dequantized inputs

    # Against the unquantized product: x̂ = x + dx with |dx| <= eps|x| + s_x*sub (RNE, incl.
    # subnormals), the same for w, so |ŷ - y| <= |dx|@|w| + |x|@|dw| + |dx|@|dw| elementwise.
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    sx = np.repeat(np.asarray(xq.scales, np.float64), 128, axis=1)
    sw = np.repeat(np.repeat(np.asarray(wq.scales, np.float64), 128, 0), 128, 1)
    dx = _EPS[dtype] * np.abs(x64) + _SUB[dtype] * sx
    dw = _EPS[dtype] * np.abs(w64) + _SUB[dtype] * sw
    bound = dx @ np.abs(w64) + np.abs(x64) @ dw + dx @ dw
    err = np.abs(np.asarray(y, np.float64) - x64 @ w64)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-5 * np.abs(x64) @ np.abs(w64))
    # Statistically the rounding errors are independent and zero-mean, so the relative Frobenius
    # error is the RMS relative error of one product, about sqrt(2) * 0.025 ~ 0.035 for E4M3
    # (twice that for E5M2); the asserted values leave a ~1.7x margin.
    rel = _rel_fro(y, x64 @ w64)
    print(f"rel Frobenius error vs unquantized ({jnp.dtype(dtype).name}): {rel:.4f}")
    assert rel < {jnp.float8_e4m3fn: 0.06, jnp.float8_e5m2: 0.12}[dtype]


def _tol(out_dtype, ref):
    scale = float(jnp.max(jnp.abs(ref)))
    if out_dtype == jnp.float32:  # only the f32 summation order differs
        return dict(rtol=1e-5, atol=1e-5 * scale)
    return dict(rtol=2**-7, atol=2**-8 * scale)  # one BF16 rounding of a slightly different f32


def _mgpu(xq, wq, out_dtype, **kw):
    return mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=out_dtype, interpret=True, **kw)


_GRID = [(m, k, n) for m in (1, 16, 128, 256) for k, n in ((128, 128), (256, 256))]


@pytest.mark.parametrize("m,k,n", _GRID)
def test_mosaic_gpu_kernel_matches_reference(m, k, n):
    _, _, xq, wq = _operands(m, k, n, seed=m + k)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        ref = fp8_matmul_reference(xq, wq, out_dtype=jnp.float32)
        y = _mgpu(xq, wq, out_dtype)
        assert y.shape == (m, n) and y.dtype == out_dtype
        np.testing.assert_allclose(np.asarray(y, np.float32), ref, **_tol(out_dtype, ref))


def test_mosaic_gpu_kernel_64_row_config_and_e5m2():
    _, _, xq, wq = _operands(80, 384, 128, jnp.float8_e5m2)
    ref = fp8_matmul_reference(xq, wq, out_dtype=jnp.float32)
    cfg = mgpu.MgpuConfig(block_m=64, block_n=128, max_concurrent_steps=2)
    np.testing.assert_allclose(
        _mgpu(xq, wq, jnp.float32, config=cfg), ref, **_tol(jnp.float32, ref)
    )


@pytest.mark.parametrize("m", [1, 130])
def test_mosaic_gpu_fused_activation_quantization(m):
    x, w, _, wq = _operands(m, 256, 128, seed=7)
    x = x.astype(jnp.bfloat16)
    ref = fp8_matmul_reference(quantize_activations(x), wq, out_dtype=jnp.float32)
    y = mgpu.fp8_matmul_mgpu_fused(x, wq, out_dtype=jnp.float32, interpret=True)
    np.testing.assert_allclose(y, ref, **_tol(jnp.float32, ref))
    y2 = fp8_matmul(x, wq, out_dtype=jnp.float32, impl="pallas_mosaic_gpu", interpret=True)
    np.testing.assert_allclose(y2, ref, **_tol(jnp.float32, ref))


@pytest.mark.parametrize("m,k,n", _GRID + [(40, 1024, 128)])
def test_tpu_kernel_matches_reference(m, k, n):
    _, _, xq, wq = _operands(m, k, n, seed=m + k)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        ref = fp8_matmul_reference(xq, wq, out_dtype=jnp.float32)
        y = tpu.fp8_matmul_tpu(xq, wq, out_dtype=out_dtype, interpret=True)
        assert y.shape == (m, n) and y.dtype == out_dtype
        np.testing.assert_allclose(np.asarray(y, np.float32), ref, **_tol(out_dtype, ref))


def test_tpu_kernel_interpret_params_and_small_block_k():
    _, _, xq, wq = _operands(48, 384, 256, seed=3)
    ref = fp8_matmul_reference(xq, wq, out_dtype=jnp.float32)
    cfg = tpu.TpuConfig(block_m=32, block_k=256)  # K=384 is no multiple of 256: falls back to 128
    y = tpu.fp8_matmul_tpu(
        xq, wq, out_dtype=jnp.float32, interpret=pltpu.InterpretParams(), config=cfg
    )
    np.testing.assert_allclose(y, ref, **_tol(jnp.float32, ref))


@pytest.mark.parametrize("impl", ["xla", "pallas_mosaic_gpu", "pallas_tpu"])
def test_dispatcher_leading_dims_and_raw_x(impl):
    x = jax.random.normal(jax.random.key(8), (2, 3, 256), jnp.float32)
    wq = quantize_blockwise(jax.random.normal(jax.random.key(9), (256, 128), jnp.float32))
    ref = fp8_matmul_reference(quantize_activations(x.reshape(6, 256)), wq, out_dtype=jnp.float32)
    y = fp8_matmul(x, wq, out_dtype=jnp.float32, impl=impl, interpret=True)
    assert y.shape == (2, 3, 128)
    np.testing.assert_allclose(y.reshape(6, 128), ref, **_tol(jnp.float32, ref))
    yq = fp8_matmul(quantize_activations(x), wq, out_dtype=jnp.bfloat16, impl=impl, interpret=True)
    assert yq.shape == (2, 3, 128) and yq.dtype == jnp.bfloat16


def test_dispatcher_errors():
    _, _, xq, wq = _operands(4, 256, 128)
    with pytest.raises(ValueError, match="unknown impl"):
        fp8_matmul(xq, wq, impl="cuda")
    with pytest.raises(ValueError, match="contracting"):
        fp8_matmul(quantize_activations(jnp.ones((4, 384))), wq, impl="xla")
    with pytest.raises(ValueError, match="group"):
        fp8_matmul(quantize_activations(jnp.ones((4, 256)), 64), wq, impl="xla")
    with pytest.raises(ValueError, match="QArray"):
        fp8_matmul(xq, jnp.ones((256, 128)), impl="xla")
    bad_x = QArray(xq.values.astype(jnp.int8), xq.scales, xq.block_shape, xq.dtype)
    with pytest.raises(ValueError, match="FP8"):
        fp8_matmul(bad_x, wq, impl="xla")
    bad_s = QArray(xq.values, xq.scales.astype(jnp.bfloat16), xq.block_shape, xq.dtype)
    with pytest.raises(ValueError, match="float32"):
        fp8_matmul(bad_s, wq, impl="xla")


def test_kernel_shape_errors():
    _, _, xq, _ = _operands(4, 256, 128)
    w64 = quantize_blockwise(jnp.ones((256, 128)), (64, 128))
    with pytest.raises(ValueError, match="blocks"):
        mgpu.fp8_matmul_mgpu(quantize_activations(jnp.ones((4, 256)), 64), w64, interpret=True)
    with pytest.raises(ValueError, match="blocks"):
        tpu.fp8_matmul_tpu(quantize_activations(jnp.ones((4, 256)), 64), w64, interpret=True)
    w_tail = quantize_blockwise(jnp.ones((256, 200)))
    with pytest.raises(ValueError, match="N=200"):
        mgpu.fp8_matmul_mgpu(xq, w_tail, interpret=True)
    with pytest.raises(ValueError, match="N=200"):
        tpu.fp8_matmul_tpu(xq, w_tail, interpret=True)
    x_tail = quantize_activations(jnp.ones((4, 200)))
    w_ktail = quantize_blockwise(jnp.ones((200, 128)))
    with pytest.raises(ValueError, match="K=200"):
        mgpu.fp8_matmul_mgpu(x_tail, w_ktail, interpret=True)
    with pytest.raises(ValueError, match="formats differ"):
        mgpu.fp8_matmul_mgpu(xq, quantize_blockwise(jnp.ones((256, 128)), dtype=jnp.float8_e5m2))
    with pytest.raises(ValueError, match="block_m"):
        mgpu.fp8_matmul_mgpu(
            xq, quantize_blockwise(jnp.ones((256, 128))), config=mgpu.MgpuConfig(96)
        )
    with pytest.raises(ValueError, match="BF16"):
        mgpu.fp8_matmul_mgpu_fused(jnp.ones((4, 256)), quantize_blockwise(jnp.ones((256, 128))))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 512])
def test_mosaic_gpu_kernel_on_hopper(m):
    x, _, xq, wq = _operands(m, 1024, 512, seed=11)
    ref = fp8_matmul_reference(xq, wq, out_dtype=jnp.float32)
    y = fp8_matmul(xq, wq, out_dtype=jnp.bfloat16, impl="pallas_mosaic_gpu")
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, **_tol(jnp.bfloat16, ref))
    xb = x.astype(jnp.bfloat16)
    ref_b = fp8_matmul_reference(quantize_activations(xb), wq, out_dtype=jnp.float32)
    y_b = fp8_matmul(xb, wq, out_dtype=jnp.float32, impl="pallas_mosaic_gpu")  # fused quant
    np.testing.assert_allclose(y_b, ref_b, **_tol(jnp.float32, ref_b))


@pytest.mark.tpu
def test_tpu_kernel_on_tpu():
    _, _, xq, wq = _operands(256, 1024, 512, seed=12)
    ref = fp8_matmul_reference(xq, wq, out_dtype=jnp.float32)
    y = fp8_matmul(xq, wq, out_dtype=jnp.float32, impl="pallas_tpu")
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(ref))))


def test_gpu_interpret_under_abstract_h100_mesh():
    """The documented CPU test route for Mosaic GPU kernels (forced interpret + abstract H100)."""
    _, _, xq, wq = _operands(16, 256, 128, seed=13)
    device = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=8
    )
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
    with (
        jax.sharding.use_abstract_mesh(mesh),
        plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()),
    ):
        y = mgpu.fp8_matmul_mgpu(xq, wq, out_dtype=jnp.float32)
    ref = fp8_matmul_reference(xq, wq, out_dtype=jnp.float32)
    np.testing.assert_allclose(y, ref, **_tol(jnp.float32, ref))
