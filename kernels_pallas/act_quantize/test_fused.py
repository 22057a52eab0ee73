"""The producer-fused quantization kernels against their pure-jnp references.

In interpret mode (CPU) every kernel equals its reference bit for bit: same ops, same order,
same roundings (``reference.py``). On a GPU, Triton's ``exp``/``rsqrt`` and the row sums' order
may move a BF16 rounding, so the device tests bound the difference instead.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import aot
from kernels_pallas.act_quantize import api, fused
from kernels_pallas.act_quantize.reference import (
    rms_norm,
    rmsnorm_quantize_reference,
    split_gate_up,
    swiglu,
    swiglu_quantize_reference,
)
from kernels_pallas.decode_attention import common
from kernels_pallas.decode_attention.pallas_mosaic_gpu import _lse_rows
from kernels_pallas.qarray import dequantize
from kernels_pallas.quantize import quantize_activations

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _assert_same(got, want, m=None):
    m = want.shape[0] if m is None else m
    assert got.values.dtype == want.values.dtype and got.dtype == want.dtype
    np.testing.assert_array_equal(_bits(got.values[:m]), _bits(want.values))
    np.testing.assert_array_equal(np.asarray(got.scales[:m]), np.asarray(want.scales))


def _rows(key, m, n, dtype, spread=3.0):
    """Rows of mixed magnitude, one outlier, one all-zero 128-group."""
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, (m, n)) * jnp.exp(jax.random.normal(k2, (m, 1)) * spread)
    x = x.at[0, 5].set(900.0).at[m - 1, 128:256].set(0.0)
    return x.astype(dtype)


@pytest.mark.parametrize(
    "m,d,x_dtype,w_dtype,fp8",
    [
        (16, 256, jnp.bfloat16, jnp.bfloat16, E4M3),
        (32, 1024, jnp.bfloat16, jnp.float32, E4M3),  # an f32 norm weight
        (16, 512, jnp.float16, jnp.float16, E5M2),
        (48, 128, jnp.float32, jnp.float32, E4M3),
        (272, 128, jnp.bfloat16, jnp.bfloat16, E4M3),  # prefill rows (one program per row)
    ],
)
def test_rmsnorm_quantize_equals_reference(m, d, x_dtype, w_dtype, fp8):
    kx, kw = jax.random.split(jax.random.key(m + d))
    x = _rows(kx, m, d, x_dtype)
    w = (1.0 + 0.3 * jax.random.normal(kw, (d,))).astype(w_dtype)
    got = fused.rmsnorm_quantize_triton(x, w, 1e-6, fp8, interpret=True)
    want = rmsnorm_quantize_reference(x, w, 1e-6, fp8)
    assert got.shape == (m, d) and got.scales.shape == (m, d // 128)
    if x_dtype != jnp.float32:  # the output's 16-bit rounding absorbs the sum's order
        _assert_same(got, want)
        return
    # f32 x: the row sums' order (two-level in the kernel) moves the last bit of the scale
    np.testing.assert_allclose(np.asarray(got.scales), np.asarray(want.scales), rtol=1e-6)
    np.testing.assert_allclose(*(np.asarray(dequantize(a)) for a in (got, want)), rtol=2**-3)


def test_rmsnorm_worked_row():
    """x = [3, 4, 0, ...] over D = 128, w = 1, eps = 0: rms = sqrt(25/128), so x / rms =
    [3, 4] * sqrt(128) / 5; amax = 4 · 11.3137 / 5 = 9.0510 (bf16: 9.0625) -> s = 9.0625 / 448."""
    x = jnp.zeros((16, 128), jnp.float32).at[:, :2].set(jnp.array([3.0, 4.0]))
    q = fused.rmsnorm_quantize_triton(x, jnp.ones((128,)), 0.0, interpret=True)
    h = rms_norm(x, jnp.ones((128,)), 0.0)
    np.testing.assert_allclose(np.asarray(h[0, :2]), [3 * 128**0.5 / 5, 4 * 128**0.5 / 5], 1e-6)
    assert float(q.scales[0, 0]) == np.float32(float(h[0, 1])) / np.float32(448.0)
    assert float(q.values[0, 1].astype(jnp.float32)) == 448.0


@pytest.mark.parametrize(
    "m,f,dtype,fp8",
    [
        (16, 256, jnp.bfloat16, E4M3),
        (32, 384, jnp.float16, E5M2),
        (320, 128, jnp.bfloat16, E4M3),  # prefill rows: 64-row programs
    ],
)
def test_swiglu_quantize_equals_reference_fused_and_split(m, f, dtype, fp8):
    y = _rows(jax.random.key(f), m, 2 * f, dtype, spread=1.0)  # gate|up, 128-column blocks
    gate, up = split_gate_up(y, 128)
    want = swiglu_quantize_reference(gate, up, fp8)
    _assert_same(fused.swiglu_quantize_triton(y, None, fp8, interpret=True), want)
    _assert_same(fused.swiglu_quantize_triton(gate, up, fp8, interpret=True), want)


def _chunks(key, b, j, n_kv, group):
    """Chunk outputs and the Mosaic kernel's raw lse tiles, with an empty chunk and an empty row."""
    ko, kl = jax.random.split(key)
    h = n_kv * group
    o = jax.random.normal(ko, (b, j, h, 128))
    lse_raw = jax.random.normal(kl, (b, j, n_kv, 64)) * 4
    if j > 1:
        lse_raw = lse_raw.at[0, 1].set(-jnp.inf)  # row 0: its second chunk is empty
        o = o.at[0, 1].set(0.0)
    lse_raw = lse_raw.at[1].set(-jnp.inf)  # row 1: nothing live (zeros out)
    o = o.at[1].set(0.0)
    return o, lse_raw


