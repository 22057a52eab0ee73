"""DAPO pieces (rl/dapo.py): eq. 13 overlong penalty, truncation, filtering, row selection."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.models import QKVAmax
from fp8rl_jax.rl import RolloutBatch
from fp8rl_jax.rl.dapo import (
    DAPOConfig,
    informative_groups,
    overlong_penalty,
    select_rows,
    shape_rewards,
    truncated_rows,
)

A = 16  # response budget L_max of these tests
STOP = 2


def test_overlong_penalty_hand_worked():
    # L_max = 16, L_cache = 4: free up to 12 tokens, then -1/4 per token, -1 at the budget.
    lens = jnp.array([0, 5, 12, 13, 14, 15, 16])
    want = np.array([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0])
    np.testing.assert_allclose(overlong_penalty(lens, A, 4), want, atol=0)
    np.testing.assert_allclose(overlong_penalty(lens, A, 4, factor=0.5), 0.5 * want, atol=0)
    # beyond L_max (not reachable by a rollout, but eq. 13 says -1)
    assert float(overlong_penalty(jnp.array([20]), A, 4)[0]) == -1.0
    np.testing.assert_array_equal(overlong_penalty(lens, A, 0), np.zeros(7))  # off
    with pytest.raises(ValueError, match="exceeds max_len"):
        overlong_penalty(lens, A, 17)


def _rows(lens, last_tokens, P=3):
    """tokens [B, P + A] with responses of ``lens`` tokens; the last column set as given."""
    B = len(lens)
    tokens = np.full((B, P + A), 7, np.int32)
    mask = np.zeros((B, P + A), np.float32)
    for b, n in enumerate(lens):
        mask[b, P : P + n] = 1.0
        tokens[b, P + n :] = 0
        if n == A:
            tokens[b, -1] = last_tokens[b]
    return jnp.asarray(tokens), jnp.asarray(mask)


def test_truncated_rows():
    # full budget without a stop token: truncated; full budget ending on a stop token: not
    tokens, mask = _rows([A, A, 5, 15], [9, STOP, 0, 0])
    got = truncated_rows(tokens, mask, A, (STOP,))
    np.testing.assert_array_equal(got, [True, False, False, False])
    # no stop tokens configured: every full-budget response counts as truncated
    np.testing.assert_array_equal(truncated_rows(tokens, mask, A, ()), [True, True, False, False])


def _amax(q):
    q = jnp.array([q])  # [L=1, K=2]
    return QKVAmax(q_LK=q, k_LK=q, v_LK=q)


def _batch(lens, last_tokens):
    tokens, mask = _rows(lens, last_tokens)
    z = jnp.zeros_like(mask)
    return RolloutBatch(
        tokens_BT=tokens, segment_ids_BT=jnp.ones_like(tokens), positions_BT=jnp.zeros_like(tokens),
        response_mask_BT=mask, logp_rollout_BT=z, logp_old_BT=z, is_weights_BT=jnp.ones_like(mask),
        keep_BT=jnp.ones_like(mask), qkv_amax=_amax([1.0, 4.0]), metrics={"kl": 0.0},
    )  # fmt: skip


def test_shape_rewards_penalty_and_overlong_filtering():
    batch = _batch([A, A, 14, 5], [9, STOP, 0, 0])
    rewards = jnp.array([1.0, 1.0, 1.0, 0.0])
    cfg = DAPOConfig(overlong_buffer=4, mask_truncated=True)
    shaped, keep, m = shape_rewards(batch, rewards, cfg, A, (STOP,))
    # penalties: -1, -1, -0.5, 0 (the stopped full-length row is penalized too, as in eq. 13)
    np.testing.assert_allclose(shaped, [0.0, 0.0, 0.5, 0.0])
    np.testing.assert_array_equal(np.asarray(keep).max(axis=1), [0.0, 1.0, 1.0, 1.0])
    assert float(m["truncated_frac"]) == 0.25
    assert float(m["overlong_penalty_mean"]) == pytest.approx(-2.5 / 4)
    # defaults: nothing changes
    shaped, keep, m = shape_rewards(batch, rewards, DAPOConfig(), A, (STOP,))
    np.testing.assert_array_equal(shaped, rewards)
    np.testing.assert_array_equal(keep, batch.keep_BT)
    assert float(m["overlong_penalty_mean"]) == 0.0


def test_informative_groups():
    rewards = np.array([1, 1, 0, 0, 0, 0, 1, 1, -1, 1, 1, 1], np.float32)  # G = 3
    np.testing.assert_array_equal(informative_groups(rewards, 3), [True, False, True, False])


def test_select_rows_gathers_rows_and_masks_unfilled_slots():
    buf = _batch([1, 2, 3, 4], [0, 0, 0, 0])
    new = _batch([5, 6, 7, 8], [0, 0, 0, 0])
    new = dataclasses.replace(new, qkv_amax=_amax([3.0, 2.0]), metrics={"kl": 1.0})
    take = jnp.array([-1, 3, 0, -1], jnp.int32)  # slot 1 <- new row 3, slot 2 <- new row 0
    valid = jnp.array([1.0, 1.0, 1.0, 0.0])
    out = jax.jit(select_rows)(buf, new, take, valid)
    np.testing.assert_array_equal(np.asarray(out.response_mask_BT).sum(1), [1, 8, 5, 4])
    np.testing.assert_array_equal(out.tokens_BT[1], new.tokens_BT[3])
    np.testing.assert_array_equal(np.asarray(out.keep_BT).max(1), [1, 1, 1, 0])
    np.testing.assert_array_equal(out.qkv_amax.q_LK[0], [3.0, 4.0])  # elementwise max
    assert float(out.metrics["kl"]) == 0.0  # the buffer's
    # no buffer: every slot from ``new``, which may have more rows than the output
    big = _batch([5, 6, 7, 8, 9, 10], [0] * 6)
    out = jax.jit(select_rows)(None, big, jnp.array([5, 0, 2, 1], jnp.int32), valid)
    np.testing.assert_array_equal(np.asarray(out.response_mask_BT).sum(1), [10, 5, 7, 6])
    np.testing.assert_array_equal(np.asarray(out.keep_BT).max(1), [1, 1, 1, 0])
    np.testing.assert_array_equal(out.qkv_amax.q_LK[0], [1.0, 4.0])


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_gen_batches"):
        DAPOConfig(max_num_gen_batches=0)
    with pytest.raises(ValueError, match="overlong_buffer"):
        DAPOConfig(overlong_buffer=-1)


def test_experiment_rejects_a_penalty_window_beyond_the_budget():
    from fp8rl_jax.generation import RolloutConfig
    from fp8rl_jax.rl import RLConfig
    from fp8rl_jax.train.experiment import Experiment

    with pytest.raises(ValueError, match=r"overlong_buffer \(8\) must not exceed"):
        Experiment(
            rollout=RolloutConfig(max_new_tokens=6), rl=RLConfig(dapo=DAPOConfig(overlong_buffer=8))
        )
