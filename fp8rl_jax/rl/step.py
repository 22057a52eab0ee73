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

With a reward that is a JAX function, ``make_fused_step`` composes both (and the reward) into one
program; ``rollout_fn``/``train_fn`` are the un-jitted pieces all three builders share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fp8rl_jax.generation import Prompts, calibrate_kv_scales, generate
from fp8rl_jax.models import ModelConfig
from fp8rl_jax.quant import quantize_params
from fp8rl_jax.rl.advantages import gae, grpo_advantages, masked_whiten, rloo_advantages
from fp8rl_jax.rl.correction import rollout_correction
from fp8rl_jax.rl.losses import entropy_bonus, kl_loss, masked_mean, policy_loss, value_loss
from fp8rl_jax.rl.scoring import (  # noqa: F401  (re-exported: the step's public helpers)
    calibrate_initial_kv_scales,
    cast_floats,
    policy_entropy,
    prompt_segment_ids,
    rollout_segment_ids,
    sequence_logprobs,
)
from fp8rl_jax.rl.state import (  # noqa: F401  (re-exported)
    ADVANTAGES,
    KV_CACHE_DTYPES,
    KV_SCALE_MODES,
    RLConfig,
    RolloutBatch,
    RolloutConfig,
    TrainState,
    _check_state,
    _trainable,
    init_train_state,
)
from fp8rl_jax.rl.value import kl_reward_penalty, terminal_rewards, token_values


class _MiniBatch(NamedTuple):
    tokens_BT: jax.Array
    segment_ids_BT: jax.Array
    positions_BT: jax.Array
    mask_BT: jax.Array
    logp_old_BT: jax.Array
    advantages_BT: jax.Array
    is_weights_BT: jax.Array
    keep_BT: jax.Array
    logp_ref_BT: jax.Array | None = None  # KL loss term
    old_values_BT: jax.Array | None = None  # value clipping (GAE)
    returns_BT: jax.Array | None = None  # value targets (GAE)


def rollout_fn(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    *,
    constrain_rollout_params: Callable | None = None,
) -> Callable[[TrainState, Prompts], RolloutBatch]:
    """Un-jitted ``rollout_step(state, prompts) -> RolloutBatch`` (steps 1-4), for composing.

    ``constrain_rollout_params`` (e.g. ``train.sharding.rollout_params_constraint``) pins the
    quantized weights to the rollout layout, so FSDP gathers run once per step, not per token.
    """
    compute_dtype = jnp.dtype(rollout_cfg.compute_dtype)

    def rollout_step(state: TrainState, prompts: Prompts) -> RolloutBatch:
        _check_state(state, rl_cfg)
        params = cast_floats(state.params, compute_dtype)
        rollout_params, qstats = quantize_params(params, rollout_cfg.quant, return_stats=True)
        if constrain_rollout_params is not None:  # gather FP8 weights once, not per token
            rollout_params = constrain_rollout_params(rollout_params)
        # Stream 0 of step t samples the rollout; stream 1 shuffles the minibatches.
        rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 0)
        ro = generate(
            rollout_params,
            prompts,
            model_cfg,
            rollout_cfg.sampling,
            rng,
            kv_cache_dtype=rollout_cfg.kv_cache_dtype,
            kv_scale_mode=rollout_cfg.kv_scale_mode,
            kv_scales=state.kv_scales if rollout_cfg.static_kv_scales else None,
            max_new_tokens=rollout_cfg.max_new_tokens,
            stop_token_ids=rollout_cfg.stop_token_ids,
            kernels=rollout_cfg.kernels,
        )
        segment_ids_BT = rollout_segment_ids(ro)
        positions_BT = jnp.maximum(jnp.cumsum(segment_ids_BT, axis=1) - 1, 0)
        mask_BT = ro.response_mask_BT.astype(jnp.float32)
        # The scoring pass runs in bypass mode too: it gives the Q/K/V amax and lets the metrics
        # still measure the mismatch; bypass only changes which log-probs act as pi_old.
        logp_hp_BT, out = sequence_logprobs(
            params,
            ro.tokens_BT,
            positions_BT,
            segment_ids_BT,
            model_cfg,
            rollout_cfg.sampling,
            with_amax=True,
            with_hidden=rl_cfg.uses_value,
        )
        logp_hp_BT = jnp.where(mask_BT > 0, logp_hp_BT, 0.0)
        logp_old_BT = ro.logp_BT if rl_cfg.correction.bypass else logp_hp_BT
        logp_ref_BT = values_BT = None
        if rl_cfg.uses_ref:  # the one extra forward: the frozen reference policy
            logp_ref_BT, _ = sequence_logprobs(
                cast_floats(state.ref_params, compute_dtype),
                ro.tokens_BT,
                positions_BT,
                segment_ids_BT,
                model_cfg,
                rollout_cfg.sampling,
            )
            logp_ref_BT = jnp.where(mask_BT > 0, logp_ref_BT, 0.0)
        if rl_cfg.uses_value:
            values_BT = token_values(state.value_head, out.hidden_BTD) * mask_BT
        is_w, keep, metrics = rollout_correction(logp_hp_BT, ro.logp_BT, mask_BT, rl_cfg.correction)
        metrics = dict(metrics)
        metrics["response_len_mean"] = jnp.mean(ro.response_lens_B.astype(jnp.float32))
        metrics["quant_nonfinite"] = qstats.nonfinite
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
        )

    return rollout_step


