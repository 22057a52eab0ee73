"""fp8rl_jax.rl: rollout correction, advantages, losses, and the jitted RL step programs."""

from fp8rl_jax.rl.advantages import gae, grpo_advantages, masked_whiten, rloo_advantages
from fp8rl_jax.rl.correction import RolloutCorrectionConfig, mismatch_metrics, rollout_correction
from fp8rl_jax.rl.losses import (
    LossConfig,
    aggregate_loss,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    kl_penalty,
    masked_mean,
    policy_loss,
    value_loss,
)
from fp8rl_jax.rl.state import RLConfig, RolloutBatch, RolloutConfig, TrainState, init_train_state
from fp8rl_jax.rl.step import make_fused_step, make_rollout_step, make_train_step

__all__ = [
    "RLConfig",
    "RolloutBatch",
    "RolloutConfig",
    "TrainState",
    "init_train_state",
    "make_fused_step",
    "make_rollout_step",
    "make_train_step",
    "LossConfig",
    "RolloutCorrectionConfig",
    "aggregate_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_whiten",
    "mismatch_metrics",
    "policy_loss",
    "rloo_advantages",
    "rollout_correction",
    "value_loss",
]
