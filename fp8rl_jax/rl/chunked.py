"""Token log-probs and entropies from hidden states, a chunk of tokens at a time.

``logits = head(h)`` over a whole batch is ``[B, T, V]`` f32: at T = 9,216 and V = 151,936 that
is 5.6 GB per row. ``token_stats`` computes the same per-token statistics with at most
``[B, chunk, V]`` logits alive, in the forward and the backward pass: a ``lax.scan`` over chunks
of ``chunk`` tokens whose body is under ``jax.checkpoint``, so the backward pass recomputes a
chunk's logits from its hidden states (the fused "linear + cross-entropy" pattern, e.g. Liger
Kernel's FusedLinearCrossEntropy, Hsu et al. 2024, arXiv 2410.10989) and keeps only the
hidden states (``[B, T, D]``) between the passes.

``head_fn(h_BCD) -> logits_BCV`` (f32) is any lm head: ``models.lm_head`` of BF16 or
quantized weights, so every precision's forward can reuse this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8rl_jax.generation.sampling import SamplingConfig, token_logprobs
from fp8rl_jax.rl.losses import entropy_from_logits

HeadFn = Callable[[jax.Array], jax.Array]


class TokenStats(NamedTuple):
    """Per-token statistics of the policy's next-token distributions (f32 [B, T])."""

    logp_BT: jax.Array  # log q(target) under the sampling processing (``token_logprobs``)
    entropy_BT: jax.Array | None  # H of softmax(logits / temperature), untruncated


def logits_stats(logits_BTV, targets_BT, sampling: SamplingConfig, with_entropy: bool):
    """``TokenStats`` of full logits: ``token_logprobs`` and the temperature-scaled entropy.

    ``logits_BTV[:, t]`` predicts ``targets_BT[:, t]`` (callers shift). The entropy is that of
    the distribution before truncation: ``H(softmax(z / temperature))`` (``z`` when greedy).
    """
    logp_BT = token_logprobs(logits_BTV, targets_BT, sampling)
    entropy_BT = None
    if with_entropy:
        z_BTV = logits_BTV if sampling.greedy else logits_BTV / sampling.temperature
        entropy_BT = entropy_from_logits(z_BTV)
    return TokenStats(logp_BT, entropy_BT)


def token_stats(
    head_fn: HeadFn,
    h_BTD: jax.Array,
    targets_BT: jax.Array,
    sampling: SamplingConfig,
    *,
    chunk: int,
    with_entropy: bool = False,
) -> TokenStats:
    """``logits_stats(head_fn(h_BTD), targets_BT, ...)`` with at most ``[B, chunk, V]`` logits.

    ``chunk`` tokens per scan step (static; T is padded to a multiple of it, the padding's
    results dropped); ``chunk <= 0`` or ``>= T``: one step, the full logits. Gradients flow to
    ``h_BTD`` and to whatever ``head_fn`` closes over (the head weights).
    """
    B, T, D = h_BTD.shape
    if chunk <= 0 or chunk >= T:
        return logits_stats(head_fn(h_BTD), targets_BT, sampling, with_entropy)
    n = -(-T // chunk)
    pad = n * chunk - T
    h_BTD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
    targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    # Chunk-major [n, B, C, ...]: the scan runs over chunks, the rows keep their sharding.
    h_NBCD = jnp.moveaxis(h_BTD.reshape(B, n, chunk, D), 1, 0)
    targets_NBC = jnp.moveaxis(targets_BT.reshape(B, n, chunk), 1, 0)

    @jax.checkpoint  # the backward pass recomputes the chunk's logits instead of keeping them
    def body(h_BCD, t_BC):
        return logits_stats(head_fn(h_BCD), t_BC, sampling, with_entropy)

    _, stats_N = jax.lax.scan(lambda c, xs: (c, body(*xs)), None, (h_NBCD, targets_NBC))

    def unchunk(x_NBC):
        return None if x_NBC is None else jnp.moveaxis(x_NBC, 0, 1).reshape(B, n * chunk)[:, :T]

    return TokenStats(*(unchunk(x) for x in stats_N))
