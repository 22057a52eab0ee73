"""fp8_matmul's support checks (what each kernel accepts, and the reason it names when it does
not), the ``auto`` dispatch and its one-line fallback, and the operand errors
(``test_fp8_matmul.py``: the implementations' numerics)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import aot
from kernels_pallas.fp8_matmul import (
    IMPLEMENTATIONS,
    MgpuConfig,
    TpuConfig,
    fp8_matmul,
    fp8_matmul_reference,
)
from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.qarray import QArray
from kernels_pallas.quantize import quantize_activations, quantize_blockwise, quantize_weight

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _on(target: str):
    """Support checks read the target from an abstract mesh (no plugin, nothing compiled)."""
    return jax.sharding.use_abstract_mesh(aot.abstract_mesh(target))


def _operands(m, k, n):
    """x [M, K] in 1x128 groups and w as its [N, K] 128x128-block QArray (random normals)."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    return quantize_activations(x), quantize_weight(jax.random.normal(kw, (k, n), jnp.float32))


def _supports(impl, x, wq, config=None, out_dtype=jnp.bfloat16, interpret=False):
    return IMPLEMENTATIONS.impls[impl].supports(
        x, wq, config=config, out_dtype=jnp.dtype(out_dtype), interpret=interpret
    )


def _sds_q(m, k, n, dtype=E4M3, w_block=(128, 128)):
    sds = jax.ShapeDtypeStruct
    x = QArray(sds((m, k), dtype), sds((m, -(-k // 128)), jnp.float32), (128,), jnp.bfloat16)
    nb, kb = -(-n // w_block[0]), -(-k // w_block[1])
    w = QArray(sds((n, k), dtype), sds((nb, kb), jnp.float32), w_block, jnp.bfloat16)
    return x, w


def test_mosaic_gpu_support_check():
    with _on("h100"):
        assert _supports("pallas_mosaic_gpu", *_sds_q(16, 4096, 4096)) is None
        assert _supports("pallas_mosaic_gpu", *_sds_q(4096, 4096, 12288, E5M2)) is None
        bf16_x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
        assert _supports("pallas_mosaic_gpu", bf16_x, _sds_q(1, 4096, 4096)[1]) is None
        rejects = {
            "K=200": _sds_q(16, 200, 256),
            "N=200 must be a multiple of block_n=64": _sds_q(256, 256, 200),
            "blocks must be": _sds_q(16, 256, 256, w_block=(64, 128)),
        }
        for reason, ops in rejects.items():
            assert reason in _supports("pallas_mosaic_gpu", *ops)
        x8, _ = _sds_q(16, 256, 256, E5M2)
        assert "formats differ" in _supports("pallas_mosaic_gpu", x8, _sds_q(16, 256, 256)[1])
        big = MgpuConfig(block_m=128, block_n=128, max_concurrent_steps=4)  # fused: 247872 B
        assert "SMEM" in _supports("pallas_mosaic_gpu", bf16_x, _sds_q(1, 4096, 4096)[1], big)
        deep = MgpuConfig(block_m=32, block_n=64, max_concurrent_steps=8, swap_ab=True)
        assert "max_concurrent_steps" in _supports(
            "pallas_mosaic_gpu", *_sds_q(16, 4096, 4096), deep
        )
        swap = MgpuConfig(block_m=32, block_n=64, swap_ab=True)
        fused_swap = mgpu.supports(16, 4096, 4096, swap, fused=True, x_itemsize=2, out_itemsize=2)
        assert fused_swap is None  # raw x with a swap config: quantized in-kernel (decode)
        # 8- and 16-row swap tiles: their 32/64-B stages of f32 x scales break TMA's 128-B SMEM
        # alignment (CUDA_ERROR_MISALIGNED_ADDRESS on an H200); 8 rows run in a 32-row tile
        for small in (MgpuConfig(8, 64, swap_ab=True), MgpuConfig(16, 64, swap_ab=True, split_k=2)):
            assert "of 32 with FP8 x" in _supports("pallas_mosaic_gpu", *_sds_q(8, 256, 256),
                                                   small)  # fmt: skip
        assert "MgpuConfig" in _supports("pallas_mosaic_gpu", *_sds_q(16, 256, 256), TpuConfig())
    assert "Hopper" in _supports("pallas_mosaic_gpu", *_sds_q(16, 256, 256))  # CPU target
    assert _supports("pallas_mosaic_gpu", *_sds_q(16, 256, 256), interpret=True) is None


def test_tpu_support_check():
    with _on("v6e"):
        assert _supports("pallas_tpu", *_sds_q(1, 28672, 8192)) is None
        assert "N=200" in _supports("pallas_tpu", *_sds_q(16, 256, 200))
        assert "K=200" in _supports("pallas_tpu", *_sds_q(16, 200, 256))
        assert "block_m" in _supports("pallas_tpu", *_sds_q(16, 256, 256), TpuConfig(block_m=48))
    assert "needs a TPU" in _supports("pallas_tpu", *_sds_q(16, 256, 256))


def test_auto_takes_the_kernel_or_falls_back_with_one_log_line(caplog):
    with _on("h100"):
        pick = lambda *ops: (
            IMPLEMENTATIONS.select(
                "auto", *ops, config=None, out_dtype=jnp.dtype(jnp.bfloat16)
            ).name
        )
        assert pick(*_sds_q(16, 4096, 4096)) == "pallas_mosaic_gpu"
        with caplog.at_level(logging.WARNING, logger="kernels_pallas.backend"):
            assert pick(*_sds_q(16, 4096, 4000)) == "xla"
            assert pick(*_sds_q(16, 4096, 4000)) == "xla"
    lines = [r.getMessage() for r in caplog.records if "N=4000" in r.getMessage()]
    assert len(lines) == 1 and "falling back to xla" in lines[0]
    # On this CPU machine auto is the XLA implementation whatever the shape.
    xq, wq = _operands(4, 256, 200)
    assert IMPLEMENTATIONS.select("auto", xq, wq, config=None, out_dtype=jnp.float32).name == "xla"
    y = fp8_matmul(xq, wq, out_dtype=jnp.float32)
    np.testing.assert_array_equal(y, fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))


def test_explicit_unsupported_impl_raises_with_the_reason():
    xq, wq = _operands(4, 256, 200)
    with pytest.raises(ValueError, match="pallas_mosaic_gpu.*N=200"):
        fp8_matmul(xq, wq, impl="pallas_mosaic_gpu", interpret=True)
    with pytest.raises(ValueError, match="pallas_tpu.*N=200"):
        fp8_matmul(xq, wq, impl="pallas_tpu", interpret=True)
    with pytest.raises(ValueError, match="Hopper"):
        fp8_matmul(xq, quantize_weight(jnp.ones((256, 256))), impl="pallas_mosaic_gpu")


def test_operand_errors():
    xq, wq = _operands(4, 256, 128)
    with pytest.raises(ValueError, match="unknown impl"):
        fp8_matmul(xq, wq, impl="cuda")
    with pytest.raises(ValueError, match="contracting dims differ"):
        fp8_matmul(quantize_activations(jnp.ones((4, 384))), wq, impl="xla")
    with pytest.raises(ValueError, match="contracting dims differ"):  # raw x, same check
        fp8_matmul(jnp.ones((4, 128)), wq, impl="pallas_mosaic_gpu", interpret=True)
    with pytest.raises(ValueError, match="group"):
        fp8_matmul(quantize_activations(jnp.ones((4, 256)), 64), wq, impl="xla")
    with pytest.raises(ValueError, match="QArray"):
        fp8_matmul(xq, jnp.ones((128, 256)), impl="xla")
    bad_x = QArray(xq.values.astype(jnp.int8), xq.scales, xq.block_shape, xq.dtype)
    with pytest.raises(ValueError, match="FP8"):
        fp8_matmul(bad_x, wq, impl="xla")
    bad_s = QArray(xq.values, xq.scales.astype(jnp.bfloat16), xq.block_shape, xq.dtype)
    with pytest.raises(ValueError, match="float32"):
        fp8_matmul(bad_s, wq, impl="xla")
    with pytest.raises(ValueError, match="formats differ"):
        mgpu.fp8_matmul_mgpu(xq, quantize_weight(jnp.ones((256, 128)), dtype=E5M2))
    with pytest.raises(ValueError, match="BF16"):
        mgpu.fp8_matmul_mgpu_fused(jnp.ones((4, 256)), wq)
    w_kn = quantize_blockwise(jnp.ones((256, 128)))  # a [K, N] QArray: the old, wrong layout
    with pytest.raises(ValueError, match=r"w_q is \[N, K\]"):
        fp8_matmul(xq, w_kn, impl="xla")
