"""The jitted RL step programs (issue 5): rollout + update on a tiny model, compiled once.

One tiny Qwen3-style model (D=32, 2 layers, vocab 64), 4 prompts x G=4 responses of up to 6
tokens. Each config below compiles its programs once per module (fixtures), so the file stays
around a minute on 2 CPU cores.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8rl_jax.fields import is_batched
from fp8rl_jax.generation import (
    RolloutConfig,
    SamplingConfig,
    calibrate_kv_scales,
)
from fp8rl_jax.rl import (
    RLConfig,
    RolloutCorrectionConfig,
    calibrate_program,
    init_train_state,
    jit_steps,
    make_fused_step,
)
from tests.testing import TINY_MODEL, assert_finite, copy_tree, tiny_params, tiny_prompts

MODEL = TINY_MODEL
G = 4  # responses per prompt
FP8_ROLLOUT = RolloutConfig(max_new_tokens=6, kv_cache_dtype="float8_e4m3fn")  # W8A8 + FP8 KV
RL = RLConfig(group_size=G, num_minibatches=2)
OPTIMIZER = optax.adam(1e-2)


def _prompts():
    return tiny_prompts((5, 7, 3, 8), G)


def _state(rollout_cfg=FP8_ROLLOUT):
    params = tiny_params()
    kv = calibrate_program(MODEL, rollout_cfg)(params, _prompts())
    return init_train_state(params, OPTIMIZER, jax.random.key(1), kv)


def _rewards():
    return jnp.asarray(np.random.default_rng(1).normal(size=4 * G), jnp.float32)


def even_token_reward(tokens_BT, response_mask_BT, parity_B):
    """Toy JAX reward: fraction of response tokens whose id has the row's parity."""
    hit_BT = (tokens_BT % 2 == parity_B[:, None]).astype(jnp.float32) * response_mask_BT
    return jnp.sum(hit_BT, axis=1) / jnp.maximum(jnp.sum(response_mask_BT, axis=1), 1.0)


@pytest.fixture(scope="module")
def fp8_steps():
    return jit_steps(MODEL, FP8_ROLLOUT, RL, OPTIMIZER)


@pytest.fixture(scope="module")
def two_steps(fp8_steps):
    """Two full FP8 steps (W8A8 + static FP8 KV cache) with random rewards, and what they saw."""
    rollout_step, train_step = fp8_steps
    state0 = _state()
    host0 = copy_tree(state0)
    batch1 = rollout_step(state0, _prompts())
    state1, metrics1 = train_step(state0, batch1, _rewards())
    host1 = copy_tree(state1)
    batch2 = rollout_step(state1, _prompts())
    state2, metrics2 = train_step(state1, batch2, _rewards())
    return dict(
        host0=host0,
        host1=host1,
        batch1=batch1,
        metrics1=metrics1,
        batch2=batch2,
        state2=state2,
        m2=metrics2,
    )


def test_full_step_updates_params_with_finite_metrics(two_steps):
    host0, host1 = two_steps["host0"], two_steps["host1"]
    assert int(host1.step) == 1 and int(two_steps["state2"].step) == 2
    deltas = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), host0.params, host1.params)
    unchanged = [k for k, d in jax.tree_util.tree_leaves_with_path(deltas) if d == 0.0]
    assert not unchanged, f"parameters not updated: {unchanged}"
    assert_finite(two_steps["batch1"].metrics)
    assert_finite(two_steps["metrics1"])
    assert_finite(two_steps["m2"])
    assert int(two_steps["metrics1"]["nonfinite_skips"]) == 0
    assert float(two_steps["metrics1"]["grad_norm"]) > 0
    # The FP8 rollout differs from the BF16 scoring pass, so the mismatch metrics are not trivial.
    assert float(two_steps["batch1"].metrics["token_mult_prob_error"]) > 1.0


def test_every_row_array_of_the_rollout_batch_is_declared_batched(two_steps):
    """A mesh splits exactly the declared fields; an undeclared [B, ...] field would replicate."""
    batch = two_steps["batch1"]
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if value is None:  # an optional field this config does not fill (logp_ref, values)
            continue
        rows = isinstance(value, jax.Array) and value.ndim >= 1 and value.shape[0] == 4 * G
        assert rows == is_batched(batch, f.name), f.name


def test_second_step_compiles_nothing_new(fp8_steps, two_steps):
    rollout_step, train_step = fp8_steps
    # Two calls each; one executable each (a recompile would also show for a changed state
    # structure, dtype, weak type or sharding between step 1 and step 2).
    assert rollout_step._cache_size() == 1
    assert train_step._cache_size() == 1


def test_static_fp8_kv_scales_are_recalibrated(two_steps):
    """Step t's train program returns the KV scales of rollout t+1 from step t's scoring pass.

    That pass ran at the params which generated step t (DESIGN.md §2 step 3, no extra forward),
    so the scales of rollout 2 are the first to see updated params: they must differ from the
    step-0 (prompt) calibration and from the scales of rollout 1.
    """
    kv0 = two_steps["host0"].kv_scales
    kv1 = two_steps["host1"].kv_scales
    kv2 = two_steps["state2"].kv_scales
    for t, (kv, batch) in enumerate(((kv1, two_steps["batch1"]), (kv2, two_steps["batch2"])), 1):
        expected = calibrate_kv_scales(
            batch.qkv_amax, FP8_ROLLOUT.kv_calib_percentile, FP8_ROLLOUT.kv_calib_margin
        )
        for name in ("k", "v", "q"):
            s = np.asarray(getattr(kv, name))
            assert np.isfinite(s).all() and (s > 0).all(), (t, name)
            np.testing.assert_allclose(s, getattr(expected, name), rtol=1e-6)
        assert int(kv.num_invalid) == 0
    for name in ("k", "v", "q"):
        s2 = np.asarray(getattr(kv2, name))
        assert not np.array_equal(s2, getattr(kv0, name)), f"{name}: same as step-0 calibration"
        assert not np.array_equal(s2, getattr(kv1, name)), f"{name}: not recalibrated"


