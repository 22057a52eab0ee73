"""PPO policy loss (clip-higher, dual-clip, IS-weighted), KL and entropy terms, value loss.

Every loss returns ``(loss, metrics)`` with ``metrics`` a dict of device scalars (no host syncs).
Components are returned unscaled; the train step combines them as
``pg + kl_coef * kl + entropy_coef * entropy_bonus + vf_coef * value`` with the ``LossConfig``
coefficients (``entropy_bonus`` is ``-H``, so a positive coefficient rewards entropy).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import jax
import jax.numpy as jnp

from fp8rl_jax.fields import check_choices

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLKind = Literal["k1", "k2", "k3"]
AGG_MODES = typing.get_args(AggMode)
KL_KINDS = typing.get_args(KLKind)
_LOG_RATIO_CLAMP = 20.0  # exp(±20) stays finite in fp32 (veRL's safety clamp)
_K3_CLAMP = 10.0  # veRL clamps the per-token low-variance KL to [-10, 10]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Knobs of the PPO objective (DESIGN.md §4.7; paper recipe: token-mean, no KL, no entropy)."""

    clip_low: float = 0.2  # ε_low: ratio lower bound 1 - ε_low
    clip_high: float = 0.28  # ε_high: ratio upper bound 1 + ε_high (DAPO clip-higher)
    dual_clip: float | None = 3.0  # c > 1: loss cap -A·c for A < 0; None disables
    agg: AggMode = "token-mean"  # how token losses are averaged (DESIGN.md §4.7)
    kl_coef: float = 0.0  # weight of the KL-to-reference loss term
    kl_kind: KLKind = "k3"  # KL estimator (Schulman's k1 / k2 / k3)
    entropy_coef: float = 0.0  # weight of the entropy bonus (-H) term
    vf_coef: float = 0.5  # weight of the value loss (PPO with a critic)
    vf_clip: float | None = 0.5  # value clip range around the old values; None disables

    def __post_init__(self):
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"LossConfig.clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"LossConfig.clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"LossConfig.dual_clip must be > 1 or None, got {self.dual_clip}")
        check_choices(self)
        for name in ("kl_coef", "entropy_coef", "vf_coef"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"LossConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.vf_clip is not None and self.vf_clip <= 0.0:
            raise ValueError(f"LossConfig.vf_clip must be > 0 or None, got {self.vf_clip}")


def masked_mean(x, mask, axis=None):
    """Mean of ``x`` over entries where ``mask`` is nonzero; 0 where nothing is valid."""
    valid = mask > 0
    total = jnp.sum(jnp.where(valid, x, 0.0), axis=axis)
    count = jnp.sum(valid.astype(jnp.float32), axis=axis)
    return total / jnp.maximum(count, 1.0)


def aggregate_loss(loss_BT, mask_BT, agg: str = "token-mean"):
    """Reduce a per-token loss to a scalar over ``mask_BT`` (veRL ``agg_loss``).

    token-mean:          Σ_bt m·ℓ / Σ_bt m
    seq-mean-token-sum:  mean_b Σ_t m·ℓ       over sequences with at least one valid token
    seq-mean-token-mean: mean_b (Σ_t m·ℓ / Σ_t m)   over the same sequences
    Masked tokens leave every denominator.
    """
    if agg == "token-mean":
        return masked_mean(loss_BT, mask_BT)
    seq_valid_B = jnp.any(mask_BT > 0, axis=-1)
    if agg == "seq-mean-token-sum":
        seq_loss_B = jnp.sum(jnp.where(mask_BT > 0, loss_BT, 0.0), axis=-1)
    elif agg == "seq-mean-token-mean":
        seq_loss_B = masked_mean(loss_BT, mask_BT, axis=-1)
    else:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    return masked_mean(seq_loss_B, seq_valid_B)


def policy_loss(logp_BT, logp_old_BT, advantages_BT, mask_BT, is_weights_BT, keep_BT, cfg):
    """Decoupled PPO clipped surrogate with clip-higher, dual-clip and rollout IS weights.

    r_t = exp(clamp(lp_θ − lp_old, −20, 20))
    ℓ_t = max(−A_t r_t, −A_t clip(r_t, 1 − ε_low, 1 + ε_high))
    ℓ_t = min(ℓ_t, −c A_t)                     if A_t < 0   (dual-clip)
    L   = agg(sg(w_t) · ℓ_t; mask · keep)

    ``w_t`` (stop-gradient) and ``keep`` come from ``rollout_correction``; rejected tokens leave the
    aggregation denominator. Metrics: ``clipfrac_high`` (A > 0, upper clip binds),
    ``clipfrac_low`` (A < 0, lower clip binds), ``clipfrac_dual`` (dual clip binds),
    ``approx_kl`` = mean(r − 1 − log r) (k3 estimate of KL(π_old‖π_θ)), ``ratio_mean``.

    References: Schulman et al. 2017 (PPO); Ye et al. 2019 (dual-clip); DAPO, arXiv 2503.14476
    (clip-higher); FP8-RL, arXiv 2601.18150 and veRL ``compute_policy_loss_vanilla`` (IS weights).
    """
    f32 = jnp.float32
    m_BT = mask_BT.astype(f32) * keep_BT.astype(f32)
    # Padding may hold -inf / NaN log-probs; zero it before it can reach a gradient as 0 * NaN.
    valid_BT = m_BT > 0
    adv_BT = jnp.where(valid_BT, advantages_BT.astype(f32), 0.0)
    log_ratio_BT = jnp.where(valid_BT, logp_BT.astype(f32) - logp_old_BT.astype(f32), 0.0)
    log_ratio_BT = jnp.clip(log_ratio_BT, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    weights_BT = jax.lax.stop_gradient(jnp.where(valid_BT, is_weights_BT.astype(f32), 0.0))
    ratio_BT = jnp.exp(log_ratio_BT)
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss_BT = jnp.maximum(unclipped_BT, clipped_BT)
    clip_binds_BT = clipped_BT > unclipped_BT
    if cfg.dual_clip is not None:
        dual_BT = -adv_BT * cfg.dual_clip
        dual_binds_BT = (adv_BT < 0) & (dual_BT < loss_BT)
        loss_BT = jnp.where(adv_BT < 0, jnp.minimum(loss_BT, dual_BT), loss_BT)
    else:
        dual_binds_BT = jnp.zeros_like(clip_binds_BT)
    loss_BT = loss_BT * weights_BT
    loss = aggregate_loss(loss_BT, m_BT, cfg.agg)
    metrics = {
        "pg_loss": loss,
        "clipfrac_high": masked_mean((clip_binds_BT & (adv_BT > 0)).astype(f32), m_BT),
        "clipfrac_low": masked_mean((clip_binds_BT & (adv_BT < 0)).astype(f32), m_BT),
        "clipfrac_dual": masked_mean(dual_binds_BT.astype(f32), m_BT),
        "approx_kl": masked_mean(ratio_BT - 1.0 - log_ratio_BT, m_BT),
        "ratio_mean": masked_mean(ratio_BT, m_BT),
    }
    return loss, jax.lax.stop_gradient(metrics)


def kl_penalty(logp_BT, logp_ref_BT, kind: str = "k3"):
    """Per-token estimator of KL(π_θ‖π_ref) from samples of π_θ (Schulman, "Approximating KL").

    With δ = lp_ref − lp_θ:   k1 = −δ,   k2 = ½ δ²,   k3 = exp(δ) − 1 − δ  (clamped to ±10 as veRL).
    Usable as a loss term (``kl_loss``) or as a per-token reward penalty ``r_t − β·kl_t``.
    """
    delta_BT = jnp.clip(
        logp_ref_BT.astype(jnp.float32) - logp_BT.astype(jnp.float32),
        -_LOG_RATIO_CLAMP,
        _LOG_RATIO_CLAMP,
    )
    if kind == "k1":
        return -delta_BT
    if kind == "k2":
        return 0.5 * jnp.square(delta_BT)
    if kind == "k3":
        return jnp.clip(jnp.exp(delta_BT) - 1.0 - delta_BT, -_K3_CLAMP, _K3_CLAMP)
    raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")


def kl_loss(logp_BT, logp_ref_BT, mask_BT, cfg):
    """KL-to-reference loss term: agg(kl_penalty(lp_θ, lp_ref, cfg.kl_kind); mask), unscaled."""
    loss = aggregate_loss(kl_penalty(logp_BT, logp_ref_BT, cfg.kl_kind), mask_BT, cfg.agg)
    return loss, {"kl_ref": jax.lax.stop_gradient(loss)}


def entropy_from_logits(logits_BTV):
    """Entropy of softmax(z) per position: H = logsumexp(z) − Σ_v softmax(z)_v z_v (fp32)."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    probs_BTV = jax.nn.softmax(logits_BTV, axis=-1)
    return jax.nn.logsumexp(logits_BTV, axis=-1) - jnp.sum(probs_BTV * logits_BTV, axis=-1)


def entropy_bonus(entropy_BT, mask_BT, cfg):
    """Entropy bonus as a loss to minimize: −agg(H; mask), unscaled (multiply by entropy_coef)."""
    entropy = aggregate_loss(entropy_BT, mask_BT, cfg.agg)
    return -entropy, {"entropy": jax.lax.stop_gradient(entropy)}


def value_loss(
    values_BT, old_values_BT, returns_BT, mask_BT, clip: float | None = 0.5, agg="token-mean"
):
    """PPO clipped value loss (veRL ``compute_value_loss``).

    V_clip = V_old + clip(V − V_old, −ε_v, ε_v)
    L_V    = ½ · agg(max((V − R)², (V_clip − R)²); mask)     (plain ½·(V − R)² when clip is None)
    Metric ``vf_clipfrac``: fraction of tokens where the clipped error is the larger one.
    """
    f32 = jnp.float32
    values_BT, old_values_BT, returns_BT = (
        x.astype(f32) for x in (values_BT, old_values_BT, returns_BT)
    )
    err_BT = jnp.square(values_BT - returns_BT)
    if clip is None:
        loss_BT, clipped_more_BT = err_BT, jnp.zeros_like(err_BT)
    else:
        v_clip_BT = old_values_BT + jnp.clip(values_BT - old_values_BT, -clip, clip)
        err_clip_BT = jnp.square(v_clip_BT - returns_BT)
        loss_BT = jnp.maximum(err_BT, err_clip_BT)
        clipped_more_BT = (err_clip_BT > err_BT).astype(f32)
    loss = 0.5 * aggregate_loss(loss_BT, mask_BT, agg)
    metrics = {"vf_loss": loss, "vf_clipfrac": masked_mean(clipped_more_BT, mask_BT)}
    return loss, jax.lax.stop_gradient(metrics)
