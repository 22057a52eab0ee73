"""Optional PPO terms of the RL step (issue 5): entropy bonus, KL to a reference, GAE value head.

Tiny Qwen3-style model (D=32, 2 layers, vocab 64), 2 prompts x G=4 responses of up to 4 tokens,
an FP32 rollout without quantization so that equalities hold to FP32 rounding. The worked
numbers (terminal rewards, KL-in-reward, value alignment) need no model at all.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from fp8rl_jax.generation import RolloutConfig, SamplingConfig
from fp8rl_jax.rl import (
    LossConfig,
    RLConfig,
    RolloutBatch,
    compute_targets,
    entropy_from_logits,
    init_train_state,
    jit_steps,
    kl_reward_penalty,
    policy_entropy,
    terminal_rewards,
    token_values,
)
from fp8rl_jax.train import sharding as sh
from tests.testing import (
    TINY_MODEL,
    VOCAB,
    assert_finite,
    copy_tree,
    tiny_params,
    tiny_prompts,
)

G = 4
MODEL = TINY_MODEL
ROLLOUT = RolloutConfig(
    max_new_tokens=4, quant=None, kv_cache_dtype="float32", compute_dtype="float32"
)
OPTIMIZER = optax.adam(1e-2)
RL = RLConfig(group_size=G)
RL_ENTROPY = dataclasses.replace(RL, loss=LossConfig(entropy_coef=0.1))
RL_KL = dataclasses.replace(RL, loss=LossConfig(kl_coef=0.1, kl_kind="k3"))
RL_GAE = RLConfig(
    group_size=G, advantage="gae", lam=0.95, kl_in_reward=0.05, loss=LossConfig(kl_kind="k1")
)


def _prompts():
    return tiny_prompts((5, 3), G)


def _rewards():
    return jnp.asarray(np.random.default_rng(1).normal(size=2 * G), jnp.float32)


def _max_delta(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


# Worked numbers, no model.


def test_terminal_rewards_sit_on_the_last_response_token():
    mask = jnp.asarray([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]], jnp.float32)
    r = terminal_rewards(jnp.asarray([2.0, -1.0, 5.0]), mask)
    np.testing.assert_array_equal(r, [[0, 0, 2, 0], [0, 0, 0, -1], [0, 0, 0, 0]])


def test_token_values_read_the_previous_hidden_state():
    h = jnp.arange(6, dtype=jnp.float32).reshape(1, 3, 2)  # h_0 = [0, 1], h_1 = [2, 3]
    vh = {"w": jnp.asarray([[1.0], [10.0]]), "b": jnp.asarray([0.5])}
    np.testing.assert_allclose(token_values(vh, h), [[0.0, 10.5, 32.5]])


def test_policy_entropy_is_temperature_scaled_and_shifted():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 5))
    h = policy_entropy(logits, SamplingConfig(temperature=2.0))
    np.testing.assert_allclose(h[:, 1:], entropy_from_logits(logits[:, :-1] / 2.0), rtol=1e-6)
    np.testing.assert_array_equal(h[:, 0], 0.0)


def _hand_batch(logp_old, logp_ref, mask):
    z = jnp.zeros_like(mask)
    return RolloutBatch(z, z, z, mask, logp_old, logp_old, mask, mask, {}, {}, logp_ref_BT=logp_ref)


def test_kl_in_reward_shifts_sequence_rewards_by_the_summed_penalty():
    """β = 0.5, k1 = lp_old − lp_ref: row 0 has k1 = (0.5, −1) -> penalty −β·(−0.5) = +0.25."""
    mask = jnp.asarray([[0, 1, 1], [0, 1, 0]], jnp.float32)
    lp_old = jnp.asarray([[0.0, -1.0, -2.0], [0.0, -0.5, -9.0]])
    lp_ref = jnp.asarray([[0.0, -1.5, -1.0], [0.0, -0.5, -1.0]])  # row 1, t=2 is masked
    np.testing.assert_allclose(
        kl_reward_penalty(lp_old, lp_ref, mask, 0.5, "k1"), [[0, -0.25, 0.5], [0, 0, 0]]
    )
    # k2 = ½ δ², δ = lp_ref − lp_old = (−0.5, 1): penalty −0.5·(0.125, 0.5)
    np.testing.assert_allclose(
        kl_reward_penalty(lp_old, lp_ref, mask, 0.5, "k2"), [[0, -0.0625, -0.25], [0, 0, 0]]
    )
    rl = RLConfig(group_size=2, advantage="drgrpo", kl_in_reward=0.5, loss=LossConfig(kl_kind="k1"))
    t = compute_targets(_hand_batch(lp_old, lp_ref, mask), jnp.asarray([1.0, 0.0]), rl)
    np.testing.assert_allclose(t.rewards_B, [1.25, 0.0])
    np.testing.assert_allclose(t.advantages_BT, [[0, 0.625, 0.625], [0, -0.625, 0]])
    assert t.returns_BT is None


def test_gae_targets_with_zero_values_are_whitened_returns():
    """V = 0, γ = λ = 1, no KL: every response token's return is its sequence reward."""
    mask = jnp.asarray([[0, 1, 1], [0, 1, 0]], jnp.float32)
    batch = dataclasses.replace(
        _hand_batch(jnp.zeros((2, 3)), None, mask), values_BT=jnp.zeros((2, 3))
    )
    rl = RLConfig(advantage="gae", whiten_advantages=False)
    t = compute_targets(batch, jnp.asarray([3.0, -1.0]), rl)
    np.testing.assert_allclose(t.returns_BT, [[0, 3, 3], [0, -1, 0]])
    np.testing.assert_allclose(t.advantages_BT, [[0, 3, 3], [0, -1, 0]])
    white = compute_targets(batch, jnp.asarray([3.0, -1.0]), RLConfig(advantage="gae"))
    m = np.asarray(mask) > 0
    np.testing.assert_allclose(np.asarray(white.advantages_BT)[m].mean(), 0.0, atol=1e-6)


