"""GRPO / Dr.GRPO / RLOO group advantages and GAE against hand-worked numbers."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fp8rl_jax.rl import gae, grpo_advantages, masked_whiten, rloo_advantages

# Two groups of G = 4: a mixed group and a constant-reward group.
REWARDS_B = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
MASK_BT = jnp.arange(3)[None, :] < jnp.array([3, 2, 1, 3, 3, 3, 0, 1])[:, None]


def per_seq(adv_BT):
    """The advantage of each response, read off its first token."""
    return np.asarray(adv_BT)[:, 0]


def test_grpo_by_hand():
    adv_BT = grpo_advantages(REWARDS_B[:4], MASK_BT[:4], group_size=4)
    std = math.sqrt(4 * 0.25 / 3)  # Bessel-corrected std of [1, 0, 0, 1]
    want = np.array([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6)
    np.testing.assert_allclose(per_seq(adv_BT), want, rtol=1e-6)
    np.testing.assert_allclose(adv_BT, want[:, None] * np.asarray(MASK_BT[:4]), rtol=1e-6)


def test_dr_grpo_skips_std():
    adv_BT = grpo_advantages(REWARDS_B, MASK_BT, group_size=4, scale_by_std=False)
    np.testing.assert_allclose(per_seq(adv_BT)[:4], [0.5, -0.5, -0.5, 0.5])


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_constant_group_has_zero_advantage(scale_by_std):
    adv_BT = grpo_advantages(REWARDS_B, MASK_BT, group_size=4, scale_by_std=scale_by_std)
    np.testing.assert_array_equal(adv_BT[4:], 0.0)
    np.testing.assert_array_equal(rloo_advantages(REWARDS_B, MASK_BT, group_size=4)[4:], 0.0)


def test_rloo_by_hand():
    rewards_B = jnp.array([1.0, 0.0, 0.0, 2.0])
    mask_BT = jnp.ones((4, 2), dtype=bool)
    # A_i = r_i - mean of the other three
    want = [1 - 2 / 3, 0 - 3 / 3, 0 - 3 / 3, 2 - 1 / 3]
    np.testing.assert_allclose(per_seq(rloo_advantages(rewards_B, mask_BT, 4)), want, rtol=1e-6)


def test_bad_group_size():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(REWARDS_B, MASK_BT, group_size=3)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(REWARDS_B, MASK_BT, group_size=1)


@settings(max_examples=25, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5, width=32), min_size=12, max_size=12),
    group_size=st.sampled_from([2, 3, 4, 6]),
)
@example(rewards=[0.0] * 9 + [3.03125, 3.03125, 3.0234375], group_size=3)  # std 0.0045
def test_group_advantages_are_zero_mean(rewards, group_size):
    rewards_B = jnp.array(rewards)
    mask_BT = jnp.ones((12, 1))
    for adv_BT in (
        grpo_advantages(rewards_B, mask_BT, group_size),
        grpo_advantages(rewards_B, mask_BT, group_size, scale_by_std=False),
        rloo_advantages(rewards_B, mask_BT, group_size),
    ):
        group_sums = np.asarray(adv_BT).reshape(-1, group_size).sum(axis=-1)
        np.testing.assert_array_less(np.abs(group_sums), _f32_group_sum_bound(rewards, group_size))


def _f32_group_sum_bound(rewards, group_size):
    """How far from 0 a group's f32 advantages may sum: the f32 mean is off by up to ~G ulps of
    max|r|, which every one of the G centred values carries, and the std scaling divides by the
    group's std (a group of nearly equal rewards, e.g. 3.03125, 3.03125, 3.0234375: std 0.0045,
    sums ~1e-4); 4x that, plus 1e-5 for the final sum. A missing centring breaks it by orders."""
    r_QG = np.asarray(rewards, np.float64).reshape(-1, group_size)
    u = np.finfo(np.float32).eps / 2
    err_QG = group_size**2 * u * np.abs(r_QG).max(axis=-1)
    scale_QG = np.maximum(1.0, 1.0 / (r_QG.std(axis=-1, ddof=1) + 1e-6))
    return 4 * err_QG * scale_QG + 1e-5


def test_gae_by_hand():
    # gamma = 0.9, lam = 0.8 (gamma·lam = 0.72), three tokens.
    rewards_BT = jnp.array([[0.0, 0.0, 1.0], [0.0, 5.0, 1.0], [0.0, 1.0, 9.0]])
    values_BT = jnp.array([[0.5, 0.6, 0.7], [0.5, 99.0, 0.7], [0.5, 0.6, 9.0]])
    mask_BT = jnp.array([[1, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=bool)
    # row 0: δ = [0.9·0.6 - 0.5, 0.9·0.7 - 0.6, 1 - 0.7] = [0.04, 0.03, 0.3]
    #        Â2 = 0.3, Â1 = 0.03 + 0.72·0.3 = 0.246, Â0 = 0.04 + 0.72·0.246 = 0.21712
    # row 1: token 1 is masked (an observation), so token 0 bootstraps from token 2:
    #        Â2 = 0.3, Â0 = (0.9·0.7 - 0.5) + 0.72·0.3 = 0.346
    # row 2: token 2 is padding: Â1 = 1 - 0.6 = 0.4, Â0 = 0.04 + 0.72·0.4 = 0.328
    want_adv = [[0.21712, 0.246, 0.3], [0.346, 0.0, 0.3], [0.328, 0.4, 0.0]]
    want_ret = [[0.71712, 0.846, 1.0], [0.846, 0.0, 1.0], [0.828, 1.0, 0.0]]
    adv_BT, ret_BT = gae(rewards_BT, values_BT, mask_BT, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv_BT, want_adv, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ret_BT, want_ret, rtol=1e-5, atol=1e-7)


def test_gae_lambda_one_is_discounted_return_minus_value():
    rewards_BT = jnp.array([[1.0, 2.0, 3.0]])
    values_BT = jnp.array([[0.1, 0.2, 0.3]])
    adv_BT, ret_BT = gae(rewards_BT, values_BT, jnp.ones((1, 3)), gamma=0.5, lam=1.0)
    want_ret = [1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3.0]
    np.testing.assert_allclose(ret_BT[0], want_ret, rtol=1e-6)
    np.testing.assert_allclose(adv_BT[0], np.array(want_ret) - [0.1, 0.2, 0.3], rtol=1e-6)


def test_masked_whiten():
    x_BT = jnp.array([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask_BT = jnp.array([[1, 1, 1], [1, 0, 0]])
    white = np.asarray(masked_whiten(x_BT, mask_BT))
    valid = np.asarray(mask_BT, bool)
    np.testing.assert_allclose(white[valid].mean(), 0.0, atol=1e-6)
    np.testing.assert_allclose(white[valid].std(), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(white[~valid], 0.0)
