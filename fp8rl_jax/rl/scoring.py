"""High-precision scoring of token sequences: the log-probs and statistics the RL step needs."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8rl_jax.generation import SamplingConfig
from fp8rl_jax.models import QKVAmax, forward, lm_head
from fp8rl_jax.rl.chunked import token_stats
from fp8rl_jax.rl.losses import entropy_from_logits
from kernels_pallas.backend import DEFAULT_KERNELS, KernelImpls


class Scores(NamedTuple):
    """What a scoring forward returns; optional parts are None unless asked for."""

    logp_BT: jax.Array  # f32 log q(tokens[b, t] | tokens[b, :t]); 0 at t = 0
    entropy_BT: jax.Array | None  # f32 H_t of the policy that sampled token t; 0 at t = 0
    qkv_amax: QKVAmax | None  # per-layer Q/K/V amax over the valid tokens (with_amax)
    hidden_BTD: jax.Array | None  # final-norm hidden states (with_hidden)
    aux_loss: jax.Array  # MoE load-balancing loss (0 for dense; mean over micro-batches)


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
    with_entropy=False,
    expert_ids_BTLK=None,
    logprob_chunk=0,
    micro_batch=0,
    remat="none",
    kv_quant=None,
    kernels: KernelImpls = DEFAULT_KERNELS,
) -> Scores:
    """``logp[b, t] = log q(tokens[b, t] | tokens[b, :t])`` under ``sampling``'s processing.

    Position 0 has no prediction and gets 0. Also returns the entropy ``H_t``
    (``with_entropy``, ``policy_entropy``), the Q/K/V amax (``with_amax``), the final-norm hidden
    states (``with_hidden``) and the router aux loss. ``expert_ids_BTLK``: MoE routing replay
    (the rollout's experts, ``models.forward``). Memory knobs, none of which changes a value:
    ``logprob_chunk`` tokens of logits at a time (``chunked.token_stats``; 0: all T at once),
    ``micro_batch`` rows per forward (0: all rows; must divide B), ``remat`` the per-block
    ``jax.checkpoint`` policy (``models.remat``) for a pass that is differentiated.
    ``kv_quant``: FP8 K/V rounding of ``rl.train_precision="fp8_rollout"`` (``rl.precision``).
    ``kernels``: the kernel choices of the forward (``rl.expert_matmul_impl``: the BF16 experts).
    """
    one = functools.partial(
        _score_rows,
        model_cfg=model_cfg,
        sampling=sampling,
        with_amax=with_amax,
        with_hidden=with_hidden,
        with_entropy=with_entropy,
        logprob_chunk=logprob_chunk,
        remat=remat,
        kv_quant=kv_quant,
        kernels=kernels,
    )
    rows = (tokens_BT, positions_BT, segment_ids_BT, expert_ids_BTLK)
    B = tokens_BT.shape[0]
    if micro_batch <= 0 or micro_batch >= B:
        return one(params, *rows)
    if B % micro_batch:
        raise ValueError(
            f"sequence_logprobs: micro_batch={micro_batch} (rl.score_micro_batch) must divide "
            f"the {B} rows"
        )
    n = B // micro_batch
    # Micro-batch i holds rows i, i + n, i + 2n, ...: rows split in contiguous blocks over the
    # devices of a mesh stay split over all of them in every micro-batch.
    split = jax.tree.map(
        lambda x: jnp.swapaxes(x.reshape(micro_batch, n, *x.shape[1:]), 0, 1), rows
    )
    out = jax.lax.map(lambda r: one(params, *r), split)

    def merge(x):
        return None if x is None else jnp.swapaxes(x, 0, 1).reshape(B, *x.shape[2:])

    amax = None if out.qkv_amax is None else jax.tree.map(lambda a: jnp.max(a, 0), out.qkv_amax)
    return Scores(
        logp_BT=merge(out.logp_BT),
        entropy_BT=merge(out.entropy_BT),
        qkv_amax=amax,
        hidden_BTD=merge(out.hidden_BTD),
        aux_loss=jnp.mean(out.aux_loss),
    )


def _score_rows(
    params, tokens_BT, positions_BT, segment_ids_BT, expert_ids_BTLK, *, model_cfg, sampling,
    with_amax, with_hidden, with_entropy, logprob_chunk, remat, kv_quant=None,
    kernels: KernelImpls = DEFAULT_KERNELS,
) -> Scores:  # fmt: skip
    """``sequence_logprobs`` of one micro-batch of rows."""
    out = forward(
        params,
        tokens_BT,
        model_cfg,
        positions_BT=positions_BT,
        segment_ids_BT=segment_ids_BT,
        return_qkv_amax=with_amax,
        return_hidden=True,
        return_logits=False,
        expert_ids_BTLK=expert_ids_BTLK,
        remat=remat,
        kv_quant=kv_quant,
        kernels=kernels,
    )
    stats = token_stats(
        lambda h_BCD: lm_head(params, h_BCD, model_cfg),
        out.hidden_BTD[:, :-1],
        tokens_BT[:, 1:],
        sampling,
        chunk=logprob_chunk,
        with_entropy=with_entropy,
    )

    def shift(x_BT):
        return None if x_BT is None else jnp.pad(x_BT, ((0, 0), (1, 0)))

    return Scores(
        logp_BT=shift(stats.logp_BT),
        entropy_BT=shift(stats.entropy_BT),
        qkv_amax=out.qkv_amax,
        hidden_BTD=out.hidden_BTD if with_hidden else None,
        aux_loss=out.aux_loss,
    )


def policy_entropy(logits_BTV, sampling: SamplingConfig):
    """Entropy ``H_t`` of the policy that sampled token t (temperature-scaled, untruncated)."""
    z_BTV = logits_BTV[:, :-1] if sampling.greedy else logits_BTV[:, :-1] / sampling.temperature
    return jnp.pad(entropy_from_logits(z_BTV), ((0, 0), (1, 0)))
