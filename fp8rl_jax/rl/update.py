"""The train program's pieces (DESIGN.md §2, steps 5-7) as pure functions with named carries.

``train_step`` = ``compute_targets`` (advantages, GAE returns, KL-in-reward) -> ``ppo_epochs``
x minibatches of ``update_minibatch`` under ``lax.scan`` (each: ``minibatch_grads`` over
``grad_accum`` micro-batches of ``loss_fn``, one optax update, skipped and counted when the loss,
gradient or update is non-finite) -> the next rollout's static KV scales from this step's
high-precision scoring pass. FP32 master weights; the forward computes in ``compute_dtype``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fp8rl_jax.generation import kv_scale_metrics, recalibrate_kv_scales
from fp8rl_jax.models.rows import constrain_rows
from fp8rl_jax.rl.advantages import gae, grpo_advantages, masked_whiten, rloo_advantages
from fp8rl_jax.rl.dapo import shape_rewards
from fp8rl_jax.rl.losses import entropy_bonus, kl_loss, masked_mean, policy_loss, value_loss
from fp8rl_jax.rl.precision import policy_weights
from fp8rl_jax.rl.scoring import Scores, sequence_logprobs
from fp8rl_jax.rl.state import (
    RLConfig,
    RolloutBatch,
    StepConfig,
    Trainable,
    TrainState,
    check_state,
)
from fp8rl_jax.rl.value import kl_reward_penalty, terminal_rewards, token_values


class MiniBatch(NamedTuple):
    """The rows one update sees (all [B, T]); optional fields only when their term is enabled."""

    tokens_BT: jax.Array
    segment_ids_BT: jax.Array
    positions_BT: jax.Array
    mask_BT: jax.Array  # response tokens
    logp_old_BT: jax.Array  # π_old of the PPO ratio
    advantages_BT: jax.Array
    is_weights_BT: jax.Array  # rollout-correction importance weights
    keep_BT: jax.Array  # rollout-correction keep mask
    logp_ref_BT: jax.Array | None = None  # KL loss term
    old_values_BT: jax.Array | None = None  # value clipping (GAE)
    returns_BT: jax.Array | None = None  # value targets (GAE)
    expert_ids_BTLK: jax.Array | None = None  # the rollout's MoE experts (routing replay)


class Targets(NamedTuple):
    """What the update regresses on, computed once per step from the rollout and its rewards."""

    advantages_BT: jax.Array
    returns_BT: jax.Array | None  # value targets (GAE only)
    rewards_B: jax.Array  # sequence rewards after the KL penalty (sum of the token rewards)


class Grads(NamedTuple):
    """Loss, metrics and gradients of one minibatch, averaged over its micro-batches."""

    loss: jax.Array
    metrics: dict
    grads: Trainable


class UpdateCarry(NamedTuple):
    """The ``lax.scan`` carry over the minibatch updates of one step."""

    trainable: Trainable
    opt_state: optax.OptState
    skips: jax.Array  # int32 non-finite updates skipped so far


def compute_advantages(rewards_B, mask_BT, rl_cfg: RLConfig):
    """Per-token advantages from sequence rewards (GRPO, Dr.GRPO or RLOO)."""
    if rl_cfg.advantage == "rloo":
        return rloo_advantages(rewards_B, mask_BT, rl_cfg.group_size)
    return grpo_advantages(
        rewards_B, mask_BT, rl_cfg.group_size, scale_by_std=rl_cfg.advantage == "grpo"
    )


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


def _extra_losses(logp_BT, out: Scores, value_head, mb: MiniBatch, cfg: StepConfig):
    """``entropy_coef·(−H) + kl_coef·KL + vf_coef·L_V``, each term only when enabled.

    The entropy is always logged (one reduction over the logits, no gradient when unused).
    """
    loss_cfg = cfg.rl.loss
    m_BT = mb.mask_BT * mb.keep_BT
    bonus, metrics = entropy_bonus(out.entropy_BT, m_BT, loss_cfg)
    loss = jnp.zeros((), jnp.float32)
    if loss_cfg.entropy_coef > 0.0:
        loss = loss_cfg.entropy_coef * bonus
    if loss_cfg.kl_coef > 0.0:
        kl, kl_metrics = kl_loss(logp_BT, mb.logp_ref_BT, m_BT, loss_cfg)
        loss, metrics = loss + loss_cfg.kl_coef * kl, {**metrics, **kl_metrics}
    if value_head is not None:
        values_BT = token_values(value_head, out.hidden_BTD)
        vf, vf_metrics = value_loss(
            values_BT, mb.old_values_BT, mb.returns_BT, mb.mask_BT, loss_cfg.vf_clip, loss_cfg.agg
        )
        loss, metrics = loss + loss_cfg.vf_coef * vf, {**metrics, **vf_metrics}
    return loss, metrics


def loss_fn(
    trainable: Trainable, mb: MiniBatch, cfg: StepConfig, kv_scales=None
) -> tuple[jax.Array, dict]:
    """PPO policy loss + the enabled extra terms (+ the MoE router aux loss), and its metrics.

    ``kv_scales``: the static KV scales of the scored rollout (``rl.train_precision``).
    """
    weights, kv_quant = policy_weights(trainable.policy, cfg, kv_scales)
    out = sequence_logprobs(
        weights,
        mb.tokens_BT,
        mb.positions_BT,
        mb.segment_ids_BT,
        cfg.model,
        cfg.rollout.sampling,
        with_hidden=trainable.value_head is not None,
        with_entropy=True,
        expert_ids_BTLK=mb.expert_ids_BTLK,
        kv_quant=kv_quant,
        logprob_chunk=cfg.rl.logprob_chunk,
        remat=cfg.rl.remat,
        kernels=cfg.rl.kernels,
    )
    logp_BT = out.logp_BT
    loss, metrics = policy_loss(
        logp_BT,
        mb.logp_old_BT,
        mb.advantages_BT,
        mb.mask_BT,
        mb.is_weights_BT,
        mb.keep_BT,
        cfg.rl.loss,
    )
    extra, extra_metrics = _extra_losses(logp_BT, out, trainable.value_head, mb, cfg)
    loss, metrics = loss + extra, {**metrics, **extra_metrics}
    if cfg.model.num_experts:
        loss = loss + cfg.model.router_aux_loss_coef * out.aux_loss
        metrics = {**metrics, "router_aux_loss": out.aux_loss}
    return loss, metrics


def minibatch_grads(trainable: Trainable, mb: MiniBatch, cfg: StepConfig, kv_scales=None) -> Grads:
    """Mean loss, metrics and gradients over ``grad_accum`` equal micro-batches of ``mb``."""
    n_acc = cfg.rl.grad_accum
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def one(m: MiniBatch) -> Grads:
        (loss, metrics), grads = grad_fn(trainable, m, cfg, kv_scales)
        return Grads(loss, metrics, grads)

    def acc(total: Grads, m: MiniBatch):
        return jax.tree.map(jnp.add, total, one(m)), None

    # Micro-batch i holds rows i, i + n_acc, i + 2 n_acc, ...: rows split in contiguous blocks
    # over the devices of a mesh stay split over all of them in every micro-batch (a contiguous
    # cut would put each micro-batch on a few devices and make the others compute it whole).
    micro = _rows_split(
        jax.tree.map(
            lambda x: jnp.swapaxes(x.reshape(x.shape[0] // n_acc, n_acc, *x.shape[1:]), 0, 1), mb
        )
    )
    total = one(jax.tree.map(lambda x: x[0], micro))
    if n_acc > 1:
        total, _ = jax.lax.scan(acc, total, jax.tree.map(lambda x: x[1:], micro))
    return jax.tree.map(lambda x: x * (1.0 / n_acc), total)


def update_minibatch(
    carry: UpdateCarry,
    mb: MiniBatch,
    cfg: StepConfig,
    optimizer: optax.GradientTransformation,
    kv_scales=None,
) -> tuple[UpdateCarry, dict]:
    """One optax update from ``mb``; a non-finite loss, gradient or update is skipped and counted.

    The updates are checked too: finite gradients can still give a non-finite step (an inf
    learning rate, an optimizer-state overflow), which must not reach the params.
    """
    loss, metrics, grads = minibatch_grads(carry.trainable, mb, cfg, kv_scales)
    updates, new_opt = optimizer.update(grads, carry.opt_state, carry.trainable)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(updates))
    new_trainable = optax.apply_updates(carry.trainable, updates)
    trainable, opt_state = jax.tree.map(
        lambda n, o: jnp.where(finite, n, o),
        (new_trainable, new_opt),
        (carry.trainable, carry.opt_state),
    )
    skips = carry.skips + (~finite).astype(jnp.int32)
    metrics = {**metrics, "loss": loss, "grad_norm": grad_norm}
    return UpdateCarry(trainable, opt_state, skips), metrics


def minibatches(batch: RolloutBatch, targets: Targets, rl_cfg: RLConfig, rng) -> MiniBatch:
    """Every update's rows, [ppo_epochs * num_minibatches, B / num_minibatches, ...].

    Each epoch shuffles the rows with its own key from ``rng`` and cuts them into minibatches.
    """
    data = MiniBatch(
        batch.tokens_BT,
        batch.segment_ids_BT,
        batch.positions_BT,
        batch.response_mask_BT,
        batch.logp_old_BT,
        targets.advantages_BT,
        batch.is_weights_BT,
        batch.keep_BT,
        logp_ref_BT=batch.logp_ref_BT if rl_cfg.loss.kl_coef > 0.0 else None,
        old_values_BT=batch.values_BT,
        returns_BT=targets.returns_BT,
        expert_ids_BTLK=batch.expert_ids_BTLK,
    )
    n, B = rl_cfg.num_minibatches, batch.tokens_BT.shape[0]

    def shuffle(key) -> MiniBatch:
        perm = jax.random.permutation(key, B)
        return jax.tree.map(lambda x: x[perm].reshape(n, B // n, *x.shape[1:]), data)

    epochs = jax.vmap(shuffle)(jax.random.split(rng, rl_cfg.ppo_epochs))
    return _rows_split(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), epochs))


def _rows_split(tree):
    """Axis 1 (rows) of every [N, rows, ...] leaf split over the mesh's batch axes: the
    shuffle's gather and the micro-batch cut would otherwise leave every device with every row."""
    return constrain_rows(tree, axis=1)


