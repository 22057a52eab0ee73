"""``kernels_pallas.fp8_train_matmul``: the rollout's W8A8 forward, straight-through backward.

Forward and gradients against the float64 reference (same quantizers, float64 products) over a
grid of shapes (token counts that are and are not multiples of 128, K and N tails) for the XLA
path and the Mosaic GPU / TPU kernels in interpret mode (forward and dgrad; wgrad's 1D1D scaling
always runs the XLA path). FP8 gradients are compared with the exact BF16-backward gradients
within the FP8 tolerance: E4M3 rounds each operand by at most 2^-4 relative, so a normwise
relative error of a few percent (measured ~3.6% on Gaussian operands).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.fp8_matmul import fp8_matmul
from kernels_pallas.fp8_train_matmul import (
    TrainMatmulConfig,
    fp8_train_matmul,
    grouped_fp8_grads,
    grouped_train_grads_reference,
    quantize_token_groups,
    quantize_train_weight,
    token_tiles,
    train_matmul_grads_reference,
    transpose_weight,
)
from kernels_pallas.qarray import dequantize
from kernels_pallas.quantize import quantize_activations

IMPLS = [
    pytest.param("xla", False, id="xla"),
    pytest.param("pallas_mosaic_gpu", True, id="mgpu-interpret", marks=pytest.mark.slow),
    pytest.param("pallas_tpu", True, id="tpu-interpret", marks=pytest.mark.slow),
]
SHAPES = [(128, 256, 256), (200, 256, 384), (64, 384, 128)]  # (M, K, N)


def _operands(m, k, n, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (k, n), jnp.float32) * 0.05
    dy = jax.random.normal(k3, (m, n), jnp.float32).astype(jnp.bfloat16)
    return x, w, dy


def _rel(a, b):
    a = np.asarray(a, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _run(x, w, dy, cfg):
    y, vjp = jax.vjp(lambda a, b: fp8_train_matmul(a, b, cfg), x, w)
    return (y, *vjp(dy))


def test_transposed_weight_blocks_are_exact():
    w = jax.random.normal(jax.random.key(1), (256, 384)) * 0.1
    w_q = quantize_train_weight(w, TrainMatmulConfig())
    np.testing.assert_array_equal(dequantize(transpose_weight(w_q)), dequantize(w_q).T)


def test_reference_on_hand_computed_case():
    """One 128-group: x = 1, w = 1/2 everywhere; FP8 represents both exactly."""
    x = jnp.ones((2, 128), jnp.float32)
    w = jnp.full((128, 3), 0.5, jnp.float32)
    dy = jnp.ones((2, 3), jnp.float32)
    for backward in ("bf16", "fp8"):
        y, dx, dw = train_matmul_grads_reference(x, w, dy, TrainMatmulConfig(backward=backward))
        np.testing.assert_allclose(y, 64.0)  # 128 · 1 · 1/2
        np.testing.assert_allclose(dx, 1.5)  # 3 · 1 · 1/2
        np.testing.assert_allclose(dw, 2.0)  # 2 tokens · 1 · 1


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("backward", ["bf16", "fp8"])
def test_matches_float64_reference(impl, interpret, m, k, n, backward):
    x, w, dy = _operands(m, k, n)
    cfg = TrainMatmulConfig(backward=backward, impl=impl, interpret=interpret)
    y, dx, dw = _run(x, w, dy, cfg)
    y_r, dx_r, dw_r = train_matmul_grads_reference(x, w, dy, cfg)
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert _rel(y, y_r) < 4e-3  # the BF16 output rounding (2^-9 relative per element)
    assert _rel(dx, dx_r) < 4e-3
    # wgrad in f32: bf16 backward differs from float64 by the f32 accumulation only; the fp8
    # backward by that and its f32 block products.
    assert _rel(dw, dw_r) < 1e-5


def test_forward_is_the_rollout_linear():
    """Bit for bit the product the rollout computes with ``quantize_params``' weight."""
    x, w, _ = _operands(200, 256, 384)
    cfg = TrainMatmulConfig()
    y = fp8_train_matmul(x, w, cfg)
    y_roll = fp8_matmul(x, quantize_train_weight(w, cfg), out_dtype=x.dtype)
    np.testing.assert_array_equal(y, y_roll)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_fp8_gradients_within_fp8_tolerance_of_bf16(m, k, n):
    x, w, dy = _operands(m, k, n, seed=3)
    _, dx, dw = _run(x, w, dy, TrainMatmulConfig(backward="fp8"))
    _, dx_e, dw_e = train_matmul_grads_reference(x, w, dy, TrainMatmulConfig(backward="bf16"))
    assert 5e-3 < _rel(dx, dx_e) < 0.06  # FP8 error present, and bounded
    assert 5e-3 < _rel(dw, dw_e) < 0.06


