"""The one-launch activation quantization kernel against ``quantize_activations``, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import aot
from kernels_pallas.act_quantize import quantize_activations_triton, supports
from kernels_pallas.act_quantize.pallas_triton import row_block
from kernels_pallas.quantize import quantize_activations

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize(
    "m,k,rows,x_dtype,fp8",
    [
        (1, 128, None, jnp.bfloat16, E4M3),  # one token, padded to 16 rows
        (5, 384, 16, jnp.float32, E4M3),
        (16, 256, 16, jnp.float16, E5M2),
        (33, 256, 64, jnp.bfloat16, E4M3),  # padded past the next 16 (a 64-row GEMM tile)
        (64, 128, 64, jnp.float32, E5M2),
        (270, 256, 288, jnp.bfloat16, E4M3),  # prefill rows: 32-row programs (288 = 9 x 32)
        (300, 128, 320, jnp.bfloat16, E5M2),  # 64-row programs
    ],
)
def test_equals_quantize_activations_bit_for_bit(m, k, rows, x_dtype, fp8):
    kx, ko = jax.random.split(jax.random.key(m * k))
    x = jax.random.normal(kx, (m, k), jnp.float32) * jnp.exp(jax.random.normal(ko, (m, 1)) * 4)
    x = x.at[0, 3].set(3e4)  # an outlier owns its group's scale
    x = x.at[m - 1, : min(k, 128)].set(0.0)  # an all-zero group: the tiny scale, zero values
    x = x.astype(x_dtype)
    got = quantize_activations_triton(x, 128, fp8, rows=rows, interpret=True)
    want = quantize_activations(x, 128, fp8)
    pad = rows or 16
    assert got.shape == (pad, k) and got.scales.shape == (pad, k // 128)
    assert got.values.dtype == jnp.dtype(fp8) and got.dtype == jnp.dtype(x_dtype)
    np.testing.assert_array_equal(_bits(got.values[:m]), _bits(want.values))
    np.testing.assert_array_equal(np.asarray(got.scales[:m]), np.asarray(want.scales))
    assert not np.any(_bits(got.values[m:]))  # padded rows quantize to zeros


def test_row_block():
    """16 rows per program for decode batches (<= 256 rows), 64 or 32 above where they divide."""
    assert [row_block(r) for r in (16, 32, 256)] == [16, 16, 16]
    assert [row_block(r) for r in (272, 288, 320, 4096)] == [16, 32, 64, 64]


def test_worked_group():
    """One group by hand: amax 896 -> s = 896 / 448 = 2; x̂ = x / 2 (E4M3 rounds 3.3 -> 3.25)."""
    x = jnp.zeros((1, 128), jnp.float32).at[0, :3].set(jnp.array([896.0, -6.6, 1.0]))
    q = quantize_activations_triton(x, interpret=True)
    assert float(q.scales[0, 0]) == 2.0
    np.testing.assert_array_equal(np.asarray(q.values[0, :3], np.float32), [448.0, -3.25, 0.5])


@pytest.mark.parametrize(
    "shape,rows,group,needle",
    [
        ((4, 8, 128), 16, 128, "x must be [M, K]"),
        ((4, 200), 16, 128, "K=200"),
        ((4, 256), 16, 64, "group_size must be 128"),
        ((20, 256), 16, 128, "rows=16"),
        ((4, 256), 24, 128, "rows=24"),
    ],
)
def test_rejects_with_the_field(shape, rows, group, needle):
    assert needle in supports(shape, rows, group)
    with pytest.raises(ValueError, match="quantize_activations_triton"):
        quantize_activations_triton(jnp.zeros(shape), group, rows=rows, interpret=True)


def test_gpu_lowering_divides_as_xla_does():
    """The GPU kernel (lowered for CUDA without a device) is one Triton launch with one f32
    division, ``div.full.f32`` (XLA's NVPTX backend compiles f32 divisions with
    ``-nvptx-prec-divf32=1``), and the scale a product with ``rn(1 / fp8_max)`` (XLA's algebraic
    simplifier rewrites a division by a constant so): IEEE ``div.rn`` for both differed from
    XLA on an H200 (40% of the scales, 0.04-0.09% of the codes)."""
    fn = lambda x: quantize_activations_triton(x, rows=16)  # noqa: E731
    mlir = aot.export_for("h100", fn, jax.ShapeDtypeStruct((16, 256), jnp.bfloat16))
    text = mlir.compiled.mlir_module()
    assert text.count("xla.gpu.triton") == 1
    assert text.count("div.full.f32") == 1 and "div.rn" not in text  # the asm string, once


@pytest.mark.parametrize("m", [5, 16, 64, 300])
def test_fp8_matmul_quantizes_raw_x_with_this_kernel(m):
    """Raw x through the Hopper kernel (interpret mode): decode and prefill rows take this
    kernel, padded to the CTA row tile (XLA's quantize_activations reads x twice), but at M = 16,
    where the GEMM quantizes x itself (``fp8_matmul.api.fused_default``); the product equals the
    one from a QArray x."""
    from kernels_pallas.fp8_matmul import fp8_matmul
    from kernels_pallas.quantize import quantize_weight

    kx, kw = jax.random.split(jax.random.key(m))
    x = jax.random.normal(kx, (m, 256), jnp.bfloat16)
    w_q = quantize_weight(jax.random.normal(kw, (256, 128), jnp.float32))
    run = lambda a: fp8_matmul(a, w_q, impl="pallas_mosaic_gpu", interpret=True)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(run(x)), np.asarray(run(quantize_activations(x))))
    assert ("quantize_activations_triton" in str(jax.make_jaxpr(run)(x))) == (m != 16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,fp8", [(1, E4M3), (16, E4M3), (64, E5M2), (200, E4M3), (4096, E4M3), (4000, E5M2)]
)
def test_on_the_device_bit_for_bit(m, fp8):
    """On a GPU: the compiled kernel equals XLA's quantize_activations on the same device."""
    kx, ko = jax.random.split(jax.random.key(m))
    x = jax.random.normal(kx, (m, 4096), jnp.float32) * jnp.exp(jax.random.normal(ko, (m, 1)) * 4)
    x = x.astype(jnp.bfloat16)
    got = quantize_activations_triton(x, 128, fp8)
    want = jax.jit(quantize_activations, static_argnums=(1, 2))(x, 128, fp8)
    np.testing.assert_array_equal(_bits(got.values[:m]), _bits(want.values))
    np.testing.assert_array_equal(np.asarray(got.scales[:m]), np.asarray(want.scales))
