"""Blockwise FP8 quantization: round-trip bounds, exact cases, saturation, recipes (DESIGN §4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.quant import (
    QArray,
    QuantRecipe,
    dequantize,
    dequantize_weight,
    fp8_max,
    matmul,
    quantize_activations,
    quantize_blockwise,
    quantize_params,
    quantize_weight,
)
from kernels_pallas.fp8_matmul import fp8_matmul_reference
from kernels_pallas.qarray import SCALE_TINY, expand_scales
from kernels_pallas.quantize import saturating_cast

# (mantissa bits, exponent of the smallest normal) of each FP8 format.
_FORMATS = {jnp.float8_e4m3fn: (3, -6), jnp.float8_e5m2: (2, -14)}


def _half_ulp_bound(x, scale_full, dtype):
    """Largest round-to-nearest error of ``x`` quantized with per-element ``scale_full``.

    ``v = |x| / s`` lies in [0, fp8_max]; its FP8 spacing is ``2^(max(floor(log2 v), e_min) - m)``
    (subnormals share the spacing of the smallest binade), and RNE is off by at most half of it,
    so ``|dequant(x) - x| <= s * ulp(v) / 2``. The 1e-6 relative slack covers FP32 rounding of
    ``x / s`` and ``x̂ * s``.
    """
    mant, e_min = _FORMATS[dtype]
    x = np.asarray(x, np.float64)
    s = np.asarray(scale_full, np.float64)
    v = np.abs(x) / s
    e = np.floor(np.log2(np.maximum(v, 2.0**e_min)))
    return s * 2.0 ** (e - mant) / 2 * (1 + 1e-6) + 1e-6 * np.abs(x)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize(
    "shape,block", [((256, 384), (128, 128)), ((200, 72), (128, 128)), ((5, 300), (128,))]
)
def test_round_trip_within_half_ulp(shape, block, dtype):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * 3.0
    x = x.at[0, 0].set(1e-4)  # exercises the subnormal range of the first block
    q = quantize_blockwise(x, block, dtype)
    s_full = expand_scales(q.scales, shape, block)
    err = np.abs(np.asarray(dequantize(q), np.float64) - np.asarray(x, np.float64))
    assert np.all(err <= _half_ulp_bound(x, s_full, dtype))
    # Coarse form of the same bound: half the top-binade spacing of the block range (E4M3: 16/448).
    top = 2.0 ** (np.floor(np.log2(fp8_max(dtype))) - _FORMATS[dtype][0]) / 2
    assert np.all(err <= np.asarray(s_full) * top * (1 + 1e-6))


def test_tail_block_scale_uses_only_real_entries():
    x = jax.random.normal(jax.random.key(1), (200, 72), jnp.float32)
    q = quantize_blockwise(x, (128, 128))
    assert q.scales.shape == (2, 1) and q.values.shape == (200, 72)
    np.testing.assert_allclose(q.scales[1, 0], jnp.max(jnp.abs(x[128:])) / 448.0, rtol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_representable_values_are_exact(dtype):
    """FP8 values times a power-of-two scale, each block holding +-fp8_max, survive exactly."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(256, 256), dtype=np.uint8).view(jnp.dtype(dtype))
    vals = np.nan_to_num(codes.astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    vals = np.clip(vals, -fp8_max(dtype), fp8_max(dtype))
    vals[::128, ::128] = fp8_max(dtype)  # every block's amax is exactly fp8_max
    x = jnp.asarray(vals) * 2.0**-5
    q = quantize_blockwise(x, (128, 128), dtype)
    np.testing.assert_array_equal(q.scales, 2.0**-5)
    np.testing.assert_array_equal(dequantize(q), x)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_saturating_cast_clamps_instead_of_nan(dtype):
    m = fp8_max(dtype)
    x = jnp.array([1e9, -1e9, m * 1.07, -m * 1.07, m, 0.0], jnp.float32)
    y = saturating_cast(x, dtype).astype(jnp.float32)
    np.testing.assert_array_equal(y, [m, -m, m, -m, m, 0.0])
    if dtype == jnp.float8_e4m3fn:  # the unclamped cast overflows to NaN: the clamp matters
        assert jnp.isnan(x[:1].astype(dtype).astype(jnp.float32))[0]


def test_pow2_scales_are_powers_of_two_and_cover_amax():
    x = jax.random.normal(jax.random.key(2), (256, 384), jnp.float32) * 7.3
    q = quantize_blockwise(x, (128, 128), pow2_scales=True)
    log2 = np.log2(np.asarray(q.scales, np.float64))
    np.testing.assert_array_equal(log2, np.round(log2))
    amax = np.abs(np.asarray(x)).reshape(2, 128, 3, 128).max(axis=(1, 3))
    assert np.all(np.asarray(q.scales) * 448.0 >= amax)  # x / s never needs saturation
    assert np.all(np.asarray(q.scales) * 448.0 < 2 * amax)  # and the range is at most half wasted
    vals = np.abs(np.asarray(q.values, np.float32))
    assert np.all(np.isfinite(vals)) and vals.max() <= 448.0


@pytest.mark.parametrize("pow2", [False, True])
def test_all_zero_block_has_finite_scale_and_exact_zeros(pow2):
    x = jnp.zeros((256, 256), jnp.float32).at[:128, :128].set(1.0)
    q = quantize_blockwise(x, (128, 128), pow2_scales=pow2)
    assert np.all(np.isfinite(q.scales)) and np.all(np.asarray(q.scales) > 0)
    assert q.scales[1, 1] <= SCALE_TINY / 448.0 * (2 if pow2 else 1)
    np.testing.assert_array_equal(dequantize(q), x)


def test_dequantize_hand_values():
    x = jnp.array([[0.5, -1.0, 2.0, 0.0]], jnp.float32)
    q = quantize_activations(x)
    np.testing.assert_allclose(q.scales, [[2.0 / 448.0]], rtol=1e-7)
    np.testing.assert_array_equal(q.values.astype(jnp.float32), [[112.0, -224.0, 448.0, 0.0]])
    np.testing.assert_allclose(dequantize(q), x, rtol=1e-7)
    assert dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16


def test_stacked_experts_match_per_expert_quantization():
    w = jax.random.normal(jax.random.key(3), (3, 256, 128), jnp.float32)
    q = quantize_blockwise(w, (128, 128))
    assert q.scales.shape == (3, 2, 1)
    for e in range(3):
        qe = quantize_blockwise(w[e], (128, 128))
        np.testing.assert_array_equal(
            q[e].values.astype(jnp.float32), qe.values.astype(jnp.float32)
        )
        np.testing.assert_array_equal(q[e].scales, qe.scales)
    with pytest.raises(IndexError):
        q[0, 0, 0]


def test_quantize_weight_is_the_transposed_blockwise_quantization():
    """[K, N] training weight -> QArray [N, K] with (N, K) blocks: the same numbers as quantizing
    w.T directly; a (K block, N block) = (128, 64) block becomes block_shape (64, 128)."""
    w = jax.random.normal(jax.random.key(7), (2, 256, 200), jnp.float32)  # [E, K, N]
    q = quantize_weight(w, (128, 64))
    assert q.shape == (2, 200, 256) and q.block_shape == (64, 128) and q.scales.shape == (2, 4, 2)
    qt = quantize_blockwise(jnp.swapaxes(w, -1, -2), (64, 128))
    np.testing.assert_array_equal(q.values.astype(jnp.float32), qt.values.astype(jnp.float32))
    np.testing.assert_array_equal(q.scales, qt.scales)
    # K block 0, N block 3 (columns 192..199) has its own scale: the max over that block of w.
    np.testing.assert_allclose(q.scales[0, 3, 0], jnp.max(jnp.abs(w[0, :128, 192:])) / 448.0)
    back = dequantize_weight(q)
    assert back.shape == w.shape
    np.testing.assert_allclose(back, w, rtol=2.0**-4, atol=jnp.max(jnp.abs(w)) / 448 / 2**6)
    with pytest.raises(ValueError, match="not a weight"):
        dequantize_weight(quantize_activations(w))


def _params(d=64, f=128, n_layers=3, v=256):
    k = iter(jax.random.split(jax.random.key(4), 32))
    layer = lambda: {
        "attn": {
            "wq": jax.random.normal(next(k), (d, d)),
            "wo": jax.random.normal(next(k), (d, d)),
        },
        "mlp": {"w1": jax.random.normal(next(k), (d, f)), "bias": jnp.zeros((f,))},
        "router": jax.random.normal(next(k), (d, 4)),
        "attn_norm": {"scale": jnp.ones((d,))},
    }
    return {
        "embed": jax.random.normal(next(k), (v, d)),
        "layers": [layer() for _ in range(n_layers)],
        "lm_head": jax.random.normal(next(k), (d, v)),
    }


def test_quantize_params_exclusions_and_keep_layers():
    params = _params()
    q = quantize_params(params, QuantRecipe(keep_first_n=1, keep_last_n=1))
    assert not isinstance(q["embed"], QArray) and not isinstance(q["lm_head"], QArray)
    for i, layer in enumerate(q["layers"]):
        want = i == 1  # layer 0 kept (first 1), layer 2 kept (last 1)
        assert isinstance(layer["attn"]["wq"], QArray) == want
        assert isinstance(layer["mlp"]["w1"], QArray) == want
        assert not isinstance(layer["router"], QArray)
        assert not isinstance(layer["attn_norm"]["scale"], QArray)
    assert quantize_params(params, None) is params


def test_quantize_params_under_jit_counts_nonfinite_and_raises_eagerly():
    params = _params()
    recipe = QuantRecipe()
    run = jax.jit(lambda p: quantize_params(p, recipe, return_stats=True))
    q, stats = run(params)
    assert int(stats.nonfinite) == 0 and stats.n_quantized == 9
    assert isinstance(q["layers"][0]["attn"]["wq"], QArray)
    w1 = q["layers"][0]["mlp"]["w1"]  # [d=64, f=128] training weight -> [128, 64] (K-major)
    assert w1.shape == (128, 64) and w1.block_shape == (128, 128) and w1.scales.shape == (1, 1)
    np.testing.assert_allclose(
        dequantize_weight(w1), params["layers"][0]["mlp"]["w1"], rtol=2.0**-4, atol=1e-2
    )
    bad = jax.tree_util.tree_map(lambda a: a, params)
    bad["layers"][1]["mlp"]["w1"] = bad["layers"][1]["mlp"]["w1"].at[0, :3].set(jnp.nan)
    _, stats = run(bad)
    assert int(stats.nonfinite) == 3
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize_params(bad, recipe)


def test_matmul_array_and_qarray_weights():
    x = jax.random.normal(jax.random.key(5), (2, 3, 256), jnp.float32)
    w = jax.random.normal(jax.random.key(6), (256, 128), jnp.float32)
    y = matmul(x, w)
    np.testing.assert_allclose(y, jnp.einsum("btk,kn->btn", x, w, precision="highest"), rtol=1e-5)
    wq = quantize_weight(w)
    yq = matmul(x, wq)
    assert yq.shape == (2, 3, 128) and yq.dtype == jnp.float32
    want = fp8_matmul_reference(quantize_activations(x.reshape(6, 256)), wq, out_dtype=jnp.float32)
    np.testing.assert_allclose(yq.reshape(6, 128), want, rtol=1e-6, atol=1e-5)
    rel = jnp.linalg.norm(yq - y) / jnp.linalg.norm(y)
    assert rel < 0.06  # FP8 W8A8 on N(0,1) data: ~0.04 (see test_fp8_matmul for the bound)
    assert matmul(x.astype(jnp.bfloat16), wq).dtype == jnp.bfloat16


def test_quantize_blockwise_rejects_nonfinite_eagerly_and_propagates_under_jit():
    x = jnp.ones((4, 8)).at[1, 2].set(jnp.nan).at[3, 3].set(jnp.inf)
    with pytest.raises(ValueError, match="2 NaN/Inf"):
        quantize_blockwise(x, (2, 4))
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize_activations(x, 4)
    q = jax.jit(lambda x: quantize_blockwise(x, (2, 4)))(
        x
    )  # no error under jit: counted by callers
    assert not np.isfinite(np.asarray(q.scales)).all()
