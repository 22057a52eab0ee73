"""The RL step as two jitted programs: FP8 rollout + BF16 scoring + correction, then the update.

Rollout program (DESIGN.md §2, steps 1-4): quantize the current params (the per-step "weight
sync"), generate with the FP8 or BF16 KV cache, score the generated tokens with the
high-precision policy under the same logits processing as sampling (``logp_old`` and the Q/K/V
amax for KV-scale recalibration), and compute the rollout-correction weights and metrics.

Train program (steps 5-7): advantages, ``ppo_epochs`` x minibatches of loss + optax update
(``lax.scan``; FP32 master weights, compute in ``compute_dtype``), and the next rollout's KV
scales from this step's BF16 pass. A non-finite loss, gradient or update skips the update and is
counted.

Optional terms (DESIGN.md §4.7), each costing nothing unless enabled: an entropy bonus from the
loss forward's logits; KL to a frozen reference policy (``TrainState.ref_params``, scored once in
the rollout program) as a loss term and/or a reward penalty; PPO with a value head on the policy
trunk (``advantage="gae"``, ``TrainState.value_head``), its old values from the scoring forward.

``rollout_fn``/``train_fn`` are the un-jitted programs; ``rl.programs`` jits them (on one device,
or with the ``StepShardings`` of a mesh), alone or composed with a JAX reward into one program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from fp8rl_jax.generation import PinParams, Prompts, RolloutConfig, cast_floats, rollout
from fp8rl_jax.models import ModelConfig
from fp8rl_jax.rl.correction import rollout_correction
from fp8rl_jax.rl.precision import policy_weights
from fp8rl_jax.rl.scoring import rollout_segment_ids, sequence_logprobs
from fp8rl_jax.rl.state import RLConfig, RolloutBatch, StepConfig, TrainState, check_state
from fp8rl_jax.rl.update import train_step
from fp8rl_jax.rl.value import token_values


def rollout_step(
    state: TrainState, prompts: Prompts, cfg: StepConfig, pin: PinParams | None = None
) -> RolloutBatch:
    """Steps 1-4: weight sync, generation, high-precision scoring, rollout correction.

    The rollout is ``generation.rollout`` (cast -> quantize -> pin -> the configured engine),
    the call evaluation makes too; ``pin`` (e.g. ``train.sharding.rollout_params_constraint``)
    pins the quantized weights to the rollout layout, so FSDP gathers run once per step.
    """
    check_state(state, cfg.rl)
    params = cast_floats(state.params, cfg.compute_dtype)
    # Stream 0 of step t samples the rollout; stream 1 shuffles the minibatches.
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 0)
    replay = cfg.rl.router_replay == "replay" and cfg.model.num_experts > 0
    ro, ro_metrics = rollout(
        params, prompts, cfg.model, cfg.rollout, rng, state.kv_scales, pin=pin,
        record_expert_ids=replay, group_size=cfg.rl.group_size,
    )  # fmt: skip
    segment_ids_BT = rollout_segment_ids(ro)
    positions_BT = jnp.maximum(jnp.cumsum(segment_ids_BT, axis=1) - 1, 0)
    mask_BT = ro.response_mask_BT.astype(jnp.float32)

    def score(p, **kw):
        out = sequence_logprobs(
            p, ro.tokens_BT, positions_BT, segment_ids_BT, cfg.model, cfg.rollout.sampling,
            logprob_chunk=cfg.rl.logprob_chunk, micro_batch=cfg.rl.score_micro_batch,
            kernels=cfg.rl.kernels, **kw,
        )  # fmt: skip
        return jnp.where(mask_BT > 0, out.logp_BT, 0.0), out

    # The scoring pass runs in bypass mode too: it gives the Q/K/V amax and lets the metrics
    # still measure the mismatch; bypass only changes which log-probs act as pi_old.
    weights, kv_quant = policy_weights(state.params, cfg, state.kv_scales)
    logp_hp_BT, out = score(
        weights,
        kv_quant=kv_quant,
        with_amax=True,
        with_hidden=cfg.rl.uses_value,
        expert_ids_BTLK=ro.expert_ids_BTLK,  # None unless replaying
    )
    logp_old_BT = ro.logp_BT if cfg.rl.correction.bypass else logp_hp_BT
    logp_ref_BT = values_BT = None
    if cfg.rl.uses_ref:  # the one extra forward: the frozen reference policy
        logp_ref_BT, _ = score(cast_floats(state.ref_params, cfg.compute_dtype))
    if cfg.rl.uses_value:
        values_BT = token_values(state.value_head, out.hidden_BTD) * mask_BT
    is_w, keep, metrics = rollout_correction(logp_hp_BT, ro.logp_BT, mask_BT, cfg.rl.correction)
    metrics = {**metrics, **ro_metrics}
    return RolloutBatch(
        tokens_BT=ro.tokens_BT,
        segment_ids_BT=segment_ids_BT,
        positions_BT=positions_BT,
        response_mask_BT=mask_BT,
        logp_rollout_BT=ro.logp_BT,
        logp_old_BT=logp_old_BT,
        is_weights_BT=is_w,
        keep_BT=keep.astype(jnp.float32),
        qkv_amax=out.qkv_amax,
        metrics=metrics,
        logp_ref_BT=logp_ref_BT,
        values_BT=values_BT,
        expert_ids_BTLK=ro.expert_ids_BTLK,
    )


def rollout_fn(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    *,
    pin_rollout_params: PinParams | None = None,
) -> Callable[[TrainState, Prompts], RolloutBatch]:
    """Un-jitted ``rollout_step(state, prompts) -> RolloutBatch`` (steps 1-4), for composing."""
    cfg = StepConfig(model_cfg, rollout_cfg, rl_cfg)
    return functools.partial(rollout_step, cfg=cfg, pin=pin_rollout_params)


def train_fn(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    optimizer: optax.GradientTransformation,
) -> Callable[[TrainState, RolloutBatch, jax.Array], tuple[TrainState, dict]]:
    """Un-jitted ``train_step(state, batch, rewards_B) -> (state', metrics)`` (steps 5-7)."""
    cfg = StepConfig(model_cfg, rollout_cfg, rl_cfg)
    return functools.partial(train_step, cfg=cfg, optimizer=optimizer)