@pytest.mark.parametrize("j", [1, 2, 4])
@pytest.mark.parametrize("n_kv,group", [(2, 4), (3, 5)])  # group 5: windows off the 8-row grid
def test_combine_quantize_equals_reference(j, n_kv, group):
    b, h = 16, n_kv * group
    o, lse_raw = _chunks(jax.random.key(j * 10 + group), b, j, n_kv, group)
    v_K = jnp.array([0.5, 2.0, 1.5])[:n_kv]
    v_H = jnp.repeat(v_K, group)
    got = fused.combine_quantize_triton(
        o, lse_raw if j > 1 else None, v_K, group=group, out_dtype=jnp.bfloat16, interpret=True
    )
    if j > 1:
        o_BHC = common.combine_splits(o, lse_raw.reshape(b, j, -1)[:, :, _lse_rows(n_kv, group)])
    else:
        o_BHC = o[:, 0]
    o_BHC = (o_BHC * v_H[None, :, None]).astype(jnp.bfloat16)
    _assert_same(got, quantize_activations(o_BHC.reshape(b, h * 128), 128, E4M3))
    if j > 1:
        assert not np.any(_bits(got.values[1]))  # the empty row quantizes to zeros


@pytest.mark.parametrize("j", [1, 4])
def test_combine_quantize_reads_the_swapped_layout(j, n_kv=3, group=5):
    """The swap-AB kernel's transposed chunk outputs ``[B, J, K, C, N]`` (N = 8: three padding
    columns of garbage) and lse ``[B, J, K, N]`` give bit for bit what their unswapped form
    gives."""
    b, n = 16, 8
    o, lse_raw = _chunks(jax.random.key(j), b, j, n_kv, group)
    v_K = jnp.array([0.5, 2.0, 1.5])
    h = np.arange(n_kv * group)
    o_sw = jnp.full((b, j, n_kv, n, 128), 1e9).at[:, :, h // group, h % group].set(o)
    o_sw = jnp.swapaxes(o_sw, -1, -2)
    lse_sw = jnp.full((b, j, n_kv, n), 1e9)
    lse_sw = lse_sw.at[:, :, h // group, h % group].set(
        lse_raw[:, :, h // group, fused.lse_row(h, group)]
    )
    kw = dict(group=group, out_dtype=jnp.bfloat16, interpret=True)
    want = fused.combine_quantize_triton(o, lse_raw if j > 1 else None, v_K, **kw)
    got = fused.combine_quantize_triton(o_sw, lse_sw if j > 1 else None, v_K, **kw)
    np.testing.assert_array_equal(_bits(got.values), _bits(want.values))
    np.testing.assert_array_equal(got.scales, want.scales)


def test_decode_attention_hands_the_o_proj_a_qarray(split=2):
    """``decode_attention(quant_out=...)``: the Hopper kernel (interpret mode) returns its output
    combined and quantized in one launch, equal to quantizing its plain output (two chunks; one
    chunk is ``test_combine_quantize_equals_reference`` with J = 1)."""
    from kernels_pallas.decode_attention import DecodeBlocks, decode_attention

    b, s, n_kv, group = 16, 128, 2, 4
    kq, kk, kv = jax.random.split(jax.random.key(split), 3)
    q = jax.random.normal(kq, (b, n_kv * group, 128), jnp.bfloat16)
    k = (jax.random.normal(kk, (b, s, n_kv, 128)) * 8).astype(E4M3)
    v = (jax.random.normal(kv, (b, s, n_kv, 128)) * 8).astype(E4M3)
    lengths = jnp.arange(b, dtype=jnp.int32) * 5 + 40
    kw = dict(k_scale=jnp.array([0.1, 0.2]), v_scale=jnp.array([0.05, 0.3]), sm_scale=0.088,
              impl="pallas_mosaic_gpu", config=DecodeBlocks(num_splits=split),
              interpret=True)  # fmt: skip
    plain = decode_attention(q, k, v, lengths, **kw)
    got = decode_attention(q, k, v, lengths, quant_out=E4M3, **kw)
    _assert_same(got, quantize_activations(plain.reshape(b, -1), 128, E4M3))
    jaxpr = str(
        jax.make_jaxpr(lambda q: decode_attention(q, k, v, lengths, quant_out=E4M3, **kw))(q)
    )
    assert "combine_quantize_triton" in jaxpr


def test_api_dispatch():
    """``auto`` on CPU is the reference (bit for bit the unfused ops); ``pallas_triton`` runs the
    kernel or says why not; leading axes are kept."""
    x = _rows(jax.random.key(0), 16, 256, jnp.bfloat16).reshape(4, 4, 256)
    w = jnp.ones((256,), jnp.bfloat16)
    auto = api.rmsnorm_quantize(x, w, 1e-6)
    assert auto.shape == (4, 4, 256) and auto.scales.shape == (4, 4, 2)
    _assert_same(auto, quantize_activations(rms_norm(x, w, 1e-6)))
    jaxpr = str(jax.make_jaxpr(lambda x: api.rmsnorm_quantize(x, w, 1e-6).values)(x))
    assert "pallas_call" not in jaxpr
    kern = api.rmsnorm_quantize(x, w, 1e-6, impl="pallas_triton", interpret=True)
    _assert_same(kern, auto)
    y = _rows(jax.random.key(1), 16, 512, jnp.bfloat16).reshape(16, 1, 512)
    g, u = split_gate_up(y, 128)
    ref = quantize_activations(swiglu(g, u))
    _assert_same(api.swiglu_quantize(y), ref)
    _assert_same(api.swiglu_quantize(y, impl="pallas_triton", interpret=True), ref)
    _assert_same(api.swiglu_quantize(gate=g, up=u, impl="pallas_triton", interpret=True), ref)


@pytest.mark.parametrize(
    "call,needle",
    [
        (
            lambda: api.rmsnorm_quantize(
                jnp.ones((5, 256)), jnp.ones(256), 1e-6, impl="pallas_triton"
            ),
            "rows M=5",
        ),
        (
            lambda: api.rmsnorm_quantize(
                jnp.ones((16, 384)), jnp.ones(384), 1e-6, impl="pallas_triton"
            ),
            "D=384",
        ),
        (
            lambda: api.rmsnorm_quantize(jnp.ones((16, 256)), jnp.ones(256), 1e-6, impl="cuda"),
            "impl must be",
        ),
        (
            lambda: api.swiglu_quantize(jnp.ones((16, 384)), impl="pallas_triton"),
            "gate|up width 384",
        ),
        (
            lambda: api.swiglu_quantize(jnp.ones((16, 256))[:, :128], gate=jnp.ones((16, 128))),
            "give gate_up",
        ),
    ],
)
def test_errors_name_the_field(call, needle):
    with pytest.raises(ValueError, match=needle.replace("|", r"\|")):
        call()


def test_combine_rejects_what_it_cannot_take():
    assert "head_dim 64" in fused.combine_supports((16, 2, 8, 64), jnp.bfloat16)
    assert "num_splits 3" in fused.combine_supports((16, 3, 8, 128), jnp.bfloat16)
    assert "rows M=12" in fused.combine_supports((12, 2, 8, 128), jnp.bfloat16)
    assert fused.combine_supports((16, 2, 8, 128), jnp.bfloat16) is None


def test_fp8_input_dtype():
    from kernels_pallas.quantize import quantize_weight

    w = quantize_weight(jnp.ones((256, 128)))
    w5 = quantize_weight(jnp.ones((256, 128)), dtype=E5M2)
    assert api.fp8_input_dtype(w, w) == jnp.dtype(E4M3)
    assert api.fp8_input_dtype(w, w5) is None  # two formats: no common quantized input
    assert api.fp8_input_dtype(w, jnp.ones((256, 128))) is None  # a BF16 GEMM reads it too
    assert api.fp8_input_dtype() is None


@pytest.mark.parametrize(
    "name,fn,shapes",
    [
        ("rmsnorm", lambda x, w: fused.rmsnorm_quantize_triton(x, w, 1e-6),
         [((16, 4096), jnp.bfloat16), ((4096,), jnp.bfloat16)]),
        ("swiglu", lambda y: fused.swiglu_quantize_triton(y), [((16, 24576), jnp.bfloat16)]),
        ("combine", lambda o, lse, v: fused.combine_quantize_triton(
            o, lse, v, group=4, out_dtype=jnp.bfloat16), [((16, 2, 32, 128), jnp.float32),
                                                          ((16, 2, 8, 64), jnp.float32),
                                                          ((8,), jnp.float32)]),
    ],
)  # fmt: skip
def test_gpu_lowering_is_one_triton_launch(name, fn, shapes):
    """Each kernel lowers for CUDA (no device) to one Triton launch whose divisions are XLA's
    (``div.full.f32``: ``pallas_triton.div_xla``), none IEEE ``div.rn``."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    text = aot.export_for("h100", fn, *args).compiled.mlir_module()
    assert text.count("xla.gpu.triton") == 1, name
    assert "div.full.f32" in text and "div.rn" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 64, 4096])
def test_on_the_device_within_one_bf16_rounding(m):
    """On a GPU: each kernel against its reference compiled by XLA on the same device, within
    the quantization step of one BF16 rounding of the producer's output."""
    d, f = 4096, 12288
    x = _rows(jax.random.key(m), m, d, jnp.bfloat16)
    w = (1.0 + 0.3 * jax.random.normal(jax.random.key(1), (d,))).astype(jnp.bfloat16)
    y = _rows(jax.random.key(2), m, 2 * f, jnp.bfloat16, spread=1.0)
    pairs = [
        (fused.rmsnorm_quantize_triton(x, w, 1e-6),
         jax.jit(rmsnorm_quantize_reference, static_argnums=2)(x, w, 1e-6)),
        (fused.swiglu_quantize_triton(y),
         jax.jit(lambda y: swiglu_quantize_reference(*split_gate_up(y, 128)))(y)),
    ]  # fmt: skip
    for got, want in pairs:
        np.testing.assert_allclose(np.asarray(got.scales), np.asarray(want.scales), rtol=2**-7)
        a, b = (np.asarray(dequantize(q, jnp.float32)) for q in (got, want))
        step = np.repeat(np.asarray(want.scales), 128, axis=1) * 32  # e4m3: 3 mantissa bits
        assert np.all(np.abs(a - b) <= np.maximum(np.abs(b) * 2**-3, step * 2**-9) + 1e-30)