def test_nonfinite_reward_skips_the_update(two_steps, fp8_steps):
    rollout_step, train_step = fp8_steps
    state = _state()
    before = copy_tree(state)
    batch = rollout_step(state, _prompts())
    rewards = _rewards().at[::G].set(jnp.nan)  # one NaN per group: every row's advantage is NaN
    state, metrics = train_step(state, batch, rewards)
    after = copy_tree(state)
    assert int(metrics["nonfinite_skips"]) == RL.num_minibatches  # both updates skipped
    assert int(after.nonfinite_skips) == RL.num_minibatches
    assert int(after.step) == 1  # the step still counts; the data position moves on
    jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
    jax.tree.map(np.testing.assert_array_equal, after.opt_state, before.opt_state)
    assert train_step._cache_size() == 1


def test_bypass_uses_rollout_logprobs_as_pi_old():
    rl = dataclasses.replace(RL, correction=RolloutCorrectionConfig(bypass=True))
    batch = jit_steps(MODEL, FP8_ROLLOUT, rl, OPTIMIZER).rollout(_state(), _prompts())
    mask = np.asarray(batch.response_mask_BT)
    np.testing.assert_array_equal(batch.logp_old_BT, batch.logp_rollout_BT)
    np.testing.assert_array_equal(batch.is_weights_BT, mask)  # every ρ is 1
    np.testing.assert_array_equal(batch.keep_BT, mask)
    assert mask.sum() > 0
    # The BF16 scoring pass still runs (KV-scale amax) and the metrics still see the mismatch.
    assert float(batch.metrics["token_mult_prob_error"]) > 1.0
    assert all(np.all(np.asarray(a) > 0) for a in jax.tree.leaves(batch.qkv_amax))


def test_same_precision_rollout_gives_unit_is_weights():
    """No quantization, FP32 everywhere, temperature 1: π_rollout = π_old up to FP32 rounding.

    Tolerance: the rollout log-probs come from prefill + one-token decode steps over the KV
    cache, π_old from one full-sequence forward; the two sum attention and matmuls in different
    orders, so log-probs differ by ~1e-6 in FP32 (measured <= 1e-6 here). We allow 1e-4 on each
    log-ratio and IS weight and 1e-5 on the mean k1 `kl`.
    """
    rc = RolloutConfig(
        sampling=SamplingConfig(temperature=1.0),
        max_new_tokens=6,
        quant=None,
        kv_cache_dtype="float32",
        compute_dtype="float32",
    )
    batch = jit_steps(MODEL, rc, RL, OPTIMIZER).rollout(_state(rc), _prompts())
    mask = np.asarray(batch.response_mask_BT) > 0
    assert mask.sum() > 0
    log_ratio = np.asarray(batch.logp_old_BT - batch.logp_rollout_BT)[mask]
    np.testing.assert_allclose(log_ratio, 0.0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(batch.is_weights_BT)[mask], 1.0, atol=1e-4)
    assert abs(float(batch.metrics["kl"])) < 1e-5
    assert abs(float(batch.metrics["k3_kl"])) < 1e-5
    np.testing.assert_allclose(float(batch.metrics["token_mult_prob_error"]), 1.0, atol=1e-4)


@pytest.mark.slow
def test_fused_step_matches_two_programs_and_compiles_once(fp8_steps):
    rollout_step, train_step = fp8_steps
    fused = make_fused_step(MODEL, FP8_ROLLOUT, RL, OPTIMIZER, even_token_reward)
    parity_B = jnp.asarray(np.arange(4 * G) % 2, jnp.int32)

    state_f, batch_f, metrics_f = fused(_state(), _prompts(), parity_B)
    state = _state()
    batch = rollout_step(state, _prompts())
    rewards = even_token_reward(batch.tokens_BT, batch.response_mask_BT, parity_B)
    state, metrics = train_step(state, batch, rewards)

    # Same key and params: the same samples. The update may differ by FP32 rounding (XLA fuses
    # one program differently from two), hence the tolerance on params and metrics.
    np.testing.assert_array_equal(batch_f.tokens_BT, batch.tokens_BT)
    assert float(jnp.std(rewards)) > 0, "toy reward gives no learning signal"
    np.testing.assert_allclose(float(metrics_f["reward_mean"]), float(jnp.mean(rewards)))
    metrics = {**batch.metrics, **metrics}
    for name in ("loss", "grad_norm", "kl", "is_weight_mean", "advantage_abs_mean"):
        np.testing.assert_allclose(metrics_f[name], metrics[name], rtol=1e-4, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        state_f.params,
        copy_tree(state.params),
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4),
        state_f.kv_scales,
        copy_tree(state.kv_scales),
    )

    state2, _, metrics2 = fused(state_f, _prompts(), parity_B)
    assert_finite(metrics2)
    assert int(state2.step) == 2
    assert fused._cache_size() == 1