def make_rollout_step(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    *,
    constrain_rollout_params: Callable | None = None,
) -> Callable[[TrainState, Prompts], RolloutBatch]:
    """``rollout_step(state, prompts) -> RolloutBatch``, one jitted program (see ``rollout_fn``)."""
    return jax.jit(
        rollout_fn(
            model_cfg, rollout_cfg, rl_cfg, constrain_rollout_params=constrain_rollout_params
        )
    )


def compute_advantages(rewards_B, mask_BT, rl_cfg: RLConfig):
    """Per-token advantages from sequence rewards (GRPO, Dr.GRPO or RLOO)."""
    if rl_cfg.advantage == "rloo":
        return rloo_advantages(rewards_B, mask_BT, rl_cfg.group_size)
    return grpo_advantages(
        rewards_B, mask_BT, rl_cfg.group_size, scale_by_std=rl_cfg.advantage == "grpo"
    )


class Targets(NamedTuple):
    advantages_BT: jax.Array
    returns_BT: jax.Array | None  # value targets (GAE only)
    rewards_B: jax.Array  # sequence rewards after the KL penalty (sum of the token rewards)


def compute_targets(batch: RolloutBatch, rewards_B, rl_cfg: RLConfig) -> Targets:
    """Advantages (and GAE returns) from sequence rewards, with the optional KL-in-reward penalty.

    Token rewards: ``r_t = −β·kl_t`` on the response plus ``rewards_B`` at its last token. GRPO
    and RLOO see their sum ``rewards_B − β Σ_t kl_t``; GAE sees them per token, with the old values
    of the scoring pass, then (optionally) whitened advantages.
    """
    mask_BT = batch.response_mask_BT
    rewards_B = rewards_B.astype(jnp.float32)
    penalty_BT = jnp.zeros_like(mask_BT, jnp.float32)
    if rl_cfg.kl_in_reward > 0.0:
        penalty_BT = kl_reward_penalty(
            batch.logp_old_BT, batch.logp_ref_BT, mask_BT, rl_cfg.kl_in_reward, rl_cfg.loss.kl_kind
        )
    if not rl_cfg.uses_value:
        rewards_B = rewards_B + jnp.sum(penalty_BT, axis=1)
        return Targets(compute_advantages(rewards_B, mask_BT, rl_cfg), None, rewards_B)
    rewards_BT = terminal_rewards(rewards_B, mask_BT) + penalty_BT
    adv_BT, returns_BT = gae(rewards_BT, batch.values_BT, mask_BT, rl_cfg.gamma, rl_cfg.lam)
    if rl_cfg.whiten_advantages:
        adv_BT = masked_whiten(adv_BT, mask_BT)
    return Targets(adv_BT, returns_BT, jnp.sum(rewards_BT, axis=1))


def _extra_losses(logp_BT, out, value_head, mb: _MiniBatch, rl_cfg: RLConfig, sampling):
    """``entropy_coef·(−H) + kl_coef·KL + vf_coef·L_V``, each term only when enabled.

    The entropy is always logged (one reduction over the logits, no gradient when unused).
    """
    cfg = rl_cfg.loss
    m_BT = mb.mask_BT * mb.keep_BT
    bonus, metrics = entropy_bonus(policy_entropy(out.logits_BTV, sampling), m_BT, cfg)
    loss = cfg.entropy_coef * bonus if cfg.entropy_coef > 0.0 else jnp.zeros((), jnp.float32)
    if cfg.kl_coef > 0.0:
        kl, kl_metrics = kl_loss(logp_BT, mb.logp_ref_BT, m_BT, cfg)
        loss, metrics = loss + cfg.kl_coef * kl, {**metrics, **kl_metrics}
    if value_head is not None:
        values_BT = token_values(value_head, out.hidden_BTD)
        vf, vf_metrics = value_loss(
            values_BT, mb.old_values_BT, mb.returns_BT, mb.mask_BT, cfg.vf_clip, cfg.agg
        )
        loss, metrics = loss + cfg.vf_coef * vf, {**metrics, **vf_metrics}
    return loss, metrics


