"""Rotary position embeddings with the HF scaling variants (default, linear, llama3, yarn)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.models.config import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(r: RopeConfig, dim: int, inv_freq: np.ndarray) -> tuple[np.ndarray, float]:
    attention_factor = r.attention_factor
    if attention_factor is None:
        if r.mscale and r.mscale_all_dim:
            attention_factor = _yarn_mscale(r.factor, r.mscale) / _yarn_mscale(
                r.factor, r.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(r.factor)

    def correction_dim(n_rot: float) -> float:
        omax = r.original_max_position_embeddings
        return dim * math.log(omax / (n_rot * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoids a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    interpolation = (inv_freq / np.float32(r.factor)).astype(np.float32)
    out = interpolation * (1 - extrapolation) + inv_freq * extrapolation
    return out.astype(np.float32), float(attention_factor)


def _llama3(r: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    omax = r.original_max_position_embeddings
    low_wavelen = omax / r.low_freq_factor
    high_wavelen = omax / r.high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq).astype(np.float32)
    smooth = (omax / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_frequencies(r: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """``(inv_freq [C/2] float32, attention_scaling)`` exactly as HF ``ROPE_INIT_FUNCTIONS``.

    ``inv_freq_i = theta^(-2i/C)``, then rescaled per ``r.type``: linear ``/ factor``; llama3
    (Meta Llama 3.1) divides low frequencies by ``factor`` and interpolates the band between;
    yarn (Peng et al. 2023, arXiv 2309.00071) blends interpolated and extrapolated frequencies with
    a linear ramp over ``[low, high]`` and scales cos/sin by ``0.1 ln(factor) + 1``.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(r.theta) ** exponent)).astype(np.float32)
    if r.type == "default":
        return inv_freq, 1.0
    if r.type == "linear":
        return (inv_freq / np.float32(r.factor)).astype(np.float32), 1.0
    if r.type == "llama3":
        return _llama3(r, inv_freq), 1.0
    if r.type == "yarn":
        return _yarn(r, head_dim, inv_freq)
    raise ValueError(f"rope type {r.type!r} unsupported")


def rope_cos_sin(positions_BT: jax.Array, r: RopeConfig, head_dim: int, dtype):
    """cos, sin [B, T, C] (f32 math, then cast to the compute dtype as HF does)."""
    inv_freq, scaling = rope_frequencies(r, head_dim)
    freqs_BTc = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb_BTC = jnp.concatenate([freqs_BTc, freqs_BTc], axis=-1)
    return (jnp.cos(emb_BTC) * scaling).astype(dtype), (jnp.sin(emb_BTC) * scaling).astype(dtype)


def apply_rope(x_BTNC: jax.Array, cos_BTC: jax.Array, sin_BTC: jax.Array) -> jax.Array:
    """``x·cos + rotate_half(x)·sin`` with the half-split (non-interleaved) HF layout."""
    x1, x2 = jnp.split(x_BTNC, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_BTNC * cos_BTC[:, :, None, :] + rotated * sin_BTC[:, :, None, :]
