"""MoE rollout routing replay (R3, arXiv 2510.11370): ``rl.router_replay = "replay"``.

The rollout records each token's top-k experts per MoE layer; the BF16 scoring pass and the
loss forward route with them, the gate weights renormalized from their own router. Tiny MoE:
D=32, 2 MoE layers, E=4, top-2, 4 prompts x G=2 responses of up to 6 tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8rl_jax.generation import PagedConfig, RolloutConfig, SamplingConfig, generate, rollout
from fp8rl_jax.generation.engine import Capabilities, check_capabilities
from fp8rl_jax.models import forward
from fp8rl_jax.models.moe import REPLAY_NONE, route
from fp8rl_jax.rl import RLConfig, init_train_state, jit_steps
from fp8rl_jax.rl.scoring import rollout_segment_ids
from fp8rl_jax.train.experiment import Experiment, ModelSpec, TrainerConfig
from tests.testing import TINY_MODEL, VOCAB, assert_finite, copy_tree, tiny_params, tiny_prompts

MOE_SPEC = ModelSpec(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
    architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32,
)  # fmt: skip
MOE = MOE_SPEC.tiny_config(VOCAB)
G = 2
ROLLOUT = RolloutConfig(max_new_tokens=6)  # FP8 W8A8 weights, BF16 compute and KV cache
REPLAY = RLConfig(group_size=G, router_replay="replay")


def _prompts():
    return tiny_prompts((5, 7, 3, 8), G)


def _positions(segment_ids_BT):
    return jnp.maximum(jnp.cumsum(segment_ids_BT, axis=1) - 1, 0)


def test_router_replay_is_validated():
    with pytest.raises(ValueError, match="router_replay"):
        RLConfig(router_replay="always")


def test_route_replays_given_experts_with_renormalized_own_weights():
    cfg = MOE
    x = jax.random.normal(jax.random.key(0), (3, cfg.hidden_size))
    router = jax.random.normal(jax.random.key(1), (cfg.hidden_size, cfg.num_experts))
    own_w, own_i, p = route(x, router, cfg)
    ids = jnp.asarray([[3, 1], [0, 2], [REPLAY_NONE] * 2], jnp.int16)
    w, i, _ = route(x, router, cfg, expert_ids_NK=ids)
    np.testing.assert_array_equal(i[:2], [[3, 1], [0, 2]])
    np.testing.assert_array_equal(i[2], own_i[2])  # not recorded: its own top-k
    for n, (a, b) in enumerate([(3, 1), (0, 2)]):  # w_j = p_j / (p_a + p_b) (norm_topk_prob)
        np.testing.assert_allclose(w[n], p[n, [a, b]] / (p[n, a] + p[n, b]), rtol=1e-6)
    np.testing.assert_allclose(w[2], own_w[2], rtol=1e-6)


@pytest.mark.slow
def test_rollout_records_the_experts_each_token_went_to():
    """F32 rollout vs a F32 forward over the sequences: same experts at every recorded token,
    and exactly the real prompt tokens and the response tokens but each row's last are recorded."""
    params = tiny_params(MOE)
    ro = generate(
        params, _prompts(), MOE, SamplingConfig(), jax.random.key(3), kv_cache_dtype="float32",
        max_new_tokens=6, record_expert_ids=True,
    )  # fmt: skip
    ids = np.asarray(ro.expert_ids_BTLK)
    T = ro.prompt_len + 6
    assert ro.expert_ids_BTLK.dtype == jnp.int16 and ids.shape == (8, T, 2, 2)
    seg = rollout_segment_ids(ro)
    out = forward(
        params, ro.tokens_BT, MOE, positions_BT=_positions(seg), segment_ids_BT=seg,
        return_expert_ids=True,
    )  # fmt: skip
    recorded = ids[..., 0] >= 0  # [B, T, L]
    last = np.arange(T)[None] == (ro.prompt_len + np.asarray(ro.response_lens_B) - 1)[:, None]
    expect = (np.asarray(seg) > 0) & ~last
    np.testing.assert_array_equal(recorded, np.broadcast_to(expect[..., None], recorded.shape))
    assert np.all((ids == REPLAY_NONE) | recorded[..., None])
    np.testing.assert_array_equal(ids[recorded], np.asarray(out.expert_ids_BTLK)[recorded])