def _split_trainable(tree, with_value_head: bool):
    return (tree["policy"], tree["value_head"]) if with_value_head else (tree, None)


class _UpdateCarry(NamedTuple):
    trainable: dict  # params, or {"policy": params, "value_head": ...}
    opt_state: optax.OptState
    skips: jax.Array  # int32 non-finite updates skipped so far


def _split_minibatches(mb: _MiniBatch, n: int, rng) -> _MiniBatch:
    """Shuffles rows and reshapes every field to [n, B/n, ...]."""
    B = mb.tokens_BT.shape[0]
    perm = jax.random.permutation(rng, B)
    return jax.tree.map(lambda x: x[perm].reshape(n, B // n, *x.shape[1:]), mb)


def kv_scale_metrics(kv_scales) -> dict:
    """Range of the static FP8 KV scales and how many amax entries were invalid (0/NaN/Inf)."""
    return {
        "kv_scale_k_min": jnp.min(kv_scales.k),
        "kv_scale_k_max": jnp.max(kv_scales.k),
        "kv_scale_v_min": jnp.min(kv_scales.v),
        "kv_scale_v_max": jnp.max(kv_scales.v),
        "kv_scale_invalid": kv_scales.num_invalid,
    }


def train_fn(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    optimizer: optax.GradientTransformation,
) -> Callable[[TrainState, RolloutBatch, jax.Array], tuple[TrainState, dict]]:
    """Un-jitted ``train_step(state, batch, rewards_B) -> (state', metrics)`` (steps 5-7)."""
    compute_dtype = jnp.dtype(rollout_cfg.compute_dtype)
    n_mb, n_acc = rl_cfg.num_minibatches, rl_cfg.grad_accum

    def loss_fn(trainable, mb: _MiniBatch):
        params, value_head = _split_trainable(trainable, rl_cfg.uses_value)
        logp_BT, out = sequence_logprobs(
            cast_floats(params, compute_dtype),
            mb.tokens_BT,
            mb.positions_BT,
            mb.segment_ids_BT,
            model_cfg,
            rollout_cfg.sampling,
            with_hidden=rl_cfg.uses_value,
        )
        loss, metrics = policy_loss(
            logp_BT,
            mb.logp_old_BT,
            mb.advantages_BT,
            mb.mask_BT,
            mb.is_weights_BT,
            mb.keep_BT,
            rl_cfg.loss,
        )
        extra, extra_metrics = _extra_losses(
            logp_BT, out, value_head, mb, rl_cfg, rollout_cfg.sampling
        )
        loss, metrics = loss + extra, {**metrics, **extra_metrics}
        if model_cfg.num_experts:
            loss = loss + model_cfg.router_aux_loss_coef * out.aux_loss
            metrics = {**metrics, "router_aux_loss": out.aux_loss}
        return loss, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def minibatch_grads(params, mb: _MiniBatch):
        micro = jax.tree.map(lambda x: x.reshape(n_acc, x.shape[0] // n_acc, *x.shape[1:]), mb)

        def acc(carry, m):
            (loss, metrics), g = grad_fn(params, m)
            return jax.tree.map(jnp.add, carry, (loss, metrics, g)), None

        (loss0, met0), g0 = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
        if n_acc > 1:
            rest = jax.tree.map(lambda x: x[1:], micro)
            (loss0, met0, g0), _ = jax.lax.scan(acc, (loss0, met0, g0), rest)
        scale = 1.0 / n_acc
        return jax.tree.map(lambda x: x * scale, (loss0, met0, g0))

    def update(carry: _UpdateCarry, mb: _MiniBatch):
        params, opt_state = carry.trainable, carry.opt_state
        loss, metrics, grads = minibatch_grads(params, mb)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        # The updates are checked too: finite gradients can still give a non-finite step (an
        # inf learning rate, an optimizer-state overflow), which must not reach the params.
        finite = (
            jnp.isfinite(loss)
            & jnp.isfinite(optax.global_norm(grads))
            & jnp.isfinite(optax.global_norm(updates))
        )
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jax.tree.map(
            lambda n, o: jnp.where(finite, n, o), (new_params, new_opt), (params, opt_state)
        )
        metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads)}
        return _UpdateCarry(params, opt_state, carry.skips + (~finite).astype(jnp.int32)), metrics

    def train_step(state: TrainState, batch: RolloutBatch, rewards_B: jax.Array):
        _check_state(state, rl_cfg)
        mask_BT = batch.response_mask_BT
        targets = compute_targets(batch, rewards_B, rl_cfg)
        adv_BT = targets.advantages_BT
        data = _MiniBatch(
            batch.tokens_BT,
            batch.segment_ids_BT,
            batch.positions_BT,
            mask_BT,
            batch.logp_old_BT,
            adv_BT,
            batch.is_weights_BT,
            batch.keep_BT,
            logp_ref_BT=batch.logp_ref_BT if rl_cfg.loss.kl_coef > 0.0 else None,
            old_values_BT=batch.values_BT,
            returns_BT=targets.returns_BT,
        )
        rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 1)
        epochs = jax.vmap(lambda k: _split_minibatches(data, n_mb, k))(
            jax.random.split(rng, rl_cfg.ppo_epochs)
        )
        flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), epochs)
        carry = _UpdateCarry(
            _trainable(state.params, state.value_head), state.opt_state, state.nonfinite_skips
        )
        carry, mb_metrics = jax.lax.scan(update, carry, flat)
        params, value_head = _split_trainable(carry.trainable, rl_cfg.uses_value)
        kv_scales = state.kv_scales
        if rollout_cfg.static_kv_scales:
            kv_scales = calibrate_kv_scales(
                batch.qkv_amax,
                rollout_cfg.kv_calib_percentile,
                rollout_cfg.kv_calib_margin,
                previous=state.kv_scales,
            )
        metrics = {k: jnp.mean(v) for k, v in mb_metrics.items()}
        metrics["reward_mean"] = jnp.mean(rewards_B)
        if rl_cfg.kl_in_reward > 0.0:
            metrics["reward_with_kl_mean"] = jnp.mean(targets.rewards_B)
        if targets.returns_BT is not None:
            metrics["return_mean"] = masked_mean(targets.returns_BT, mask_BT)
        metrics["advantage_abs_mean"] = masked_mean(jnp.abs(adv_BT), mask_BT)
        if rollout_cfg.static_kv_scales:  # DESIGN §4.5: the scales the next rollout uses, logged
            metrics.update(kv_scale_metrics(kv_scales))
        metrics["nonfinite_skips"] = carry.skips
        new_state = dataclasses.replace(
            state,
            params=params,
            opt_state=carry.opt_state,
            kv_scales=kv_scales,
            step=state.step + 1,
            nonfinite_skips=carry.skips,
            value_head=value_head,
        )
        return new_state, metrics

    return train_step


