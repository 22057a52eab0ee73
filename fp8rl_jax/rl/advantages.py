"""Advantage estimators: GRPO / Dr.GRPO group normalization, RLOO, and GAE for PPO with a critic.

Outcome rewards ``rewards_B`` hold G consecutive responses per prompt (``B = Q * G``, Q prompts);
advantages are broadcast to the response tokens of ``mask_BT`` and are 0 elsewhere.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8rl_jax.rl.losses import masked_mean


def _grouped(rewards_B, group_size: int):
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2, got {group_size}")
    if rewards_B.shape[0] % group_size:
        raise ValueError(
            f"batch size {rewards_B.shape[0]} is not a multiple of group_size {group_size}"
        )
    return rewards_B.astype(jnp.float32).reshape(-1, group_size)


def _to_tokens(adv_B, mask_BT):
    return adv_B[:, None] * mask_BT.astype(jnp.float32)


def grpo_advantages(rewards_B, mask_BT, group_size: int, scale_by_std: bool = True, eps=1e-6):
    """Group-relative advantage of each response, broadcast to its tokens.

    GRPO:     A_i = (r_i − mean_g r) / (std_g r + ε)      (std with Bessel's correction, as veRL)
    Dr.GRPO:  A_i =  r_i − mean_g r                        (``scale_by_std=False``)

    References: DeepSeekMath, arXiv 2402.03300 (GRPO); Dr.GRPO, arXiv 2503.20783 (no std scaling).
    """
    rewards_QG = _grouped(rewards_B, group_size)
    centered_QG = rewards_QG - jnp.mean(rewards_QG, axis=-1, keepdims=True)
    if scale_by_std:
        centered_QG = centered_QG / (jnp.std(rewards_QG, axis=-1, ddof=1, keepdims=True) + eps)
    return _to_tokens(centered_QG.reshape(-1), mask_BT)


def rloo_advantages(rewards_B, mask_BT, group_size: int):
    """REINFORCE leave-one-out: A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j = G/(G−1) · (r_i − mean_g r).

    Reference: Ahmadian et al., arXiv 2402.14740 (RLOO); Kool et al. 2019.
    """
    rewards_QG = _grouped(rewards_B, group_size)
    loo_mean_QG = (jnp.sum(rewards_QG, axis=-1, keepdims=True) - rewards_QG) / (group_size - 1)
    return _to_tokens((rewards_QG - loo_mean_QG).reshape(-1), mask_BT)


class _GaeCarry(NamedTuple):
    next_value_B: jax.Array  # V(s_{t+1}) of the next valid token (0 past the end)
    next_adv_B: jax.Array  # Â_{t+1} of the next valid token


def gae(rewards_BT, values_BT, mask_BT, gamma: float = 1.0, lam: float = 1.0):
    """Generalized advantage estimation by a reverse ``lax.scan`` over T; returns (Â_BT, R_BT).

    δ_t = r_t + γ V_{t+1} − V_t,     Â_t = δ_t + γ λ Â_{t+1},     R_t = Â_t + V_t
    where t+1 is the next *valid* token: masked positions pass the carry through unchanged
    (veRL ``compute_gae_advantage_return``), and past the last token V = Â = 0. Outputs are 0
    outside the mask. Reference: Schulman et al., arXiv 1506.02438 (GAE).
    """
    f32 = jnp.float32
    rewards_TB, values_TB, mask_TB = (x.astype(f32).T for x in (rewards_BT, values_BT, mask_BT))

    def step(carry: _GaeCarry, xs):
        reward_B, value_B, m_B = xs
        delta_B = reward_B + gamma * carry.next_value_B - value_B
        adv_B = delta_B + gamma * lam * carry.next_adv_B
        new = _GaeCarry(
            next_value_B=jnp.where(m_B > 0, value_B, carry.next_value_B),
            next_adv_B=jnp.where(m_B > 0, adv_B, carry.next_adv_B),
        )
        return new, adv_B * m_B

    zeros_B = jnp.zeros(rewards_TB.shape[1], f32)
    _, adv_TB = jax.lax.scan(
        step, _GaeCarry(zeros_B, zeros_B), (rewards_TB, values_TB, mask_TB), reverse=True
    )
    mask_BT = mask_TB.T
    advantages_BT = adv_TB.T
    return advantages_BT, (advantages_BT + values_TB.T) * mask_BT


def masked_whiten(x_BT, mask_BT, shift_mean: bool = True, eps=1e-8):
    """(x − mean) / sqrt(var + ε) over valid tokens (population variance); 0 outside the mask."""
    mean = masked_mean(x_BT, mask_BT)
    var = masked_mean(jnp.square(x_BT - mean), mask_BT)
    white_BT = (x_BT - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        white_BT = white_BT + mean
    return white_BT * mask_BT.astype(x_BT.dtype)