def _step_metrics(update_metrics, rewards_B, batch, targets: Targets, cfg: StepConfig) -> dict:
    mask_BT = batch.response_mask_BT
    metrics = {k: jnp.mean(v) for k, v in update_metrics.items()}
    metrics["reward_mean"] = jnp.mean(rewards_B)
    if cfg.rl.kl_in_reward > 0.0:
        metrics["reward_with_kl_mean"] = jnp.mean(targets.rewards_B)
    if targets.returns_BT is not None:
        metrics["return_mean"] = masked_mean(targets.returns_BT, mask_BT)
    metrics["advantage_abs_mean"] = masked_mean(jnp.abs(targets.advantages_BT), mask_BT)
    return metrics


def train_step(
    state: TrainState,
    batch: RolloutBatch,
    rewards_B: jax.Array,
    cfg: StepConfig,
    optimizer: optax.GradientTransformation,
) -> tuple[TrainState, dict]:
    """``(state', metrics)``: the update of one RL step (steps 5-7), no host syncs."""
    check_state(state, cfg.rl)
    # DAPO (eq. 13): the length penalty joins the rewards; overlong filtering drops truncated rows.
    shaped_B, keep_BT, dapo_metrics = shape_rewards(
        batch, rewards_B, cfg.rl.dapo, cfg.rollout.max_new_tokens, cfg.rollout.stop_token_ids
    )
    batch = dataclasses.replace(batch, keep_BT=keep_BT)
    targets = compute_targets(batch, shaped_B, cfg.rl)
    # Stream 1 of step t shuffles the minibatches (stream 0 samples the rollout).
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 1)
    carry = UpdateCarry(Trainable.of(state), state.opt_state, state.nonfinite_skips)
    carry, update_metrics = jax.lax.scan(
        lambda c, mb: update_minibatch(c, mb, cfg, optimizer, state.kv_scales),
        carry,
        minibatches(batch, targets, cfg.rl, rng),
    )
    metrics = {**_step_metrics(update_metrics, rewards_B, batch, targets, cfg), **dapo_metrics}
    kv_scales = state.kv_scales
    if cfg.rollout.static_kv_scales:  # DESIGN §4.5: the scales the next rollout uses, logged
        kv_scales = recalibrate_kv_scales(batch.qkv_amax, cfg.rollout, state.kv_scales)
        metrics.update(kv_scale_metrics(kv_scales))
    metrics["nonfinite_skips"] = carry.skips
    new_state = dataclasses.replace(
        state,
        params=carry.trainable.policy,
        opt_state=carry.opt_state,
        kv_scales=kv_scales,
        step=state.step + 1,
        nonfinite_skips=carry.skips,
        value_head=carry.trainable.value_head,
    )
    return new_state, metrics
