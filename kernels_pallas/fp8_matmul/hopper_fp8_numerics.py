"""Hopper FP8 WGMMA accumulation, emulated on the CPU (numpy), and the device test tolerance.

Model: the ``hopper`` preset of ``mmaemu`` 0.1.0 (``mmaemu/model/presets.py``, validated bit for
bit against cuBLAS FP8 GEMMs on an H100; Fasi et al. 2021, Khattak and Mikaitis 2026): one
tensor-core block FMA adds ``NFMA = 32`` exact FP8 products and the accumulator ``c``; every
term is first truncated (toward zero) to ``FRAC = 13`` fraction bits below the largest exponent
among them, and the block result is kept to ``FRAC_OUT = 13`` fraction bits. So inside one
128-K step (4 block FMAs into a fresh accumulator, as the kernel runs them) the sum carries
~14 significant bits, then the kernel promotes it to f32 with the scales (DeepSeek-V3 §3.3.2).

``DEVICE_REL`` bounds the error of that accumulation relative to the magnitude
``Σ_kb s_x s_w Σ_k |x̂ ŵ|``: each block FMA loses under one unit of 2^-13 of its largest term
per term (worst case, all same sign), but the truncations of 33 terms largely cancel: the
emulated worst is 6.2e-5 of the magnitude (K = 512; 1.8e-5 at K = 2048), so 2^-11 (4.9e-4)
leaves an 8x margin (``test_fp8_matmul.py::test_device_tolerance_covers_emulated_hopper_
accumulation`` checks 4x). Against |y| the same errors reach 50% where y cancels: the old
``rtol=1e-4`` of |y| fails a correct device on 0.1-0.5% of outputs. (The
``mmaemu`` package itself needs torch, which this project does not install; its model is
reimplemented here from the documented preset.)
"""

from __future__ import annotations

import numpy as np

NFMA, FRAC, FRAC_OUT = 32, 13, 13
DEVICE_REL = 2.0**-11  # |y_device - y_exact| <= DEVICE_REL * magnitude + f32 terms


def _exp2_floor(a):
    with np.errstate(divide="ignore"):
        return np.where(a > 0, np.floor(np.log2(np.where(a > 0, a, 1.0))), -np.inf)


def _trunc_to(x, q):
    return np.where(np.isfinite(q) & (q > 0), np.trunc(x / np.where(q > 0, q, 1.0)) * q, 0.0)


def block_fma(c, p):
    """``c`` [M, N] + Σ_i ``p`` [M, N, NFMA] as one Hopper block FMA (float64 exact in between)."""
    terms = np.concatenate([c[..., None], p], axis=-1)
    q = np.exp2(_exp2_floor(np.max(np.abs(terms), axis=-1)) - FRAC)[..., None]
    s = np.sum(_trunc_to(terms, q), axis=-1)
    return _trunc_to(s, np.exp2(_exp2_floor(np.abs(s)) - FRAC_OUT))


def hopper_fp8_matmul(xv, sx, wv, sw):
    """The kernel's arithmetic: per 128-K step 4 block FMAs into a fresh accumulator, then
    ``acc += acc_k · s_x[m, kb] · s_w[nb, kb]`` in f32. ``xv`` [M, K], ``wv`` [N, K] FP8 values
    as float64; ``sx`` [M, K/128], ``sw`` [N/128, K/128]."""
    m, k = xv.shape
    n = wv.shape[0]
    acc = np.zeros((m, n), np.float32)
    for kb in range(k // 128):
        acc_k = np.zeros((m, n))
        for j in range(128 // NFMA):
            sl = slice(kb * 128 + j * NFMA, kb * 128 + (j + 1) * NFMA)
            acc_k = block_fma(acc_k, xv[:, None, sl] * wv[None, :, sl])
        scale = sx[:, kb][:, None] * np.repeat(sw[:, kb], 128)[None, :n]
        acc = acc + (acc_k.astype(np.float32) * scale.astype(np.float32))
    return acc


def magnitude(xv, sx, wv, sw):
    """``Σ_kb s_x s_w Σ_k |x̂ ŵ|`` [M, N]: what the accumulation error scales with."""
    k = xv.shape[1]
    n = wv.shape[0]
    out = 0.0
    for kb in range(k // 128):
        sl = slice(kb * 128, (kb + 1) * 128)
        scale = sx[:, kb][:, None] * np.repeat(sw[:, kb], 128)[None, :n]
        out = out + np.abs(xv[:, sl]) @ np.abs(wv[:, sl]).T * scale
    return out


def device_bound(xv, sx, wv, sw):
    """Elementwise bound on |device - exact| for the Hopper kernel (f32 output)."""
    mag = magnitude(xv, sx, wv, sw)
    return DEVICE_REL * mag + 1e-6 * np.max(mag)
