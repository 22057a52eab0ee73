"""Value head on the policy trunk and the token-level rewards of PPO (GAE, KL-in-reward).

Position convention (as ``logp_BT``): entry ``t`` of a [B, T] array belongs to the action
``tokens[b, t]``, taken in the state ``tokens[b, :t]``. So ``V_t`` is read from the hidden state
at ``t - 1`` and position 0 (no state before it) gets 0.
"""

from __future__ import annotations

import jax.numpy as jnp

from fp8rl_jax.rl.losses import kl_penalty


def init_value_head(d_model: int) -> dict:
    """Zero-initialized linear value head {"w": [D, 1], "b": [1]} in FP32 (V = 0 at step 0)."""
    return {"w": jnp.zeros((d_model, 1), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}


def token_values(value_head: dict, hidden_BTD):
    """``V_t = h_{t-1} · w + b`` in FP32 from the final-norm hidden states; ``V_0 = 0``."""
    v_BT = jnp.einsum("btd,do->bto", hidden_BTD.astype(jnp.float32), value_head["w"])[..., 0]
    v_BT = v_BT + value_head["b"][0]
    return jnp.pad(v_BT[:, :-1], ((0, 0), (1, 0)))


def terminal_rewards(rewards_B, mask_BT):
    """Sparse per-token rewards: ``rewards_B[b]`` at the last response token of row b, else 0."""
    m_BT = mask_BT > 0
    T = mask_BT.shape[1]
    last_B = T - 1 - jnp.argmax(m_BT[:, ::-1], axis=1)
    at_last_BT = (jnp.arange(T)[None, :] == last_B[:, None]) & m_BT
    return jnp.where(at_last_BT, rewards_B.astype(jnp.float32)[:, None], 0.0)


def kl_reward_penalty(logp_BT, logp_ref_BT, mask_BT, beta: float, kind: str = "k3"):
    """Per-token KL reward penalty ``−β · kl_t`` on the response tokens, 0 elsewhere.

    kl_t = kl_penalty(lp_old, lp_ref, kind) (k1/k2/k3; veRL ``use_kl_in_reward``). With sequence
    rewards (GRPO, RLOO) the train step adds its sum over the response to ``rewards_B``, as veRL's
    outcome advantages sum the token-level rewards; with GAE it is added token by token.
    Reference: Ziegler et al., arXiv 1909.08593 (KL-penalized reward); Ouyang et al. 2022.
    """
    kl_BT = kl_penalty(logp_BT, logp_ref_BT, kind)
    return jnp.where(mask_BT > 0, -beta * kl_BT, 0.0)
