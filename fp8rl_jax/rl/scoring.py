"""High-precision scoring of token sequences: the log-probs and statistics the RL step needs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.generation import SamplingConfig, token_logprobs
from fp8rl_jax.models import forward
from fp8rl_jax.rl.losses import entropy_from_logits


def rollout_segment_ids(ro) -> jax.Array:
    """1 on real tokens (the prompt without its left padding, and the response), else 0."""
    T = ro.tokens_BT.shape[1]
    t_T = jnp.arange(T)[None, :]
    start_B1 = (ro.prompt_len - ro.prompt_lens_B)[:, None]
    end_B1 = (ro.prompt_len + ro.response_lens_B)[:, None]
    return ((t_T >= start_B1) & (t_T < end_B1)).astype(jnp.int32)


def sequence_logprobs(
    params,
    tokens_BT,
    positions_BT,
    segment_ids_BT,
    model_cfg,
    sampling,
    *,
    with_amax=False,
    with_hidden=False,
    expert_ids_BTLK=None,
    kv_quant=None,
):
    """``logp[b, t] = log q(tokens[b, t] | tokens[b, :t])`` under ``sampling``'s processing.

    Position 0 has no prediction and gets 0. Also returns the forward outputs (logits, Q/K/V amax
    when ``with_amax``, final-norm hidden states when ``with_hidden``, router aux loss).
    ``expert_ids_BTLK``: MoE routing replay (the rollout's experts, ``models.forward``).
    ``kv_quant``: FP8 K/V rounding of ``rl.train_precision="fp8_rollout"`` (``rl.precision``).
    """
    out = forward(
        params,
        tokens_BT,
        model_cfg,
        positions_BT=positions_BT,
        segment_ids_BT=segment_ids_BT,
        return_qkv_amax=with_amax,
        return_hidden=with_hidden,
        expert_ids_BTLK=expert_ids_BTLK,
        kv_quant=kv_quant,
    )
    logp = token_logprobs(out.logits_BTV[:, :-1], tokens_BT[:, 1:], sampling)
    logp_BT = jnp.pad(logp, ((0, 0), (1, 0)))
    return logp_BT, out


def policy_entropy(logits_BTV, sampling: SamplingConfig):
    """Entropy ``H_t`` of the policy that sampled token t (temperature-scaled, untruncated)."""
    z_BTV = logits_BTV[:, :-1] if sampling.greedy else logits_BTV[:, :-1] / sampling.temperature
    return jnp.pad(entropy_from_logits(z_BTV), ((0, 0), (1, 0)))
