"""Decode attention: the reference against float64 numpy, the kernels against the reference."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh

from kernels_pallas.decode_attention import (
    DecodeBlocks,
    decode_attention,
    decode_attention_reference,
)

F8 = jnp.float8_e4m3fn


def _np_attention(q, k, v, valid, ks, vs, sm_scale):
    """float64 numpy oracle; ks/vs are None, [K] or [B, S, K]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, h, c = q.shape
    n_kv = k.shape[2]
    g = h // n_kv
    if ks is not None:
        ks = np.asarray(ks, np.float64)
        k = k * (ks[..., None] if ks.ndim == 3 else ks[None, None, :, None])
    if vs is not None:
        vs = np.asarray(vs, np.float64)
        v = v * (vs[..., None] if vs.ndim == 3 else vs[None, None, :, None])
    out = np.zeros((b, h, c))
    for bi in range(b):
        idx = np.nonzero(np.asarray(valid[bi]))[0]
        for hi in range(h):
            if len(idx) == 0:
                continue
            logits = k[bi, idx, hi // g] @ q[bi, hi] * sm_scale
            p = np.exp(logits - logits.max())
            out[bi, hi] = (p / p.sum()) @ v[bi, idx, hi // g]
    return out


def test_reference_hand_case():
    # One head, two valid slots with logits 0 and log 3: weights 1/4, 3/4.
    q = jnp.array([[[1.0, 0.0]]])
    k = jnp.array([[[[0.0, 5.0]], [[np.log(3.0), 0.0]], [[9.0, 9.0]]]])
    v = jnp.array([[[[4.0, 0.0]], [[0.0, 8.0]], [[100.0, 100.0]]]])
    valid = jnp.array([[True, True, False]])
    out = decode_attention_reference(q, k, v, valid, sm_scale=1.0)
    np.testing.assert_allclose(out, [[[1.0, 6.0]]], rtol=1e-6)
    # FP8 with static scales: K̂ = 0.75 (exact in E4M3) times 2 gives logit 1.5; V̂ · 0.5 = v.
    k8 = jnp.array([[[[0.0, 5.0]], [[0.75, 0.0]], [[9.0, 9.0]]]]).astype(F8)
    v8 = (v * 2).astype(F8)
    out = decode_attention_reference(
        q, k8, v8, valid, k_scale=jnp.array([2.0]), v_scale=jnp.array([0.5]), sm_scale=1.0
    )
    w = np.exp(1.5) / (1 + np.exp(1.5))
    np.testing.assert_allclose(out[0, 0], [4.0 * (1 - w), 8.0 * w], rtol=1e-6)


def test_reference_empty_row_is_zero():
    q = jnp.ones((1, 2, 4))
    k = v = jnp.ones((1, 3, 1, 4))
    out = decode_attention_reference(q, k, v, jnp.zeros((1, 3), bool), sm_scale=0.5)
    np.testing.assert_array_equal(out, 0.0)


def _case(seed, b, s, n_kv, group, c, kv_mode):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(b, n_kv * group, c)), jnp.float32)
    k = jnp.asarray(r.normal(size=(b, s, n_kv, c)) * 2, jnp.float32)
    v = jnp.asarray(r.normal(size=(b, s, n_kv, c)), jnp.float32)
    valid = jnp.asarray(r.random((b, s)) < 0.6).at[:, 0].set(True)
    ks = vs = None
    if kv_mode == "static":
        ks = jnp.asarray(r.uniform(0.5, 2.0, n_kv), jnp.float32)
        vs = jnp.asarray(r.uniform(0.5, 2.0, n_kv), jnp.float32)
    elif kv_mode == "dynamic":
        ks = jnp.asarray(r.uniform(0.5, 2.0, (b, s, n_kv)), jnp.float32)
        vs = jnp.asarray(r.uniform(0.5, 2.0, (b, s, n_kv)), jnp.float32)
    if kv_mode == "bf16":
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    elif kv_mode != "f32":
        k, v = k.astype(F8), v.astype(F8)
    return q, k, v, valid, ks, vs


@pytest.mark.parametrize("kv_mode", ["f32", "static", "dynamic"])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_vs_numpy(kv_mode, group):
    q, k, v, valid, ks, vs = _case(0, 2, 9, 2, group, 8, kv_mode)
    out = decode_attention_reference(q, k, v, valid, k_scale=ks, v_scale=vs, sm_scale=0.3)
    expect = _np_attention(q, k, v, valid, ks, vs, 0.3)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)  # f32 vs f64 math


@pytest.mark.parametrize("kv_mode", ["bf16", "static", "dynamic"])
@pytest.mark.parametrize("group", [1, 2])
def test_pallas_tpu_interpret(kv_mode, group):
    q, k, v, valid, ks, vs = _case(1, 2, 40, 2, group, 16, kv_mode)
    kw = dict(k_scale=ks, v_scale=vs, sm_scale=0.25)
    expect = decode_attention_reference(q, k, v, valid, **kw)
    out = decode_attention(
        q, k, v, valid, **kw, impl="pallas_tpu", blocks=DecodeBlocks(16), interpret=True
    )
    # Same f32 math in another order (tiles of 16 slots, S padded 40 -> 48).
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def _gpu_interpret():
    mesh = AbstractMesh(
        (),
        (),
        abstract_device=AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132
        ),
    )
    with (
        jax.sharding.use_abstract_mesh(mesh),
        plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()),
    ):
        yield


@pytest.mark.parametrize("kv_mode", ["bf16", "static", "dynamic"])
@pytest.mark.parametrize("group", [1, 2])
def test_pallas_mosaic_gpu_interpret(kv_mode, group):
    # The GPU interpreter runs one grid block: B = K = 1. C and block_s are wgmma multiples of 64.
    q, k, v, valid, ks, vs = _case(2, 1, 100, 1, group, 64, kv_mode)
    kw = dict(k_scale=ks, v_scale=vs, sm_scale=0.125)
    expect = decode_attention_reference(q, k, v, valid, **kw)
    with _gpu_interpret():
        out = decode_attention(
            q, k, v, valid, **kw, impl="pallas_mosaic_gpu", blocks=DecodeBlocks(64), interpret=True
        )
    # Q and P enter the tensor cores in BF16 (rel. error 2^-9 each): the error is a few 2^-9 of
    # max |V| (up to ~6 here with scales up to 2).
    np.testing.assert_allclose(out, expect, rtol=0, atol=1e-2)


def test_dispatch_rejects_bad_scale_shape():
    q, k, v, valid, _, _ = _case(3, 1, 4, 2, 1, 8, "static")
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention(q, k, v, valid, k_scale=jnp.ones(3), sm_scale=1.0)


@pytest.mark.gpu
def test_pallas_mosaic_gpu_on_device():
    q, k, v, valid, ks, vs = _case(4, 4, 1000, 2, 4, 128, "dynamic")
    kw = dict(k_scale=ks, v_scale=vs, sm_scale=128**-0.5)
    expect = decode_attention_reference(q, k, v, valid, **kw)
    out = decode_attention(q, k, v, valid, **kw, impl="pallas_mosaic_gpu")
    np.testing.assert_allclose(out, expect, rtol=0, atol=1e-2)