@pytest.fixture(scope="module")
def replay_run():
    """Two RL steps on the tiny MoE with replay (FP8 rollout): the batches and the states."""
    steps = jit_steps(MOE, ROLLOUT, REPLAY, optax.adam(1e-2))
    params = tiny_params(MOE)
    state = init_train_state(params, optax.adam(1e-2), jax.random.key(1))
    batches, metrics, states = [], [], [copy_tree(state)]
    for t in range(2):
        batch = steps.rollout(state, tiny_prompts((5, 7, 3, 8), G, seed=t))
        rewards = jnp.asarray(np.random.default_rng(t).normal(size=8), jnp.float32)
        state, m = steps.train(state, batch, rewards)
        batches.append(batch)
        metrics.append(m)
        states.append(copy_tree(state))
    return batches, metrics, states


@pytest.mark.slow
def test_replay_bf16_scoring_uses_the_fp8_rollouts_experts(replay_run):
    """The scoring pass (BF16, as rollout_step runs it) with replay routes every recorded token
    to exactly the experts the FP8 rollout chose; without replay it would not (here: counted)."""
    batches, _, states = replay_run
    batch, params = batches[0], states[0].params
    ids = batch.expert_ids_BTLK
    recorded = np.asarray(ids[..., 0] >= 0)
    assert recorded.sum() > 0
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)

    def experts(replay):
        return forward(
            bf16, batch.tokens_BT, MOE, positions_BT=batch.positions_BT,
            segment_ids_BT=batch.segment_ids_BT, return_expert_ids=True,
            expert_ids_BTLK=ids if replay else None,
        ).expert_ids_BTLK  # fmt: skip

    np.testing.assert_array_equal(np.asarray(experts(True))[recorded], np.asarray(ids)[recorded])
    # The FP8 rollout's own choices differ from BF16's somewhere (else replay would be moot).
    differ = np.any(np.asarray(experts(False))[recorded] != np.asarray(ids)[recorded], axis=-1)
    print(f"token-layers routed differently without replay: {differ.mean():.3f}")


@pytest.mark.slow
def test_rl_step_trains_with_replay(replay_run):
    batches, metrics, states = replay_run
    for m in metrics:
        assert_finite(m)
    assert np.isfinite(float(batches[1].metrics["kl"]))
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), states[0].params,
                         states[-1].params)  # fmt: skip
    assert max(jax.tree.leaves(moved)) > 0


@pytest.mark.slow
def test_replay_is_a_noop_for_dense_models():
    rollout = dataclasses.replace(ROLLOUT, max_new_tokens=3)
    out = {}
    for mode in ("none", "replay"):
        rl = RLConfig(group_size=G, router_replay=mode)
        steps = jit_steps(TINY_MODEL, rollout, rl, optax.adam(1e-2))
        state = init_train_state(tiny_params(), optax.adam(1e-2), jax.random.key(1))
        out[mode] = steps.rollout(state, _prompts())
    assert out["replay"].expert_ids_BTLK is None
    np.testing.assert_array_equal(out["none"].tokens_BT, out["replay"].tokens_BT)
    np.testing.assert_array_equal(out["none"].logp_old_BT, out["replay"].logp_old_BT)


def test_an_engine_without_a_capability_is_refused_naming_both_fields():
    caps = Capabilities(
        router_replay=False, dynamic_kv_scales=True, response_budgets=True,
        continuous_batching=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"rl.router_replay='replay'.*rollout.engine='paged'"):
        check_capabilities(caps, RolloutConfig(engine="paged"), router_replay=True)
    check_capabilities(caps, RolloutConfig(engine="paged"), router_replay=False)
    # both engines record experts: a paged MoE run with replay is a valid experiment
    Experiment(
        model=MOE_SPEC, rollout=RolloutConfig(engine="paged"),
        rl=RLConfig(group_size=G, router_replay="replay"),
        trainer=TrainerConfig(prompts_per_step=4),
    )  # fmt: skip


@pytest.mark.slow
def test_paged_engine_records_the_same_experts_as_the_static_engine():
    """``rollout`` on the paged engine (3 slots, pages of 4: slots are reused, groups share
    prompt pages) with replay records what the static engine records (F32: same tokens)."""
    cfg = RolloutConfig(
        max_new_tokens=6, quant=None, kv_cache_dtype="float32", compute_dtype="float32"
    )
    params = tiny_params(MOE)
    out = {}
    for engine in ("static", "paged"):
        rc = dataclasses.replace(cfg, engine=engine, paged=PagedConfig(num_slots=3, page_size=4))
        out[engine], _ = rollout(
            params, _prompts(), MOE, rc, jax.random.key(3), record_expert_ids=True
        )
    static, paged = out["static"], out["paged"]
    np.testing.assert_array_equal(paged.tokens_BT, static.tokens_BT)
    assert paged.expert_ids_BTLK.dtype == jnp.int16
    np.testing.assert_array_equal(paged.expert_ids_BTLK, static.expert_ids_BTLK)
    assert np.any(np.asarray(paged.expert_ids_BTLK) >= 0)
