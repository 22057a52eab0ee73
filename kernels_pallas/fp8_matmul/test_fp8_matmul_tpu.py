"""The TPU kernel's own designs in interpret mode (the shared implementation grid, support checks
and dispatch are in ``test_fp8_matmul.py``): a small K step, wide tiles with FP8 fed to the dot
and two K groups per 256-deep dot, the ``dequant_bf16`` deep dot of v6e prefill tiles and its
error bound, and the per-shape plans."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.fp8_matmul import TpuConfig, fp8_matmul_reference
from kernels_pallas.fp8_matmul import pallas_tpu as tpu
from kernels_pallas.fp8_matmul.test_fp8_matmul import _operands
from kernels_pallas.qarray import QArray, dequantize
from kernels_pallas.quantize import quantize_activations, quantize_weight


def test_tpu_interpret_params_and_small_block_k():
    _, _, xq, wq = _operands(48, 384, 256, seed=3)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    cfg = TpuConfig(block_m=32, block_k=256)  # K=384 is no multiple of 256: falls back to 128
    y = tpu.fp8_matmul_tpu(
        xq, wq, out_dtype=jnp.float32, interpret=pltpu.InterpretParams(), config=cfg
    )
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))


@pytest.mark.parametrize(
    "m,k,n,cfg",
    [  # two K groups per 256-deep dot (block-diagonal x), FP8 into the dot, 2 K steps, N=384;
        # 3 M x 2 N tiles x 2 K steps with FP8 into the dot
        (40, 512, 384, TpuConfig(block_n=384, block_k=256, compute_dtype="native", pack=2)),
        (72, 512, 512, TpuConfig(block_m=32, block_n=256, block_k=256, compute_dtype="native")),
    ],
)
def test_tpu_wide_tiles_native_fp8_and_packed_groups(m, k, n, cfg):
    _, _, xq, wq = _operands(m, k, n, seed=11)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    y = tpu.fp8_matmul_tpu(xq, wq, out_dtype=jnp.float32, interpret=True, config=cfg)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))


@pytest.mark.parametrize("pow2", [True, False])
def test_tpu_dequant_bf16_deep_dot(pow2):
    """compute_dtype="dequant_bf16" (v6e prefill): x̂·s_x and ŵ·s_w rounded to BF16, one 256-deep
    dot per step over 2 N x 2 M tiles and 2 K steps. Power-of-two scales: exact products, so
    the reference's result up to f32 summation order. Other scales: each operand element's
    BF16 rounding is <= 2^-9 relative, so |y - ref| <= 2^-8 (|x̂ s_x| · |ŵ s_w|ᵀ) + f32 slack."""
    m, k, n = 96, 512, 256
    x, w, xq, _ = _operands(m, k, n, seed=5)
    x = x * jnp.exp(jax.random.normal(jax.random.key(6), (m, 1)))  # rows of different scale
    xq = quantize_activations(x, 128)
    wq = quantize_weight(w, (128, 128), pow2_scales=pow2)
    if pow2:
        xq = QArray(xq.values, 2.0 ** jnp.ceil(jnp.log2(xq.scales)), xq.block_shape, xq.dtype)
    cfg = TpuConfig(block_m=64, block_n=128, block_k=256, compute_dtype="dequant_bf16")
    assert tpu.plan(m, k, n, cfg, fp8_mxu=False).dequant
    y = np.asarray(tpu.fp8_matmul_tpu(xq, wq, out_dtype=jnp.float32, interpret=True, config=cfg))
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32), np.float64)
    xd = np.abs(np.asarray(dequantize(xq), np.float64))
    wd = np.abs(np.asarray(dequantize(wq), np.float64))
    mag = xd @ wd.T  # Σ_k |x_k w_k|
    err = np.abs(y - ref)
    if pow2:
        assert np.all(err <= 1e-6 * mag + 1e-30)
    else:
        assert np.all(err <= 2.0**-8 * mag + 1e-6 * mag)
        assert np.max(err / mag) > 2.0**-16  # the rounding is really there (not the exact path)


def test_tpu_plan_picks_mxu_sized_tiles():
    plan = tpu.plan
    # decode on v6e: whole K, 4 N tiles of 1024, two groups per dot; v5e: upcast, no pairs
    assert plan(16, 4096, 4096, None, fp8_mxu=True) == tpu.Plan(32, 1024, 4096, "native", 2)
    assert plan(16, 4096, 4096, None, fp8_mxu=False) == tpu.Plan(32, 1024, 4096, "bfloat16", 1)
    # prefill on v6e: dequantized BF16 tiles, one 1024-deep dot per step; v5e: upcast per group
    assert plan(4096, 4096, 12288, None, fp8_mxu=True) == tpu.Plan(
        1024, 1024, 1024, "dequant_bf16", 1)  # fmt: skip
    assert plan(4096, 4096, 12288, None, fp8_mxu=False) == tpu.Plan(512, 1024, 1024, "bfloat16")
    assert plan(256, 4096, 4096, None, fp8_mxu=True).compute_dtype == "dequant_bf16"
    assert plan(128, 4096, 4096, None, fp8_mxu=True) == tpu.Plan(128, 1024, 1024, "native", 2)
    explicit = TpuConfig(compute_dtype="native")  # the exact path stays available on v6e
    assert plan(4096, 4096, 4096, explicit, fp8_mxu=True).compute_dtype == "native"
    assert plan(16, 2048, 512, None, fp8_mxu=True).block_n == 256  # >= 2 steps for small N
    assert "FP8 MXU" in plan(16, 256, 256, TpuConfig(compute_dtype="native"), fp8_mxu=False)
    assert "pack=2" in plan(4096, 4096, 4096, TpuConfig(pack=2), fp8_mxu=True)


def test_every_plan_the_tpu_tuner_times_computes_the_product():
    """The on-device autotuner's TPU candidates (``tuning.tpu_specs``: the default plan and its
    neighbours, v6e) each give the reference's product in interpret mode: with power-of-two
    scales the dequantized BF16 operands are exact, so every compute mode agrees up to f32
    summation order. A candidate that computed something else could be chosen for its speed."""
    from kernels_pallas.fp8_matmul import tuning

    m, k, n = 64, 512, 512
    x, w, _, _ = _operands(m, k, n, seed=9)
    xq = quantize_activations(x, 128)
    xq = QArray(xq.values, 2.0 ** jnp.ceil(jnp.log2(xq.scales)), xq.block_shape, xq.dtype)
    wq = quantize_weight(w, (128, 128), pow2_scales=True)
    ref = np.asarray(fp8_matmul_reference(xq, wq, out_dtype=jnp.float32))
    specs = tuning.tpu_specs(m, n, k, "TPU v6 lite", tuning.TUNE_LIMIT)
    assert len(specs) > 3
    for name, _, cfg in specs:
        y = tpu.fp8_matmul_tpu(xq, wq, out_dtype=jnp.float32, interpret=True, config=cfg)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)),
                                   err_msg=name)  # fmt: skip
