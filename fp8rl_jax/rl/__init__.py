"""fp8rl_jax.rl: rollout correction, advantages and losses (pure functions)."""

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

__all__ = [
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
