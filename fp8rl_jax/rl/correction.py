"""Rollout correction for the FP8-rollout / BF16-trainer mismatch: TIS, MIS/RS, IcePop, metrics.

Follows veRL ``rollout_corr_helper.py`` (DESIGN.md §4.6). Per response token,
``log ρ_t = clamp(lp_old[t] − lp_rollout[t], −20, 20)`` (decoupled mode: π_old is the BF16
recompute). All outputs are stop-gradient.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

import jax
import jax.numpy as jnp

from fp8rl_jax.fields import check_choices
from fp8rl_jax.rl.losses import masked_mean

ISLevel = Literal["token", "sequence"]
RSLevel = Literal["token", "sequence", "geometric"]
IS_LEVELS = (None, *typing.get_args(ISLevel))
RS_LEVELS = (None, *typing.get_args(RSLevel))
_LOG_RATIO_CLAMP = 20.0  # veRL safety clamp: exp(±20) is finite in fp32, and so is its square


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """How the rollout/trainer mismatch is corrected (defaults: the paper's token TIS, C = 2)."""

    is_level: ISLevel | None = "token"  # importance weights: None | token | sequence
    is_threshold: float = 2.0  # C: truncation cap of the TIS weight (>= 1)
    rs_level: RSLevel | None = None  # rejection: None | token | sequence | geometric
    rs_upper: float = 2.0  # RS keeps ratios <= rs_upper (>= 1)
    rs_lower: float | None = None  # RS keeps ratios >= rs_lower; None means 1 / rs_upper
    rs_veto_threshold: float | None = None  # drop a sequence if any ρ_t < this (e.g. 1e-4)
    icepop: bool = False  # token weights ρ_t·1{lo ≤ ρ_t ≤ hi} instead of min(ρ_t, C)
    icepop_low: float = 0.5  # IcePop lower bound lo (<= 1)
    icepop_high: float = 5.0  # IcePop upper bound hi (>= 1)
    batch_normalize: bool = False  # rescale weights to mean 1 over kept tokens (sequences)
    bypass: bool = False  # π_old := π_rollout (no BF16 recompute): every ρ is 1

    def __post_init__(self):
        check_choices(self)
        lo, hi = self.icepop_low, self.icepop_high
        checks = (
            ("is_threshold", self.is_threshold >= 1.0, ">= 1"),
            ("rs_upper", self.rs_upper >= 1.0, ">= 1"),
            ("rs_lower", self.rs_lower is None or 0.0 < self.rs_lower <= 1.0, "in (0, 1] or None"),
            (
                "rs_veto_threshold",
                self.rs_veto_threshold is None or 0.0 < self.rs_veto_threshold <= 1.0,
                "in (0, 1] or None",
            ),
            (
                "icepop",
                not self.icepop or self.is_level == "token",
                "False unless is_level='token'",
            ),
            ("icepop_low", 0.0 <= lo <= 1.0, "in [0, 1]"),
            ("icepop_high", hi >= 1.0, ">= 1"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(
                    f"RolloutCorrectionConfig.{name} must be {allowed}, got {getattr(self, name)!r}"
                )

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """(lower, upper) bounds of the rejection-sampling ratio."""
        lower = 1.0 / self.rs_upper if self.rs_lower is None else self.rs_lower
        return lower, self.rs_upper


def rollout_correction(logp_old_BT, logp_rollout_BT, mask_BT, cfg: RolloutCorrectionConfig):
    """Importance weights, rejection mask and mismatch metrics for an FP8 rollout.

    log ρ_t = clamp(lp_old − lp_rollout, −20, 20);  ρ_t = exp(log ρ_t);  S = Σ_t log ρ_t
    Token TIS:     w_t = min(ρ_t, C)
    Sequence TIS:  w_t = min(exp(clamp(S, −20, 20)), C)         (same for every token of the seq)
    IcePop:        w_t = ρ_t · 1{lo ≤ ρ_t ≤ hi}
    Token RS:      keep_t ⇔ l ≤ ρ_t ≤ u
    Sequence RS:   keep_seq ⇔ l ≤ exp(S) ≤ u;  geometric RS: keep_seq ⇔ l ≤ exp(S / n_valid) ≤ u
    Veto:          drop the sequence if min_t ρ_t < τ
    Batch-norm:    w ← w / mean(w) over kept tokens (token level) or kept sequences (sequence level)
    Bypass:        π_old := π_rollout, so ρ ≡ 1 (weights 1, nothing rejected); metrics still compare
                   the given ``logp_old_BT`` with ``logp_rollout_BT`` (pass π_θ to monitor it).

    Returns ``(is_weights_BT, keep_BT, metrics)``: fp32 weights, 1.0 where no IS applies and 0
    outside ``mask_BT``; ``keep_BT`` = mask after rejection, same dtype as ``mask_BT``; metrics
    as in ``mismatch_metrics``.

    References: FP8-RL, arXiv 2601.18150; veRL ``rollout_corr_helper.py``; Yao et al. 2025 (TIS);
    Liu, Li et al. 2025 "When Speed Kills Stability" (MIS, Geo-RS); IcePop (Ling team, 2025).
    """
    valid_BT = mask_BT > 0
    logp_old_BT = jnp.where(valid_BT, logp_old_BT.astype(jnp.float32), 0.0)
    logp_rollout_BT = jnp.where(valid_BT, logp_rollout_BT.astype(jnp.float32), 0.0)
    logp_old_BT, logp_rollout_BT = jax.lax.stop_gradient((logp_old_BT, logp_rollout_BT))
    if cfg.bypass:
        log_rho_BT = jnp.zeros_like(logp_old_BT)
    else:
        log_rho_BT = jnp.clip(logp_old_BT - logp_rollout_BT, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)

    keep_BT = valid_BT & _rejection_keep(log_rho_BT, valid_BT, cfg)
    weights_BT = _is_weights(log_rho_BT, cfg)
    if cfg.batch_normalize and cfg.is_level is not None:
        weights_BT = _batch_normalize(weights_BT, keep_BT, cfg.is_level)
    weights_BT = jnp.where(valid_BT, weights_BT, 0.0)

    metrics = mismatch_metrics(logp_old_BT, logp_rollout_BT, mask_BT, weights_BT, keep_BT, cfg)
    return weights_BT, keep_BT.astype(mask_BT.dtype), metrics


def _is_weights(log_rho_BT, cfg):
    if cfg.is_level is None:
        return jnp.ones_like(log_rho_BT)
    if cfg.is_level == "token":
        rho_BT = jnp.exp(log_rho_BT)
        if cfg.icepop:
            in_band_BT = (rho_BT >= cfg.icepop_low) & (rho_BT <= cfg.icepop_high)
            return jnp.where(in_band_BT, rho_BT, 0.0)
        return jnp.minimum(rho_BT, cfg.is_threshold)
    seq_log_rho_B = jnp.clip(jnp.sum(log_rho_BT, axis=-1), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    seq_w_B = jnp.minimum(jnp.exp(seq_log_rho_B), cfg.is_threshold)
    return jnp.broadcast_to(seq_w_B[:, None], log_rho_BT.shape)


def _rejection_keep(log_rho_BT, valid_BT, cfg):
    lower, upper = cfg.rs_bounds
    keep_BT = jnp.ones_like(valid_BT)
    if cfg.rs_level == "token":
        rho_BT = jnp.exp(log_rho_BT)
        keep_BT = (rho_BT >= lower) & (rho_BT <= upper)
    elif cfg.rs_level in ("sequence", "geometric"):
        stat_B = jnp.sum(log_rho_BT, axis=-1)  # log Π ρ_t (padding holds log ρ = 0)
        if cfg.rs_level == "geometric":
            stat_B = masked_mean(log_rho_BT, valid_BT, axis=-1)
        keep_B = (stat_B >= math.log(lower)) & (stat_B <= math.log(upper))
        keep_BT = jnp.broadcast_to(keep_B[:, None], valid_BT.shape)
    if cfg.rs_veto_threshold is not None:
        vetoed_BT = valid_BT & (jnp.exp(log_rho_BT) < cfg.rs_veto_threshold)
        keep_BT = keep_BT & ~jnp.any(vetoed_BT, axis=-1, keepdims=True)
    return keep_BT


def _batch_normalize(weights_BT, keep_BT, is_level):
    if is_level == "sequence":
        mean_w = masked_mean(weights_BT[:, 0], jnp.any(keep_BT, axis=-1))
    else:
        mean_w = masked_mean(weights_BT, keep_BT)
    return weights_BT / jnp.where(mean_w > 0, mean_w, 1.0)


def mismatch_metrics(logp_old_BT, logp_rollout_BT, mask_BT, weights_BT, keep_BT, cfg):
    """Rollout/trainer mismatch metrics over valid tokens (veRL ``compute_offpolicy_metrics``).

    kl = mean(lp_roll − lp_old) (k1);  k3_kl = mean(ρ − 1 − log ρ);  chi2_token = E[ρ²] − 1;
    chi2_seq = E_seq[exp(2 clamp(S, ±20))] − 1;  per sequence, m̄ = mean_t lp:
    training_ppl = E_seq exp(−m̄_old), rollout_ppl = E_seq exp(−m̄_roll),
    log_ppl_diff = E_seq(m̄_roll − m̄_old), ppl_ratio = E_seq exp(m̄_roll − m̄_old) (train/rollout ppl);
    is_weight_{mean,max,min,std}; is_ratio_fraction_{high,low}: ρ > C, ρ < 1/C;
    masked_{token,seq}_fraction; ess = (Σw)² / (N Σw²) over kept tokens;
    token_mult_prob_error = mean exp(|lp_roll − lp_old|);
    probs_diff_{mean,max,std} = |p_old − p_roll| (probability space, veRL debug metrics), the std
    with Bessel's correction as ``torch.std`` in veRL: sqrt(Σ (d − d̄)² / (N − 1)), 0 for N <= 1
    (torch gives NaN there);
    probs_pearson = corr(p_roll, p_old) (0 when either has zero variance).
    Per length bucket (``kl_by_length``): kl_pos{a}, tokens_pos{a}, seq_kl_len{a}, seqs_len{a}.
    Every metric is a finite fp32 scalar, 0 when the mask is empty (denominators are guarded).
    """
    f32 = jnp.float32
    valid_BT = mask_BT > 0
    seq_valid_B = jnp.any(valid_BT, axis=-1)
    diff_BT = jnp.where(valid_BT, logp_rollout_BT - logp_old_BT, 0.0)
    log_rho_BT = jnp.clip(-diff_BT, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    rho_BT = jnp.exp(log_rho_BT)
    seq_log_rho_B = jnp.clip(jnp.sum(log_rho_BT, axis=-1), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)

    def tok_mean(x_BT):
        return masked_mean(x_BT, valid_BT)

    def seq_mean(x_B):
        return masked_mean(x_B, seq_valid_B)

    mean_lp_old_B = masked_mean(logp_old_BT, valid_BT, axis=-1)
    mean_lp_roll_B = masked_mean(logp_rollout_BT, valid_BT, axis=-1)
    log_ppl_diff_B = mean_lp_roll_B - mean_lp_old_B
    c = cfg.is_threshold
    metrics = {
        "kl": tok_mean(diff_BT),
        "k3_kl": tok_mean(rho_BT - 1.0 - log_rho_BT),
        "training_ppl": seq_mean(jnp.exp(-mean_lp_old_B)),
        "rollout_ppl": seq_mean(jnp.exp(-mean_lp_roll_B)),
        "log_ppl_diff": seq_mean(log_ppl_diff_B),
        "log_ppl_abs_diff": seq_mean(jnp.abs(log_ppl_diff_B)),
        "ppl_ratio": seq_mean(
            jnp.exp(jnp.clip(log_ppl_diff_B, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        ),
        "chi2_token": tok_mean(jnp.expm1(2.0 * log_rho_BT)),
        "chi2_seq": seq_mean(jnp.expm1(2.0 * seq_log_rho_B)),
        "is_ratio_fraction_high": tok_mean((rho_BT > c).astype(f32)),
        "is_ratio_fraction_low": tok_mean((rho_BT < 1.0 / c).astype(f32)),
        "masked_token_fraction": tok_mean((~keep_BT.astype(bool)).astype(f32)),
        "masked_seq_fraction": seq_mean(
            jnp.any(valid_BT & ~keep_BT.astype(bool), axis=-1).astype(f32)
        ),
        "token_mult_prob_error": tok_mean(jnp.exp(jnp.minimum(jnp.abs(diff_BT), 20.0))),
    }
    metrics |= _weight_stats(weights_BT, valid_BT, keep_BT)
    metrics |= _prob_stats(jnp.exp(logp_old_BT), jnp.exp(logp_rollout_BT), valid_BT)
    metrics |= kl_by_length(diff_BT, valid_BT)
    return jax.lax.stop_gradient(metrics)


def length_edges(max_len: int) -> tuple[int, ...]:
    """Bucket starts 0, 32, 64, 128, ... below ``max_len`` (the ``kl_by_length`` buckets)."""
    edges, e = [0], 32
    while e < max_len:
        edges.append(e)
        e *= 2
    return tuple(edges)


def kl_by_length(diff_BT, valid_BT):
    """Mismatch KL per response-position bucket and per response-length bucket.

    With d_t = lp_roll − lp_old, p_t the index of token t in its response (0 first) and n_b the
    response length of row b, for each bucket [a, a') of ``length_edges(T)`` (last: [a, ∞)):
    kl_pos{a} = mean d_t over valid tokens with a <= p_t < a'  (does the per-token mismatch grow
    along the response?), tokens_pos{a} = their count; seq_kl_len{a} = mean Σ_t d_t over rows with
    a <= n_b < a' (the sequence log-ratio, which grows with length), seqs_len{a} = their count.
    An empty bucket gives 0 with count 0; weight by the counts when averaging over steps.
    """
    f32 = jnp.float32
    edges = length_edges(diff_BT.shape[-1])
    pos_BT = jnp.cumsum(valid_BT.astype(jnp.int32), axis=-1) - 1
    len_B = jnp.sum(valid_BT.astype(jnp.int32), axis=-1)
    seq_kl_B = jnp.sum(jnp.where(valid_BT, diff_BT, 0.0), axis=-1)
    out = {}
    for a, b in zip(edges, (*edges[1:], None), strict=True):
        in_tok_BT = valid_BT & (pos_BT >= a) & (True if b is None else pos_BT < b)
        in_seq_B = (len_B >= max(a, 1)) & (True if b is None else len_B < b)
        out[f"kl_pos{a}"] = masked_mean(diff_BT, in_tok_BT)
        out[f"tokens_pos{a}"] = jnp.sum(in_tok_BT.astype(f32))
        out[f"seq_kl_len{a}"] = masked_mean(seq_kl_B, in_seq_B)
        out[f"seqs_len{a}"] = jnp.sum(in_seq_B.astype(f32))
    return out


def _masked_max(x_BT, valid_BT):
    return jnp.where(jnp.any(valid_BT), jnp.max(jnp.where(valid_BT, x_BT, -jnp.inf)), 0.0)


def _masked_std(x_BT, valid_BT, ddof=0):
    """sqrt(Σ_valid (x − x̄)² / (N − ddof)) over the N valid entries; 0 when N <= ddof."""
    n = jnp.sum(valid_BT.astype(jnp.float32))
    sq_dev_BT = jnp.where(valid_BT, jnp.square(x_BT - masked_mean(x_BT, valid_BT)), 0.0)
    var = jnp.sum(sq_dev_BT) / jnp.maximum(n - ddof, 1.0)
    return jnp.where(n > ddof, jnp.sqrt(var), 0.0)


def _weight_stats(weights_BT, valid_BT, keep_BT):
    kept_BT = valid_BT & keep_BT.astype(bool)
    mean_w_kept = masked_mean(weights_BT, kept_BT)
    mean_w2_kept = masked_mean(jnp.square(weights_BT), kept_BT)
    return {
        "is_weight_mean": masked_mean(weights_BT, valid_BT),
        "is_weight_max": _masked_max(weights_BT, valid_BT),
        "is_weight_min": -_masked_max(-weights_BT, valid_BT),
        "is_weight_std": _masked_std(weights_BT, valid_BT),
        # (Σw)² / (N Σw²) = mean(w)² / mean(w²), in [1/N, 1]; 0 when nothing is kept.
        "ess": jnp.where(mean_w2_kept > 0, jnp.square(mean_w_kept) / mean_w2_kept, 0.0),
    }


def _prob_stats(p_old_BT, p_roll_BT, valid_BT):
    abs_diff_BT = jnp.abs(p_old_BT - p_roll_BT)
    x_BT = p_roll_BT - masked_mean(p_roll_BT, valid_BT)
    y_BT = p_old_BT - masked_mean(p_old_BT, valid_BT)
    cov = masked_mean(x_BT * y_BT, valid_BT)
    scale = jnp.sqrt(masked_mean(jnp.square(x_BT), valid_BT)) * jnp.sqrt(
        masked_mean(jnp.square(y_BT), valid_BT)
    )
    pearson = jnp.where(scale > 0, cov / jnp.where(scale > 0, scale, 1.0), 0.0)
    return {
        "probs_diff_mean": masked_mean(abs_diff_BT, valid_BT),
        "probs_diff_max": _masked_max(abs_diff_BT, valid_BT),
        "probs_diff_std": _masked_std(abs_diff_BT, valid_BT, ddof=1),  # torch.std (N − 1)
        "probs_pearson": jnp.clip(pearson, -1.0, 1.0),
    }
