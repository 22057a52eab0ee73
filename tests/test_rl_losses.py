"""PPO policy loss, aggregation, KL / entropy terms and value loss against hand-worked numbers."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.rl import (
    LossConfig,
    aggregate_loss,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)

ONE_1 = jnp.ones((1, 1))


def one_token(ratio, adv, cfg=None):
    """Loss, metrics and d loss / d logp for a single token with the given ratio and advantage."""
    cfg = LossConfig() if cfg is None else cfg
    lp_old = jnp.full((1, 1), -1.0)

    def fn(lp):
        return policy_loss(lp, lp_old, jnp.full((1, 1), adv), ONE_1, ONE_1, ONE_1, cfg)

    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(lp_old + math.log(ratio))
    return float(loss), metrics, float(grad[0, 0])


# ratio, advantage, loss, d loss / d logp (= -A r when the unclipped term is active), binding clip
CLIP_CASES = [
    (1.5, 1.0, -1.28, 0.0, "high"),  # A > 0, above 1 + ε_high = 1.28: clipped, no gradient
    (1.2, 1.0, -1.2, -1.2, None),  # inside the band
    (0.5, 1.0, -0.5, -0.5, None),  # A > 0 below the band: the min keeps the unclipped term
    (0.5, -1.0, 0.8, 0.0, "low"),  # A < 0 below 1 - ε_low = 0.8: clipped
    (0.9, -1.0, 0.9, 0.9, None),
    (1.5, -1.0, 1.5, 1.5, None),  # A < 0 above the band: unclipped, under the dual cap 3
    (4.0, -1.0, 3.0, 0.0, "dual"),  # dual-clip caps the loss at -A·c = 3
    (4.0, -2.0, 6.0, 0.0, "dual"),
    (1.27, 2.0, -2.54, -2.54, None),  # just inside clip-higher
]


@pytest.mark.parametrize("ratio, adv, want_loss, want_grad, binds", CLIP_CASES)
def test_clip_boundaries(ratio, adv, want_loss, want_grad, binds):
    loss, metrics, grad = one_token(ratio, adv)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    for kind in ("high", "low", "dual"):
        assert float(metrics[f"clipfrac_{kind}"]) == float(kind == binds), kind
    np.testing.assert_allclose(metrics["ratio_mean"], ratio, rtol=1e-5)
    np.testing.assert_allclose(metrics["approx_kl"], ratio - 1 - math.log(ratio), atol=1e-6)


def test_no_dual_clip():
    loss, metrics, grad = one_token(4.0, -1.0, LossConfig(dual_clip=None))
    np.testing.assert_allclose((loss, grad), (4.0, 4.0), rtol=1e-5)
    assert float(metrics["clipfrac_dual"]) == 0.0


def test_symmetric_clip():
    loss, _, _ = one_token(1.5, 1.0, LossConfig(clip_low=0.2, clip_high=0.2))
    np.testing.assert_allclose(loss, -1.2, rtol=1e-5)


# Per-token loss table; row 2 is fully masked and must leave every denominator.
LOSS_BT = jnp.array([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
MASK_BT = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=bool)
AGG_WANT = {
    "token-mean": (1 + 2 + 3 + 4) / 4,
    "seq-mean-token-sum": (6 + 4) / 2,
    "seq-mean-token-mean": (2 + 4) / 2,
}


@pytest.mark.parametrize("agg", sorted(AGG_WANT))
def test_aggregation_by_hand(agg):
    np.testing.assert_allclose(aggregate_loss(LOSS_BT, MASK_BT, agg), AGG_WANT[agg], rtol=1e-6)
    # The same numbers through policy_loss: ratio 1, weights 1, A = -ℓ gives per-token loss ℓ.
    lp = jnp.zeros_like(LOSS_BT)
    loss, _ = policy_loss(lp, lp, -LOSS_BT, MASK_BT, ONE_1, ONE_1, LossConfig(agg=agg))
    np.testing.assert_allclose(loss, AGG_WANT[agg], rtol=1e-6)


def test_keep_mask_leaves_denominator_and_weights_scale():
    lp = jnp.zeros_like(LOSS_BT)
    ones = jnp.ones_like(LOSS_BT)
    keep = ones.at[0, 2].set(0.0)  # rejected token: (1 + 2 + 4) / 3
    loss, _ = policy_loss(lp, lp, -LOSS_BT, MASK_BT, ones, keep, LossConfig())
    np.testing.assert_allclose(loss, 7 / 3, rtol=1e-6)
    w = ones.at[0, 0].set(2.0).at[1, 1].set(100.0)  # weight outside the mask has no effect
    loss, _ = policy_loss(lp, lp, -LOSS_BT, MASK_BT, w, ones, LossConfig())
    np.testing.assert_allclose(loss, (2 + 2 + 3 + 4) / 4, rtol=1e-6)


def test_masked_garbage_does_not_leak():
    lp = jnp.where(MASK_BT, -1.0, -jnp.inf)
    adv = jnp.where(MASK_BT, 1.0, jnp.nan)
    cfg = LossConfig()
    grad_fn = jax.grad(lambda x: policy_loss(x, lp, adv, MASK_BT, ONE_1, ONE_1, cfg)[0])
    chex.assert_tree_all_finite(grad_fn(jnp.where(MASK_BT, -1.0, 0.0)))


@pytest.mark.parametrize("agg", sorted(AGG_WANT))
def test_ratio_one_gives_plain_policy_gradient(agg):
    key_lp, key_adv = jax.random.split(jax.random.key(0))
    lp_BT = -jnp.abs(jax.random.normal(key_lp, (3, 5)))
    adv_BT = jax.random.normal(key_adv, (3, 5))
    mask_BT = jnp.arange(5)[None, :] < jnp.array([[5], [2], [4]])
    ones = jnp.ones_like(lp_BT)
    cfg = LossConfig(agg=agg)
    grad_ppo = jax.grad(lambda x: policy_loss(x, lp_BT, adv_BT, mask_BT, ones, ones, cfg)[0])(lp_BT)
    grad_pg = jax.grad(lambda x: aggregate_loss(-adv_BT * x, mask_BT, agg))(lp_BT)
    np.testing.assert_allclose(grad_ppo, grad_pg, rtol=1e-6, atol=1e-7)


def test_kl_penalty_by_hand():
    lp, ref = jnp.array([[-1.0, -0.5]]), jnp.array([[-2.0, -0.5]])  # δ = ref - lp = [-1, 0]
    np.testing.assert_allclose(kl_penalty(lp, ref, "k1"), [[1.0, 0.0]])
    np.testing.assert_allclose(kl_penalty(lp, ref, "k2"), [[0.5, 0.0]])
    np.testing.assert_allclose(kl_penalty(lp, ref, "k3"), [[math.exp(-1.0), 0.0]], rtol=1e-6)
    mask = jnp.array([[1, 0]])
    loss, metrics = kl_loss(lp, ref, mask, LossConfig(kl_kind="k2"))
    np.testing.assert_allclose((loss, metrics["kl_ref"]), (0.5, 0.5))


def test_entropy_by_hand():
    logits_BTV = jnp.log(jnp.array([[[0.25, 0.25, 0.25, 0.25], [0.25, 0.75, 1e-30, 1e-30]]]))
    want = [math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    np.testing.assert_allclose(entropy_from_logits(logits_BTV), [want], rtol=1e-5)
    loss, metrics = entropy_bonus(
        entropy_from_logits(logits_BTV), jnp.array([[1, 1]]), LossConfig()
    )
    np.testing.assert_allclose(
        (loss, metrics["entropy"]), (-np.mean(want), np.mean(want)), rtol=1e-5
    )


def test_value_loss_clipping():
    v_old, returns = jnp.zeros((1, 3)), jnp.ones((1, 3))
    values = jnp.array([[2.0, -1.0, 0.8]])
    # unclipped errors [1, 4, 0.04]; V_clip = [0.5, -0.5, 0.5] gives [0.25, 2.25, 0.25]
    loss, metrics = value_loss(values, v_old, returns, jnp.ones((1, 3)), clip=0.5)
    np.testing.assert_allclose(loss, 0.5 * (1 + 4 + 0.25) / 3, rtol=1e-6)
    np.testing.assert_allclose(metrics["vf_clipfrac"], 1 / 3, rtol=1e-6)
    loss, _ = value_loss(values, v_old, returns, jnp.ones((1, 3)), clip=None)
    np.testing.assert_allclose(loss, 0.5 * (1 + 4 + 0.04) / 3, rtol=1e-6)
    # The clipped branch has no gradient wrt V: only tokens 0 and 1 pull on the values.
    grad = jax.grad(lambda v: value_loss(v, v_old, returns, jnp.ones((1, 3)), clip=0.5)[0])(values)
    np.testing.assert_allclose(grad, [[1 / 3, -2 / 3, 0.0]], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(clip_low=1.0), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(agg="mean"), "agg"),
        (dict(kl_kind="k4"), "kl_kind"),
        (dict(entropy_coef=-1.0), "entropy_coef"),
        (dict(vf_clip=0.0), "vf_clip"),
    ],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"LossConfig.{field} must be"):
        LossConfig(**kwargs)
