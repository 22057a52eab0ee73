"""Rollout correction: TIS / MIS / RS / IcePop / batch-norm / bypass against hand-worked numbers."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.rl import LossConfig, RolloutCorrectionConfig, policy_loss, rollout_correction

# Two sequences of 3 tokens; the last token of sequence 1 is padding (its log-probs are garbage).
RHO = np.array([[0.4, 1.0, 3.0], [1.5, 0.25, 1.0]])
MASK = np.array([[1, 1, 1], [1, 1, 0]], dtype=bool)
LP_ROLL = np.array([[-1.0, -2.0, -0.5], [-0.3, -1.2, -np.inf]], np.float32)
LP_OLD = np.where(MASK, LP_ROLL + np.log(RHO), np.nan).astype(np.float32)
VALID_RHO = RHO[MASK]  # [0.4, 1, 3, 1.5, 0.25]
SEQ_RHO = np.array([0.4 * 1.0 * 3.0, 1.5 * 0.25])  # Π ρ_t = [1.2, 0.375]


def correct(**cfg):
    return rollout_correction(
        jnp.asarray(LP_OLD), jnp.asarray(LP_ROLL), jnp.asarray(MASK), RolloutCorrectionConfig(**cfg)
    )


# (config, expected weights, expected keep); worked out from RHO by hand.
CASES = {
    "no_is": (dict(is_level=None), [[1, 1, 1], [1, 1, 0]], MASK),
    "token_tis": (dict(), [[0.4, 1, 2], [1.5, 0.25, 0]], MASK),
    "seq_tis": (dict(is_level="sequence"), [[1.2] * 3, [0.375, 0.375, 0]], MASK),
    "seq_tis_capped": (
        dict(is_level="sequence", is_threshold=1.1),
        [[1.1] * 3, [0.375, 0.375, 0]],
        MASK,
    ),
    "token_rs": (dict(is_level=None, rs_level="token"), MASK, [[0, 1, 0], [1, 0, 0]]),
    "token_mis": (dict(rs_level="token"), [[0.4, 1, 2], [1.5, 0.25, 0]], [[0, 1, 0], [1, 0, 0]]),
    "token_rs_lower": (
        dict(is_level=None, rs_level="token", rs_upper=4.0, rs_lower=0.3),
        MASK,
        [[1, 1, 1], [1, 0, 0]],
    ),
    "seq_rs": (dict(is_level=None, rs_level="sequence"), MASK, [[1, 1, 1], [0, 0, 0]]),
    "seq_rs_tight": (
        dict(is_level=None, rs_level="sequence", rs_upper=1.1),
        MASK,
        np.zeros((2, 3)),
    ),
    # geometric means: 1.2^(1/3) = 1.0627, 0.375^(1/2) = 0.612
    "geo_rs": (dict(is_level=None, rs_level="geometric", rs_upper=1.1), MASK, [[1, 1, 1], [0] * 3]),
    "geo_rs_tight": (
        dict(is_level=None, rs_level="geometric", rs_upper=1.05),
        MASK,
        np.zeros((2, 3)),
    ),
    "veto": (dict(is_level=None, rs_veto_threshold=0.3), MASK, [[1, 1, 1], [0, 0, 0]]),
    "veto_loose": (dict(is_level=None, rs_veto_threshold=0.2), MASK, MASK),
    "icepop_default": (dict(icepop=True), [[0, 1, 3], [1.5, 0, 0]], MASK),
    "icepop_narrow": (
        dict(icepop=True, icepop_low=0.5, icepop_high=2.0),
        [[0, 1, 0], [1.5, 0, 0]],
        MASK,
    ),
    # mean over the 5 kept tokens = 5.15 / 5 = 1.03
    "token_tis_bn": (
        dict(batch_normalize=True),
        np.array([[0.4, 1, 2], [1.5, 0.25, 0]]) / 1.03,
        MASK,
    ),
    # kept tokens (0,1) and (1,0) have weights 1 and 1.5: mean 1.25
    "token_mis_bn": (
        dict(rs_level="token", batch_normalize=True),
        np.array([[0.4, 1, 2], [1.5, 0.25, 0]]) / 1.25,
        [[0, 1, 0], [1, 0, 0]],
    ),
    # sequence level normalizes over sequences: (1.2 + 0.375) / 2 = 0.7875
    "seq_tis_bn": (
        dict(is_level="sequence", batch_normalize=True),
        np.array([[1.2] * 3, [0.375, 0.375, 0]]) / 0.7875,
        MASK,
    ),
    "bypass": (dict(rs_level="token", rs_veto_threshold=0.3, bypass=True), MASK, MASK),
    "bypass_seq": (dict(is_level="sequence", rs_level="geometric", bypass=True), MASK, MASK),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_modes_by_hand(name):
    cfg, want_w, want_keep = CASES[name]
    w, keep, metrics = correct(**cfg)
    np.testing.assert_allclose(w, np.asarray(want_w, np.float32), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(keep, np.asarray(want_keep, bool))
    assert keep.dtype == jnp.bool_ and w.dtype == jnp.float32
    chex.assert_tree_all_finite(metrics)


def test_metrics_by_hand():
    w, _, m = correct(rs_level="token")  # token MIS: keeps (0,1) and (1,0)
    log_rho = np.log(VALID_RHO)
    per_seq_log_rho = [np.log(RHO[0]).mean(), np.log(RHO[1, :2]).mean()]
    want = {
        "kl": -np.log(0.45) / 5,  # mean(lp_roll - lp_old) = -log(Π ρ) / 5
        "k3_kl": np.mean(VALID_RHO - 1 - log_rho),
        "chi2_token": (0.16 + 1 + 9 + 2.25 + 0.0625) / 5 - 1,
        "chi2_seq": (1.2**2 + 0.375**2) / 2 - 1,
        "log_ppl_diff": -np.mean(per_seq_log_rho),
        "log_ppl_abs_diff": np.mean(np.abs(per_seq_log_rho)),
        "ppl_ratio": (1.2 ** (-1 / 3) + 0.375 ** (-1 / 2)) / 2,
        "training_ppl": np.mean([np.exp(-LP_OLD[0].mean()), np.exp(-LP_OLD[1, :2].mean())]),
        "rollout_ppl": np.mean([np.exp(-LP_ROLL[0].mean()), np.exp(-LP_ROLL[1, :2].mean())]),
        "is_ratio_fraction_high": 1 / 5,  # ρ = 3 > C
        "is_ratio_fraction_low": 2 / 5,  # ρ = 0.4, 0.25 < 1/C
        "masked_token_fraction": 3 / 5,
        "masked_seq_fraction": 1.0,
        "is_weight_mean": 5.15 / 5,
        "is_weight_max": 2.0,
        "is_weight_min": 0.25,
        "is_weight_std": np.std([0.4, 1, 2, 1.5, 0.25]),
        "ess": (1 + 1.5) ** 2 / (2 * (1 + 1.5**2)),  # over the kept tokens, weights 1 and 1.5
        "token_mult_prob_error": (2.5 + 1 + 3 + 1.5 + 4) / 5,
    }
    p_old, p_roll = np.exp(LP_OLD[MASK]), np.exp(LP_ROLL[MASK])
    want["probs_diff_mean"] = np.mean(np.abs(p_old - p_roll))
    want["probs_diff_max"] = np.max(np.abs(p_old - p_roll))
    want["probs_diff_std"] = np.std(np.abs(p_old - p_roll), ddof=1)  # torch.std: N - 1
    want["probs_pearson"] = np.corrcoef(p_roll, p_old)[0, 1]
    for key, value in want.items():
        np.testing.assert_allclose(m[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    for value in m.values():
        chex.assert_shape(value, ())


def test_ess_no_rejection():
    _, _, m = correct()
    w = np.array([0.4, 1, 2, 1.5, 0.25])
    np.testing.assert_allclose(m["ess"], w.sum() ** 2 / (5 * np.sum(w**2)), rtol=1e-5)


def test_bypass_metrics_still_compare_inputs():
    _, _, m = correct(bypass=True)
    np.testing.assert_allclose(m["kl"], -np.log(0.45) / 5, rtol=1e-5)
    assert float(m["masked_token_fraction"]) == 0.0


CONFIGS = [
    dict(),
    dict(is_level="sequence", rs_level="sequence", batch_normalize=True),
    dict(rs_level="token", rs_veto_threshold=1e-4, batch_normalize=True),
    dict(is_level=None, rs_level="geometric", rs_upper=1.001),
    dict(icepop=True, batch_normalize=True),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_identical_logprobs_give_unit_weights(cfg):
    lp_BT = -jnp.abs(jax.random.normal(jax.random.key(0), (4, 7))) * 3
    mask_BT = jnp.arange(7)[None, :] < jnp.array([[7], [3], [1], [5]])
    fn = jax.jit(functools.partial(rollout_correction, cfg=RolloutCorrectionConfig(**cfg)))
    w, keep, m = fn(lp_BT, lp_BT, mask_BT)
    np.testing.assert_array_equal(w, mask_BT.astype(np.float32))  # exactly 1 on valid tokens
    np.testing.assert_array_equal(keep, mask_BT)
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "probs_diff_max"):
        assert float(m[key]) == 0.0, key
    for key in ("masked_token_fraction", "masked_seq_fraction", "is_ratio_fraction_high"):
        assert float(m[key]) == 0.0, key
    for key in ("ess", "ppl_ratio", "token_mult_prob_error", "is_weight_mean", "is_weight_min"):
        assert float(m[key]) == 1.0, key
    np.testing.assert_allclose(m["probs_pearson"], 1.0, rtol=1e-5)


def test_probs_diff_std_divides_by_n_minus_one():
    # |p_old - p_roll| on the valid tokens = [0.1, 0.3, 0.2]: mean 0.2, Σ (d - 0.2)² = 0.02,
    # so the std is sqrt(0.02 / 2) = 0.1 (veRL's torch.std), not sqrt(0.02 / 3) = 0.0816 (N).
    # The padded token (diff 0.9) stays out.
    p_old = np.array([[0.5, 0.6, 0.95], [0.9, 0.5, 0.5]])
    p_roll = np.array([[0.4, 0.3, 0.05], [0.7, 0.5, 0.5]])
    mask = np.array([[1, 1, 0], [1, 0, 0]], dtype=bool)
    lp_old, lp_roll = (jnp.asarray(np.log(p), jnp.float32) for p in (p_old, p_roll))
    _, _, m = rollout_correction(lp_old, lp_roll, jnp.asarray(mask), RolloutCorrectionConfig())
    np.testing.assert_allclose(m["probs_diff_std"], 0.1, rtol=1e-5)
    np.testing.assert_allclose(m["probs_diff_mean"], 0.2, rtol=1e-5)
    # One valid token: N - 1 = 0, torch.std gives NaN; our metrics stay finite and give 0.
    one = np.array([[1, 0, 0], [0, 0, 0]], dtype=bool)
    _, _, m = rollout_correction(lp_old, lp_roll, jnp.asarray(one), RolloutCorrectionConfig())
    assert float(m["probs_diff_std"]) == 0.0
    np.testing.assert_allclose(m["probs_diff_max"], 0.1, rtol=1e-5)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("lengths", [(0, 0), (1, 0)])
def test_empty_and_single_token_batches_are_finite(cfg, lengths):
    mask_BT = jnp.arange(3)[None, :] < jnp.array(lengths)[:, None]
    lp_old = jnp.full((2, 3), -0.7)
    lp_roll = jnp.full((2, 3), -jnp.inf)  # padding garbage must not leak anywhere
    lp_roll = jnp.where(mask_BT, -0.9, lp_roll)
    w, keep, m = rollout_correction(lp_old, lp_roll, mask_BT, RolloutCorrectionConfig(**cfg))
    chex.assert_tree_all_finite((w, m))
    np.testing.assert_array_equal(w[~mask_BT], 0.0)
    assert not np.any(np.asarray(keep)[~np.asarray(mask_BT)])


@pytest.mark.parametrize(
    "cfg",
    [dict(), dict(is_level="sequence", batch_normalize=True), dict(icepop=True, rs_level="token")],
)
def test_no_gradient_through_is_weights(cfg):
    cfg = RolloutCorrectionConfig(**cfg)
    mask_BT = jnp.asarray(MASK)
    lp_roll = jnp.where(mask_BT, jnp.asarray(LP_ROLL), -1.0)
    lp_old = jnp.where(mask_BT, jnp.asarray(LP_OLD), -1.0)
    adv_BT = jnp.array([[1.0, -2.0, 0.5], [-1.0, 3.0, 0.0]])
    logp = lp_old + 0.1

    def loss_fn(lp_old_for_w, lp_roll_for_w):
        w, keep, _ = rollout_correction(lp_old_for_w, lp_roll_for_w, mask_BT, cfg)
        return policy_loss(logp, lp_old, adv_BT, mask_BT, w, keep, LossConfig())[0]

    assert float(loss_fn(lp_old, lp_roll)) != 0.0
    g_old, g_roll = jax.grad(loss_fn, argnums=(0, 1))(lp_old, lp_roll)
    np.testing.assert_array_equal(g_old, 0.0)
    np.testing.assert_array_equal(g_roll, 0.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(is_level="seq"), "is_level"),
        (dict(rs_level="tokens"), "rs_level"),
        (dict(is_threshold=0.5), "is_threshold"),
        (dict(rs_upper=0.9), "rs_upper"),
        (dict(rs_lower=1.5), "rs_lower"),
        (dict(rs_veto_threshold=0.0), "rs_veto_threshold"),
        (dict(icepop=True, is_level="sequence"), "icepop"),
        (dict(icepop_low=1.2), "icepop_low"),
        (dict(icepop_high=0.9), "icepop_high"),
    ],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"RolloutCorrectionConfig.{field} must be"):
        RolloutCorrectionConfig(**kwargs)


def test_rs_bounds_default_to_reciprocal():
    assert RolloutCorrectionConfig(rs_upper=4.0).rs_bounds == (0.25, 4.0)
    assert RolloutCorrectionConfig(rs_upper=1.001, rs_lower=0.999).rs_bounds == (0.999, 1.001)
    assert math.isclose(1.0 / RolloutCorrectionConfig().rs_bounds[0], 2.0)


def test_kl_by_length_by_hand():
    from fp8rl_jax.rl.correction import kl_by_length, length_edges

    assert length_edges(40) == (0, 32) and length_edges(32) == (0,)
    assert length_edges(200) == (0, 32, 64, 128)
    # Row 0: a prompt token, then 35 response tokens with d = 0.1 (positions 0..31) and d = 1.0
    # (positions 32..34), then padding. Row 1: 3 response tokens with d = -0.2. Row 2: none.
    T = 40
    valid = np.zeros((3, T), bool)
    valid[0, 1:36] = True
    valid[1, :3] = True
    diff = np.full((3, T), 7.0, np.float32)  # garbage outside the mask
    diff[0, 1:33], diff[0, 33:36], diff[1, :3] = 0.1, 1.0, -0.2
    m = jax.jit(kl_by_length)(jnp.asarray(np.where(valid, diff, 0.0)), jnp.asarray(valid))
    assert set(m) == {f"{k}{a}" for k in ("kl_pos", "tokens_pos", "seq_kl_len", "seqs_len")
                      for a in (0, 32)}  # fmt: skip
    np.testing.assert_allclose(m["tokens_pos0"], 35)  # 32 + 3 tokens at positions < 32
    np.testing.assert_allclose(m["kl_pos0"], (32 * 0.1 + 3 * -0.2) / 35, rtol=1e-6)
    np.testing.assert_allclose(m["tokens_pos32"], 3)
    np.testing.assert_allclose(m["kl_pos32"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(m["seqs_len0"], 1)  # row 1 (length 3); the empty row 2 is no row
    np.testing.assert_allclose(m["seq_kl_len0"], -0.6, rtol=1e-6)
    np.testing.assert_allclose(m["seqs_len32"], 1)  # row 0 (length 35)
    np.testing.assert_allclose(m["seq_kl_len32"], 32 * 0.1 + 3 * 1.0, rtol=1e-6)


def test_rollout_correction_reports_kl_by_length():
    _, _, m = correct()
    np.testing.assert_allclose(m["kl_pos0"], m["kl"], rtol=1e-6)  # T=3: one bucket
    np.testing.assert_allclose(m["seq_kl_len0"], -np.mean(np.log(SEQ_RHO)), rtol=1e-5)
    assert float(m["tokens_pos0"]) == 5 and float(m["seqs_len0"]) == 2