def test_missing_state_parts_raise():
    state = init_train_state(tiny_params(), OPTIMIZER, jax.random.key(1))
    with pytest.raises(ValueError, match="ref_params"):
        jit_steps(MODEL, ROLLOUT, RL_KL, OPTIMIZER).rollout(state, _prompts())
    with pytest.raises(ValueError, match="value_head"):
        rl = dataclasses.replace(RL_GAE, kl_in_reward=0.0)
        jit_steps(MODEL, ROLLOUT, rl, OPTIMIZER).rollout(state, _prompts())


def test_value_head_and_ref_stay_out_of_the_param_shardings():
    state = jax.eval_shape(
        lambda: init_train_state(tiny_params(), OPTIMIZER, jax.random.key(1), rl_cfg=RL_GAE)
    )
    assert state.ref_params is not None and state.value_head["w"].shape == (32, 1)
    mesh = sh.abstract_mesh(sh.MeshConfig(fsdp=2, tensor=2), 4)
    st = sh.train_state_shardings(state, MODEL, mesh)
    adam = st.opt_state[0]
    assert adam.mu.policy == st.params and adam.mu.value_head["w"].spec == P()
    assert st.value_head["w"].spec == P()
    assert st.ref_params == st.params  # the frozen reference is sharded like the policy


# The jitted programs.


@pytest.fixture(scope="module")
def plain_batch():
    state = init_train_state(tiny_params(), OPTIMIZER, jax.random.key(1))
    return state, jit_steps(MODEL, ROLLOUT, RL, OPTIMIZER).rollout(state, _prompts())


def test_entropy_bonus_adds_exactly_coef_times_minus_entropy(plain_batch):
    state, batch = plain_batch
    s_plain, m_plain = jit_steps(MODEL, ROLLOUT, RL, OPTIMIZER).train(
        copy_tree(state), batch, _rewards()
    )
    train_ent = jit_steps(MODEL, ROLLOUT, RL_ENTROPY, OPTIMIZER).train
    s_ent, m_ent = train_ent(copy_tree(state), batch, _rewards())
    h = float(m_plain["entropy"])
    assert 0.0 < h < np.log(VOCAB)
    np.testing.assert_allclose(float(m_ent["entropy"]), h, rtol=1e-6)
    np.testing.assert_allclose(
        float(m_ent["loss"]) - float(m_plain["loss"]), 0.1 * -h, rtol=1e-4, atol=1e-6
    )
    assert float(m_ent["grad_norm"]) != float(m_plain["grad_norm"])
    assert _max_delta(s_ent.params, s_plain.params) > 0


def test_kl_loss_is_zero_at_the_reference_and_grows_after_an_update():
    state = init_train_state(tiny_params(), OPTIMIZER, jax.random.key(1), rl_cfg=RL_KL)
    ref0 = copy_tree(state.ref_params)
    batch = jit_steps(MODEL, ROLLOUT, RL_KL, OPTIMIZER).rollout(state, _prompts())
    m = np.asarray(batch.response_mask_BT) > 0
    np.testing.assert_allclose(
        np.asarray(batch.logp_ref_BT)[m], np.asarray(batch.logp_old_BT)[m], atol=1e-6
    )
    train = jit_steps(MODEL, ROLLOUT, RL_KL, OPTIMIZER).train
    state, m1 = train(state, batch, _rewards())
    assert abs(float(m1["kl_ref"])) < 1e-6
    state, m2 = train(state, batch, _rewards())
    assert float(m2["kl_ref"]) > 1e-6
    assert_finite(m2)
    assert _max_delta(state.ref_params, ref0) == 0.0  # the reference stays frozen
    assert train._cache_size() == 1


def test_gae_two_steps_train_value_head_and_policy_without_recompiling():
    state = init_train_state(tiny_params(), OPTIMIZER, jax.random.key(1), rl_cfg=RL_GAE)
    rollout, train = jit_steps(MODEL, ROLLOUT, RL_GAE, OPTIMIZER)
    host0 = copy_tree(state)
    batch1 = rollout(state, _prompts())
    np.testing.assert_array_equal(batch1.values_BT, 0.0)  # zero-initialized head
    state, m1 = train(state, batch1, _rewards())
    host1 = copy_tree(state)
    batch2 = rollout(state, _prompts())
    state, m2 = train(state, batch2, _rewards())
    for m in (m1, m2):
        assert_finite(m)
        assert {"vf_loss", "vf_clipfrac", "return_mean", "entropy"} <= set(m)
        assert int(m["nonfinite_skips"]) == 0
    assert _max_delta(host1.value_head, host0.value_head) > 0
    assert _max_delta(host1.params, host0.params) > 0
    mask = np.asarray(batch2.response_mask_BT)
    values = np.asarray(batch2.values_BT)
    assert np.abs(values[mask > 0]).max() > 0 and np.all(values[mask == 0] == 0)
    # KL in reward (k1, β = 0.05): rewards shift by −β Σ_t (lp_old − lp_ref) over the response.
    k1 = (np.asarray(batch2.logp_old_BT) - np.asarray(batch2.logp_ref_BT)) * mask
    expected = float(np.mean(_rewards())) - 0.05 * float(np.mean(k1.sum(axis=1)))
    np.testing.assert_allclose(float(m2["reward_with_kl_mean"]), expected, rtol=1e-5, atol=1e-6)
    assert rollout._cache_size() == 1 and train._cache_size() == 1
