"""Static FP8 KV-cache scales from Q/K/V amax statistics (trainer-side recalibration, §4.5)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from fractions import Fraction

import jax
import jax.numpy as jnp

from kernels_pallas.qarray import fp8_max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVScales:
    """Per-layer, per-head dequantization scales (``x ≈ x̂ · s``), float32 [L, K] (q: [L, heads])."""

    k: jax.Array
    v: jax.Array
    q: jax.Array
    num_invalid: jax.Array  # int32: amax entries that were 0, NaN or Inf (their scale is replaced)


def _qkv(stats) -> tuple[jax.Array, jax.Array, jax.Array]:
    if isinstance(stats, Mapping):
        return stats["q"], stats["k"], stats["v"]
    if isinstance(stats, tuple | list):
        q, k, v = stats
        return q, k, v
    if hasattr(stats, "k_LK"):  # models.QKVAmax
        return stats.q_LK, stats.k_LK, stats.v_LK
    return stats.q, stats.k, stats.v


def _reduce_microbatches(amax: jax.Array, percentile: float | None) -> jax.Array:
    """Nearest-rank percentile (or max) over the micro-batch axis of [M, L, K]; [L, K] passes."""
    amax = jnp.asarray(amax, jnp.float32)
    if amax.ndim == 2:
        return amax
    if amax.ndim != 3:
        raise ValueError(f"calibrate_kv_scales: amax must be [L, K] or [M, L, K], got {amax.shape}")
    m = amax.shape[0]
    if percentile is None or percentile >= 100.0:
        return jnp.max(amax, axis=0)
    # Nearest rank: the ceil(p/100 · M)-th smallest, in exact decimal arithmetic (99.9% of 2000
    # is 1998, which float math rounds to 1998.0000000000002).
    rank = max(1, math.ceil(Fraction(str(percentile)) * m / 100))
    return jnp.sort(amax, axis=0)[rank - 1]


def calibrate_kv_scales(
    stats,
    percentile: float | None = 99.9,
    margin: float = 1.05,
    fp8_dtype: str = "float8_e4m3fn",
    *,
    previous: KVScales | None = None,
) -> KVScales:
    """Static per-layer Q/K/V FP8 scales from amax stats (NeMo-RL ``calibrate_qkv_fp8_scales``).

    For each tensor X in {Q, K, V}, layer l and head h, with micro-batch maxima ``a_{m,l,h}``:
    ``p_{l,h} = nearest-rank-percentile_{percentile}({a_{m,l,h}}_m)`` (max if ``percentile`` is
    None or 100), ``s_{l,h} = margin · p_{l,h} / FP8_MAX`` (FP8_MAX = 448 for E4M3); the cache
    stores ``x̂ = cast(clamp(x / s))``. Reference: FP8-RL (arXiv 2601.18150) §3.2; NeMo-RL
    ``calibrate_qkv_fp8_scales``. ``stats`` holds ``q``, ``k``, ``v`` amax arrays ([L, K] or
    [M, L, K]) as a mapping, a tuple, attributes or a ``models.QKVAmax`` (``*_LK``).

    Scales never fall back silently to 1.0: an amax that is 0, NaN or Inf raises ``ValueError``
    when called eagerly. Under ``jit`` it is counted in ``num_invalid`` and its scale is taken from
    ``previous`` (when given) or set to NaN, which poisons the cache visibly.
    """
    if not margin > 0:
        raise ValueError(f"calibrate_kv_scales: margin must be > 0, got {margin}")
    if percentile is not None and not 0.0 < percentile <= 100.0:
        raise ValueError(f"calibrate_kv_scales: percentile must be in (0, 100], got {percentile}")
    q, k, v = _qkv(stats)
    fmax = fp8_max(fp8_dtype)
    out, num_invalid = {}, jnp.zeros((), jnp.int32)
    for name, amax in (("q", q), ("k", k), ("v", v)):
        p = _reduce_microbatches(amax, percentile)
        bad = ~jnp.isfinite(p) | (p <= 0.0)
        if not isinstance(p, jax.core.Tracer) and bool(jnp.any(bad)):
            raise ValueError(
                f"calibrate_kv_scales: {name} amax has {int(jnp.sum(bad))} entries that are 0, NaN"
                f" or Inf (at {jnp.argwhere(bad).tolist()}); refusing to invent a scale"
            )
        scale = margin * p / fmax
        fallback = jnp.nan if previous is None else getattr(previous, name)
        out[name] = jnp.where(bad, fallback, scale).astype(jnp.float32)
        num_invalid = num_invalid + jnp.sum(bad).astype(jnp.int32)
    return KVScales(k=out["k"], v=out["v"], q=out["q"], num_invalid=num_invalid)
