"""The RL step on the paged engine (``rollout.engine="paged"``): it trains, compiles once, logs
the engine metrics, and its BF16 rollout log-probs match the scoring pass.

Tiny Qwen3-style model, 4 prompts x G=4 identical samples (groups share prompt pages), up to 6
new tokens, 6 decode slots over pages of 4 tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8rl_jax.generation import (
    PagedConfig,
    RolloutConfig,
    SamplingConfig,
    make_prompts,
)
from fp8rl_jax.rl import RLConfig, calibrate_program, init_train_state, jit_steps
from tests.testing import TINY_MODEL, VOCAB, assert_finite, copy_tree, tiny_params

MODEL, G = TINY_MODEL, 4
PAGED = PagedConfig(num_slots=6, page_size=4, prefill_batch=2)
FP8 = RolloutConfig(max_new_tokens=6, kv_cache_dtype="float8_e4m3fn", engine="paged", paged=PAGED)
RL = RLConfig(group_size=G, num_minibatches=2)
OPTIMIZER = optax.adam(1e-2)
ENGINE_KEYS = (
    "engine_slot_utilization", "engine_peak_pages", "engine_admissions", "engine_preemptions",
    "engine_prefills", "engine_decode_steps", "engine_unfinished", "engine_pages_in_use_end",
    "engine_peak_active_slots",
)  # fmt: skip


def _prompts():
    rng = np.random.default_rng(0)
    rows = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 7, 3, 8)]
    return make_prompts([r for r in rows for _ in range(G)])


def _state(rc):
    params = tiny_params()
    kv = calibrate_program(MODEL, rc)(params, _prompts())
    return init_train_state(params, OPTIMIZER, jax.random.key(1), kv)


@pytest.fixture(scope="module")
def two_steps():
    steps = jit_steps(MODEL, FP8, RL, OPTIMIZER)
    rewards = jnp.asarray(np.random.default_rng(1).normal(size=4 * G), jnp.float32)
    state0 = _state(FP8)
    host0 = copy_tree(state0)
    batch1 = steps.rollout(state0, _prompts())
    state1, m1 = steps.train(state0, batch1, rewards)
    batch2 = steps.rollout(state1, _prompts())
    state2, m2 = steps.train(state1, batch2, rewards)
    return dict(steps=steps, host0=host0, state2=state2, batches=(batch1, batch2), m=(m1, m2))


def test_paged_rl_step_trains_and_compiles_once(two_steps):
    host0, state2 = two_steps["host0"], two_steps["state2"]
    assert int(state2.step) == 2
    deltas = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                                          host0.params, state2.params))  # fmt: skip
    assert min(deltas) > 0
    for m in two_steps["m"]:
        assert_finite(m)
        assert float(m["grad_norm"]) > 0
    assert two_steps["steps"].rollout._cache_size() == 1
    assert two_steps["steps"].train._cache_size() == 1


def test_engine_metrics_are_in_the_step_metrics(two_steps):
    for batch in two_steps["batches"]:
        m = {k: float(batch.metrics[k]) for k in ENGINE_KEYS}
        assert m["engine_unfinished"] == 0 and m["engine_pages_in_use_end"] == 0
        assert m["engine_admissions"] == 4 * G + m["engine_preemptions"]
        assert m["engine_prefills"] >= 4  # one per prompt (again only after a preemption)
        assert 0 < m["engine_slot_utilization"] <= 1 and m["engine_peak_pages"] >= 1
        assert m["engine_decode_steps"] >= FP8.max_new_tokens
        assert 1 <= m["engine_peak_active_slots"] <= PAGED.num_slots


def test_bf16_paged_rollout_logprobs_match_the_scoring_pass():
    """BF16 weights, KV and activations, temperature 1: pi_rollout = pi_old up to BF16 rounding
    (decode over pages vs one full forward). Measured max |log-ratio| 1.7e-2, mean 6e-3 here;
    we allow 5e-2 per token and 1e-2 on the mean |log-ratio|."""
    rc = RolloutConfig(sampling=SamplingConfig(temperature=1.0), max_new_tokens=6, quant=None,
                       engine="paged", paged=PAGED)  # fmt: skip
    batch = jit_steps(MODEL, rc, RL, OPTIMIZER).rollout(_state(rc), _prompts())
    mask = np.asarray(batch.response_mask_BT) > 0
    log_ratio = np.asarray(batch.logp_old_BT - batch.logp_rollout_BT)[mask]
    assert mask.sum() > 0
    np.testing.assert_allclose(log_ratio, 0.0, atol=5e-2)
    assert np.abs(log_ratio).mean() < 1e-2


def test_rollout_step_prefills_at_most_one_prompt_per_group(monkeypatch):
    """The RL step tells the engine its rows come in groups of G, so the compiled prefill batch
    is the number of prompts (4), not ``prefill_batch`` (16) capped by the slots (6): a dense
    prompt cache of every layer and the prefill activations at 4 prompts (issue 20)."""
    import fp8rl_jax.generation.paged as paged_engine
    from fp8rl_jax.rl import rollout_fn

    plans = []

    def record(*args, **kw):
        plans.append(plan_pool(*args, **kw))
        return plans[-1]

    plan_pool = paged_engine.plan_pool
    monkeypatch.setattr(paged_engine, "plan_pool", record)
    paged = PagedConfig(num_slots=6, page_size=4, prefill_batch=16)
    rc = RolloutConfig(max_new_tokens=6, quant=None, engine="paged", paged=paged)
    jax.eval_shape(rollout_fn(MODEL, rc, RL), _state(rc), _prompts())
    assert [p.prefill_batch for p in plans] == [4]
