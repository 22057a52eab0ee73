"""FP8 KV-cache scales: the one ``KVScales`` type, its calibration from ``QKVAmax``, and the rule
that stores new K/V vectors in the cache dtype (both caches use it, so a token has the same stored
bits in either).

Scale modes (DESIGN.md §4.5), ``x ≈ x̂ · s``: ``none`` (BF16/F32 cache, no scales); ``static``
(one FP32 scale per layer and KV head, ``KVScales.k``/``.v`` [L, K], recalibrated by the trainer
from the scoring pass's ``QKVAmax``); ``dynamic`` (one FP32 scale per written vector,
``s = max(amax_C |x|, tiny) / fp8_max``, computed when it is written).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from fp8rl_jax.models.transformer import QKVAmax
from kernels_pallas.qarray import SCALE_TINY, fp8_max
from kernels_pallas.quantize import saturating_cast

Mode = Literal["none", "static", "dynamic"]
MODES = ("none", "static", "dynamic")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVScales:
    """Static per-layer, per-head dequantization scales (``x ≈ x̂ · s``), float32 [L, K]: the one
    form from calibration to the caches (and the train state's checkpoint)."""

    k: jax.Array  # [L, K]
    v: jax.Array  # [L, K]
    q: jax.Array  # [L, K]: Q per KV-head group (FP8 attention, ``RolloutConfig.fp8_attention``)
    num_invalid: jax.Array  # int32: amax entries that were 0, NaN or Inf (their scale is replaced)

    @classmethod
    def of(cls, k_LK, v_LK, q_LK=None) -> KVScales:
        """Given K/V scales (benchmarks, AOT cases); a missing Q scale is NaN, never 1.0."""
        k = jnp.asarray(k_LK, jnp.float32)
        q = jnp.full_like(k, jnp.nan) if q_LK is None else jnp.asarray(q_LK, jnp.float32)
        return cls(k, jnp.asarray(v_LK, jnp.float32), q, jnp.zeros((), jnp.int32))


class LayerKV(NamedTuple):
    """One layer's cache buffers: K and V in the cache dtype and their scales (None: no scales
    (``none``) or the static per-head [K] scales, which ``static`` caches do not rewrite)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None
    v_scale: jax.Array | None


def with_layers(cache, writes: list[LayerKV], **changes):
    """``cache`` (dense or paged) holding every layer's new buffers; static scales are kept."""
    dynamic = cache.mode == "dynamic"
    return dataclasses.replace(
        cache,
        k=[w.k for w in writes],
        v=[w.v for w in writes],
        k_scale=[w.k_scale for w in writes] if dynamic else cache.k_scale,
        v_scale=[w.v_scale for w in writes] if dynamic else cache.v_scale,
        **changes,
    )


def check_mode(who: str, dtype, mode: str) -> None:
    """A cache's dtype and scale mode agree: FP8 iff ``static``/``dynamic``."""
    if mode not in MODES:
        raise ValueError(f"{who}: mode {mode!r} not in {MODES}")
    if jnp.dtype(dtype).name.startswith("float8") == (mode == "none"):
        raise ValueError(f"{who}: dtype {jnp.dtype(dtype).name} needs mode static|dynamic iff FP8")


def per_layer_scale(name: str, scale, n_layers: int, n_kv: int) -> list[jax.Array]:
    """A static scale given as [L], [L, 1] or [L, K] -> one [K] f32 array per layer."""
    arr = jnp.asarray(scale, jnp.float32)
    if arr.ndim == 1 and arr.shape[0] == n_layers:
        arr = arr[:, None]
    if arr.ndim != 2 or arr.shape[0] != n_layers or arr.shape[1] not in (1, n_kv):
        raise ValueError(
            f"init_cache: {name} must have shape [L], [L, 1] or [L, K], got {arr.shape}"
        )
    arr = jnp.broadcast_to(arr, (n_layers, n_kv))
    return [arr[i] for i in range(n_layers)]


def quantize_kv(x_BTKC: jax.Array, mode: str, dtype, scale=None):
    """(stored values, stored scale or None): the cache-dtype form of new K or V vectors."""
    if mode == "none":
        return x_BTKC.astype(dtype), None
    x = x_BTKC.astype(jnp.float32)
    if mode == "static":
        return saturating_cast(x / scale[:, None], dtype), None
    s_BTK = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), SCALE_TINY) / fp8_max(dtype)
    return saturating_cast(x / s_BTK[..., None], dtype), s_BTK


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
    stats: QKVAmax,
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
    ``calibrate_qkv_fp8_scales``. ``stats``: a ``QKVAmax`` whose arrays are [L, K] or [M, L, K]
    (M micro-batches).

    Scales never fall back silently to 1.0: an amax that is 0, NaN or Inf raises ``ValueError``
    when called eagerly. Under ``jit`` it is counted in ``num_invalid`` and its scale is taken from
    ``previous`` (when given) or set to NaN, which poisons the cache visibly.
    """
    if not margin > 0:
        raise ValueError(f"calibrate_kv_scales: margin must be > 0, got {margin}")
    if percentile is not None and not 0.0 < percentile <= 100.0:
        raise ValueError(f"calibrate_kv_scales: percentile must be in (0, 100], got {percentile}")
    q, k, v = stats.q_LK, stats.k_LK, stats.v_LK
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