def make_train_step(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    optimizer: optax.GradientTransformation,
) -> Callable[[TrainState, RolloutBatch, jax.Array], tuple[TrainState, dict]]:
    """``train_step(state, batch, rewards_B) -> (state', metrics)``, jitted, state donated."""
    return jax.jit(train_fn(model_cfg, rollout_cfg, rl_cfg, optimizer), donate_argnums=(0,))


RewardFn = Callable[[jax.Array, jax.Array, object], jax.Array]


def make_fused_step(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    optimizer: optax.GradientTransformation,
    reward_fn: RewardFn,
) -> Callable[[TrainState, Prompts, object], tuple[TrainState, RolloutBatch, dict]]:
    """Steps 1-7 as one jitted program, for rewards that are JAX functions (DESIGN.md §2).

    ``reward_fn(tokens_BT, response_mask_BT, prompt_data) -> rewards_B`` runs in-graph between
    the rollout and the update; ``prompt_data`` is any pytree of per-row arrays (targets, ...).
    Returns ``fused_step(state, prompts, prompt_data) -> (state', batch, metrics)``, state
    donated; ``metrics`` holds the rollout and the train metrics.
    """
    rollout_step = rollout_fn(model_cfg, rollout_cfg, rl_cfg)
    train_step = train_fn(model_cfg, rollout_cfg, rl_cfg, optimizer)

    def fused_step(state: TrainState, prompts: Prompts, prompt_data):
        batch = rollout_step(state, prompts)
        rewards_B = reward_fn(batch.tokens_BT, batch.response_mask_BT, prompt_data)
        new_state, train_metrics = train_step(state, batch, rewards_B)
        return new_state, batch, {**batch.metrics, **train_metrics}

    return jax.jit(fused_step, donate_argnums=(0,))