def test_fp8_dgrad_uses_one_by_128_groups_of_dy():
    """dgrad reads dy quantized per token in 1x128 groups along N (hand-built dy: one huge
    entry in the first group of row 0 must not change the scale of any other group)."""
    x, w, dy = _operands(128, 128, 256, seed=5)
    dy = dy.at[0, 0].set(1000.0)
    cfg = TrainMatmulConfig(backward="fp8")
    _, dx, _ = _run(x, w, dy, cfg)
    w_q = quantize_train_weight(w, cfg)
    dy_q = dequantize(quantize_activations(dy, 128, cfg.dtype), jnp.float32)
    expect = np.asarray(dy_q, np.float64) @ np.asarray(dequantize(w_q), np.float64)
    assert _rel(dx, expect) < 4e-3


# --- MoE expert stacks: the grouped FP8 backward (fp8_train_matmul.grouped) ---

# (rows R, D, F_i of the stacks, group sizes): empty experts, experts over 128 rows, a last
# partial tile, rows past Σ sizes
GROUPED = [
    (64, 128, (256,), (20, 0, 30, 14)),
    (300, 256, (128, 256), (130, 0, 5, 150)),
]


def _grouped_operands(r, d, fs, sizes, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2 + 2 * len(fs))
    x = jax.random.normal(keys[0], (r, d), jnp.float32).astype(jnp.bfloat16)
    ws = tuple(jax.random.normal(keys[1 + i], (len(sizes), d, f)) * 0.05 for i, f in enumerate(fs))
    dys = tuple(
        jax.random.normal(keys[1 + len(fs) + i], (r, f), jnp.float32).astype(jnp.bfloat16)
        for i, f in enumerate(fs)
    )
    return x, ws, dys, jnp.asarray(sizes, jnp.int32)


def test_token_tiles_restart_at_every_expert():
    """Hand-computed: sizes (3, 0, 130) over 140 rows: tiles 0 | - | 1 (128 rows), 2 (2 rows);
    rows past the 133 in groups go to the last tile of the static bound."""
    tile_R, n = token_tiles(jnp.asarray([3, 0, 130]), 140)
    assert n == (140 + 127 * 3) // 128 + 1 == 5
    want = [0] * 3 + [1] * 128 + [2] * 2 + [4] * 7
    np.testing.assert_array_equal(tile_R, want)


def test_token_groups_take_their_scale_from_their_own_expert():
    """One huge entry in expert 0's rows leaves expert 1's rounding (same column) untouched."""
    x = jax.random.normal(jax.random.key(7), (20, 128), jnp.float32)
    sizes = jnp.asarray([10, 10])
    base = quantize_token_groups(x, sizes)
    spiked = quantize_token_groups(x.at[0, 5].set(1e4), sizes)
    np.testing.assert_array_equal(base[10:], spiked[10:])
    assert not np.array_equal(base[1:10, 5], spiked[1:10, 5])  # expert 0's column 5 rescaled
    np.testing.assert_allclose(base, x, rtol=2**-3, atol=1e-6)  # E4M3: 3 mantissa bits


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("r,d,fs,sizes", GROUPED)
def test_grouped_fp8_grads_match_float64_reference(impl, interpret, r, d, fs, sizes):
    x, ws, dys, gs = _grouped_operands(r, d, fs, sizes)
    cfg = TrainMatmulConfig(backward="fp8", impl=impl, interpret=interpret)
    ws_q = tuple(quantize_train_weight(w, cfg) for w in ws)
    dx, dws = grouped_fp8_grads(x, ws_q, dys, gs, cfg)
    dx_r, dws_r = grouped_train_grads_reference(x, ws, dys, sizes, cfg)
    assert _rel(dx, dx_r) < 1e-5  # f32 accumulation of exact FP8 x scale products
    np.testing.assert_array_equal(dx[sum(sizes) :], 0.0)  # rows past the groups
    for dw, dw_r in zip(dws, dws_r, strict=True):
        assert dw.shape == dw_r.shape and _rel(dw, dw_r) < 1e-5


@pytest.mark.parametrize("r,d,fs,sizes", GROUPED)
def test_grouped_fp8_grads_within_fp8_tolerance_of_exact(r, d, fs, sizes):
    """Against the unquantized float64 gradients ``dy · wᵀ`` and ``Σ_{r ∈ e} x_rᵀ dy_r``."""
    x, ws, dys, gs = _grouped_operands(r, d, fs, sizes, seed=3)
    cfg = TrainMatmulConfig(backward="fp8")
    dx, dws = grouped_fp8_grads(x, tuple(quantize_train_weight(w, cfg) for w in ws), dys, gs, cfg)
    x64 = np.asarray(x, np.float64)
    bounds = np.cumsum([0, *sizes])
    dx_e = np.zeros(x64.shape)
    for w, dy, dw in zip(ws, dys, dws, strict=True):
        w64, dy64 = np.asarray(w, np.float64), np.asarray(dy, np.float64)
        dw_e = np.zeros(w64.shape)
        for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            dx_e[a:b] += dy64[a:b] @ w64[e].T
            dw_e[e] = x64[a:b].T @ dy64[a:b]
        assert 5e-3 < _rel(dw, dw_e) < 0.06  # FP8 error present, and bounded
    assert 5e-3 < _rel(dx, dx_e) < 0.06
