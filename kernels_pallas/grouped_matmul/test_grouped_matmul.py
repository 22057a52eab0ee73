"""grouped_matmul (BF16, differentiable): the references against float64 and hand values, the
Hopper kernels (interpret mode; natively with ``-m gpu``) against the
references forward and backward, the custom VJP against ``jax.lax.ragged_dot``'s autodiff,
support checks and operand errors. Rows past ``Σ group_sizes`` (a fixed-size dispatch buffer)
and empty groups are in every kernel case.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from kernels_pallas.grouped_matmul import (
    IMPLEMENTATIONS,
    GmmConfig,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_wgrad_reference,
)
from kernels_pallas.grouped_matmul import pallas_mosaic_gpu as mgpu

_H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
SMALL = GmmConfig(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2)


def _operands(m, k, n, sizes, dtype=jnp.bfloat16, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (len(sizes), k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def _f64_forward(x, w, sizes):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for e, s in enumerate(sizes):
        y[start : start + s] = x[start : start + s] @ w[e]
        start += s
    return y


def test_reference_hand_case():
    x = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    w = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
    y = grouped_matmul_reference(x, w, jnp.array([1, 1]))
    np.testing.assert_array_equal(y, [[1, 2], [6, 8], [0, 0]])  # row 2 is past Σ sizes
    dw = grouped_wgrad_reference(x, jnp.ones((3, 2)), jnp.array([1, 1]))
    np.testing.assert_array_equal(dw, [[[1, 1], [2, 2]], [[3, 3], [4, 4]]])


def test_references_against_float64():
    sizes = (5, 0, 9)
    x, w, gs = _operands(17, 8, 4, sizes, jnp.float32)
    np.testing.assert_allclose(grouped_matmul_reference(x, w, gs), _f64_forward(x, w, sizes),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    dy = np.asarray(jax.random.normal(jax.random.key(3), (17, 4)), np.float64)
    xd = np.asarray(x, np.float64)
    want = np.stack([xd[:5].T @ dy[:5], np.zeros((8, 4)), xd[5:14].T @ dy[5:14]])
    np.testing.assert_allclose(grouped_wgrad_reference(x, dy, gs), want, rtol=1e-6, atol=1e-6)


# (m, k, n, sizes): dead rows past Σ sizes, empty groups, groups straddling tile boundaries,
# several K steps, a one-row group, M not a multiple of the row tile.
CASES = [
    (200, 128, 128, (70, 0, 90)),
    (130, 192, 128, (0, 1, 127, 0)),
    (96, 128, 192, (10, 20, 30, 0, 5)),
]


@pytest.mark.parametrize("m,k,n,sizes", CASES)
def test_kernels_match_references(m, k, n, sizes):
    x, w, gs = _operands(m, k, n, sizes)
    want = _f64_forward(x, w, sizes)
    y = mgpu.gmm_mgpu(x, w, gs, config=SMALL, interpret=True)
    np.testing.assert_allclose(np.float32(y), want, rtol=2e-2, atol=2e-2)  # bf16 output
    y32 = mgpu.gmm_mgpu(x, w, gs, out_dtype=jnp.float32, config=SMALL, interpret=True)
    np.testing.assert_allclose(y32, grouped_matmul_reference(x, w, gs, jnp.float32),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    # The transposed read: x · w[e]ᵀ with w given as [E, N, K].
    yt = mgpu.gmm_mgpu(x, jnp.swapaxes(w, 1, 2), gs, transpose_w=True, out_dtype=jnp.float32,
                       config=SMALL, interpret=True)  # fmt: skip
    np.testing.assert_allclose(yt, y32, rtol=1e-6, atol=1e-6)
    dy = jax.random.normal(jax.random.key(7), (m, n), jnp.float32).astype(jnp.bfloat16)
    dw = mgpu.tgmm_mgpu(x, dy, gs, config=SMALL, interpret=True)
    np.testing.assert_allclose(dw, grouped_wgrad_reference(x, dy, gs), rtol=1e-5, atol=1e-4)


def test_default_tiles_two_k_steps_and_a_deep_ring():
    x, w, gs = _operands(300, 256, 128, (100, 0, 150))
    cfg = GmmConfig(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4)
    y = mgpu.gmm_mgpu(x, w, gs, out_dtype=jnp.float32, config=cfg, interpret=True)
    np.testing.assert_allclose(y, grouped_matmul_reference(x, w, gs, jnp.float32),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    dy = jax.random.normal(jax.random.key(1), (300, 128), jnp.bfloat16)
    dw = mgpu.tgmm_mgpu(x, dy, gs, config=cfg, interpret=True)
    np.testing.assert_allclose(dw, grouped_wgrad_reference(x, dy, gs), rtol=1e-5, atol=1e-4)
    # BF16 written by the kernel: the f32 accumulator rounded once, as a cast of the f32 result
    dw16 = mgpu.tgmm_mgpu(x, dy, gs, out_dtype=jnp.bfloat16, config=cfg, interpret=True)
    assert dw16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.float32(dw16), np.float32(dw.astype(jnp.bfloat16)))


def test_wide_default_tiles_store_rows_into_y():
    """The default 128x256 tiles (two compute warpgroups; 16-bit outputs) over groups cutting
    row tiles at odd rows, one-row groups, empty groups and rows past Σ sizes (their zero
    tiles): gmm forward and the transposed read, and tgmm; each equals the square tiles' f32
    result (which an f32 output gets by default) up to the one BF16 rounding."""
    sizes = (0, 129, 0, 3, 150)
    x, w, gs = _operands(330, 256, 256, sizes)
    assert mgpu.gmm_default(256, 256) == GmmConfig(128, 256, 64, 3)
    assert mgpu.gmm_default(256, 256, out_itemsize=4) == GmmConfig(128, 128)  # 128 KiB f32 tile
    y32 = mgpu.gmm_mgpu(x, w, gs, out_dtype=jnp.float32, interpret=True)  # square tiles
    np.testing.assert_allclose(y32, grouped_matmul_reference(x, w, gs, jnp.float32),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    y = mgpu.gmm_mgpu(x, w, gs, interpret=True)  # BF16: the wide tiles
    assert y.dtype == jnp.bfloat16 and not np.any(np.float32(y)[sum(sizes) :])
    np.testing.assert_allclose(np.float32(y), y32, rtol=2**-8, atol=1e-6)
    yt = mgpu.gmm_mgpu(x, jnp.swapaxes(w, 1, 2), gs, transpose_w=True, interpret=True)
    np.testing.assert_allclose(np.float32(yt), y32, rtol=2**-8, atol=1e-6)
    dy = jax.random.normal(jax.random.key(4), (330, 256), jnp.bfloat16)
    dw = mgpu.tgmm_mgpu(x, dy, gs, interpret=True)  # f32 out: the square default
    np.testing.assert_allclose(dw, grouped_wgrad_reference(x, dy, gs), rtol=1e-5, atol=1e-4)
    # BF16 out: the wide default (two warpgroups of 64 K rows x 256, masked x columns each)
    dw16 = mgpu.tgmm_mgpu(x, dy, gs, out_dtype=jnp.bfloat16, interpret=True)
    np.testing.assert_array_equal(np.float32(dw16), np.float32(dw.astype(jnp.bfloat16)))


def test_custom_vjp_equals_ragged_dot_autodiff():
    """Values and both gradients of the kernel op equal ``jax.lax.ragged_dot``'s (bf16 operands,
    f32 accumulation: the kernels round once per output, as XLA does)."""
    x, w, gs = _operands(130, 128, 64, (40, 0, 60))
    ct = jax.random.normal(jax.random.key(5), (130, 64), jnp.float32).astype(jnp.bfloat16)

    def loss(impl, a, b):
        y = grouped_matmul(a, b, gs, impl=impl, config=SMALL, interpret=True)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    # jitted: eagerly, primitives dispatched while the interpreted kernel's callbacks run can
    # wait on XLA:CPU's execution semaphore behind them (tests/test_moe_expert_matmul.py)
    (l_k, y_k), (dx_k, dw_k) = jax.jit(jax.value_and_grad(
        lambda a, b: loss("pallas_mosaic_gpu", a, b), argnums=(0, 1), has_aux=True
    ))(x, w)  # fmt: skip
    (l_r, y_r), (dx_r, dw_r) = jax.value_and_grad(
        lambda a, b: loss("xla", a, b), argnums=(0, 1), has_aux=True
    )(x, w)
    assert y_k.dtype == jnp.bfloat16 and dx_k.dtype == x.dtype and dw_k.dtype == w.dtype
    for got, want in ((y_k, y_r), (dx_k, dx_r), (dw_k, dw_r)):
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(l_k, l_r, rtol=1e-3)
    assert not np.any(np.asarray(dx_k[100:], np.float32)), "rows past Σ sizes get no gradient"
    # Against float64: the kernel's f32-accumulated weight gradient of the bf16 cotangent.
    dy = np.asarray(ct, np.float64)
    xd = np.asarray(x, np.float64)
    want_dw1 = xd[40:100].T @ dy[40:100]
    np.testing.assert_allclose(np.float32(dw_k[2]), want_dw1, rtol=1e-2, atol=2e-2)
    assert not np.any(np.asarray(dw_k[1], np.float32)), "an empty group's gradient is zero"


def test_support_check_and_auto():
    x = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((16, 2048, 768), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((16,), jnp.int32)
    kw = dict(config=None, interpret=False)
    assert IMPLEMENTATIONS.select("auto", x, w, gs, **kw).name == "xla"  # CPU target
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=_H100)):
        assert IMPLEMENTATIONS.select("auto", x, w, gs, **kw).name == "pallas_mosaic_gpu"
        w32 = jax.ShapeDtypeStruct((16, 2048, 768), jnp.float32)
        x32 = jax.ShapeDtypeStruct((4096, 2048), jnp.float32)
        assert IMPLEMENTATIONS.select("auto", x32, w32, gs, **kw).name == "xla"
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        IMPLEMENTATIONS.select("pallas_mosaic_gpu", x, w, gs, **kw)
    assert mgpu.supports(4096, 2048, 768, jnp.bfloat16, GmmConfig()) is None
    assert "float32" in mgpu.supports(64, 64, 64, jnp.float32, SMALL)
    assert "N=96" in mgpu.supports(64, 64, 96, jnp.bfloat16, SMALL)
    assert "K=" in mgpu.supports(64, 96, 64, jnp.bfloat16, SMALL)
    # The input gradient tiles K by block_n: a K of 64 needs 64-wide tiles.
    assert "K=64" in mgpu.supports(64, 64, 128, jnp.bfloat16, GmmConfig(128, 128, 64))
    assert mgpu.default_config(64, 128) == GmmConfig(64, 64)
    assert mgpu.default_config(2048, 768) == GmmConfig(128, 128)
    # gmm's own default: 128x256 (two warpgroups of 64x256) where the output width allows
    assert mgpu.gmm_default(2048, 768) == GmmConfig(128, 256, 64, 3)
    assert mgpu.gmm_default(768, 2048) == GmmConfig(128, 256, 64, 3)  # the input gradient
    assert mgpu.gmm_default(128, 384) == GmmConfig(128, 128)
    deep = GmmConfig(128, 256, 64, 4)  # 4 x 48 KiB + the 64 KiB output tile
    assert "forward: tiles need" in mgpu.supports(4096, 2048, 768, jnp.bfloat16, deep)
    big = GmmConfig(256, 256, 128, 4)
    assert "64 or 128 rows" in mgpu.supports(4096, 2048, 768, jnp.bfloat16, big)
    # an explicit config runs every pass: the weight gradient tiles K by block_m
    wide = GmmConfig(128, 256, 64, 3)
    assert mgpu.supports(4096, 2048, 768, jnp.bfloat16, wide) is None
    narrow = GmmConfig(128, 64, 64, 3)  # N tiles of 64 take K = 192; K tiles of 128 do not
    assert "weight gradient: K=192" in mgpu.supports(64, 192, 768, jnp.bfloat16, narrow)
    assert mgpu.supports(4096, 2048, 768, jnp.bfloat16, None) is None  # each pass its default
    # tgmm's own default: wide for a 16-bit dw; an f32 one (128 KiB) takes the square tiles
    assert mgpu.tgmm_default(2048, 768) == wide and mgpu.tgmm_default(768, 2048) == wide
    assert mgpu.tgmm_default(2048, 768, 4) == GmmConfig(128, 128)
    # an f32 output of the wide tile: 147 KiB of ring + 128 KiB of output tile
    x, w, gs = _operands(128, 128, 256, (128,))
    with pytest.raises(ValueError, match="gmm_mgpu: .* float32 output"):
        mgpu.gmm_mgpu(x, w, gs, out_dtype=jnp.float32, config=wide, interpret=True)


def test_operand_errors_name_the_operand():
    x, w, gs = _operands(8, 64, 64, (4, 4))
    with pytest.raises(ValueError, match="K=64 differs from w's K=32"):
        grouped_matmul(x, w[:, :32], gs)
    with pytest.raises(ValueError, match=r"group_sizes must be \[E=2\]"):
        grouped_matmul(x, w, gs[:1])
    with pytest.raises(ValueError, match="integers"):
        grouped_matmul(x, w, gs.astype(jnp.float32))


@pytest.mark.gpu
def test_kernels_on_device_match_references():
    x, w, gs = _operands(4096, 2048, 768, (1000, 0, 2000, 96) + (0,) * 12)
    y = mgpu.gmm_mgpu(x, w, gs, out_dtype=jnp.float32)  # square tiles (an f32 output)
    ref = grouped_matmul_reference(x, w, gs, jnp.float32)
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-3)
    y16 = mgpu.gmm_mgpu(x, w, gs)  # BF16: 128x256 tiles of two warpgroups, ragged row stores
    np.testing.assert_allclose(np.float32(y16), ref, rtol=2**-7, atol=1e-2)
    dy = jax.random.normal(jax.random.key(2), (4096, 768), jnp.bfloat16)
    np.testing.assert_allclose(mgpu.tgmm_mgpu(x, dy, gs), grouped_wgrad_reference(x, dy, gs),
                               rtol=1e-3, atol=1e-2)  # fmt: skip
    # the training pass's BF16 dw on the wide default tiles: the f32 result rounded once
    dw16 = mgpu.tgmm_mgpu(x, dy, gs, out_dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.float32(dw16), grouped_wgrad_reference(x, dy, gs),
                               rtol=2**-7, atol=1e-2)  # fmt: skip
