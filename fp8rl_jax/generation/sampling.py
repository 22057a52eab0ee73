"""Token sampling: temperature, top-k, top-p (nucleus) and min-p truncation.

The same ``process_logits`` runs in the rollout (``sample``) and in a scoring pass
(``token_logprobs``), so the trainer's BF16 log-probs and the rollout's FP8 log-probs are taken
under the same processed distribution and their ratio (rollout correction) compares like with like.

Log-prob convention: with ``temperature > 0`` the log-prob of a token is taken under the processed
distribution (after temperature and truncation, renormalized over the kept set). With
``temperature == 0`` (greedy) the token is the argmax of the logits and its log-prob is taken under
the *unprocessed* softmax ``log_softmax(logits)``: a point mass would give log-prob 0 everywhere,
which carries no information for importance ratios.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters; the defaults are plain ancestral sampling at temperature 1."""

    temperature: float = 1.0  # logits are divided by it; 0 means greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    top_p: float = 1.0  # keep the smallest set with probability mass >= top_p; 1 disables
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max; 0 disables

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingConfig: temperature must be >= 0, got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"SamplingConfig: top_k must be an int >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig: top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"SamplingConfig: min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _truncation_threshold(x_V: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Smallest logit kept by top-k and top-p (applied in that order); shape ``x.shape[:-1]+(1,)``.

    Ties at the threshold are kept, so with exactly tied logits the kept set may be a little larger
    than the minimal one.
    """
    v = x_V.shape[-1]
    sorted_V = -jnp.sort(-x_V, axis=-1)  # descending
    rank_V = jnp.arange(v)
    if cfg.top_k > 0:
        sorted_V = jnp.where(rank_V < min(cfg.top_k, v), sorted_V, -jnp.inf)
    if cfg.top_p < 1.0:
        p_V = jax.nn.softmax(sorted_V, axis=-1)
        mass_before_V = jnp.cumsum(p_V, axis=-1) - p_V
        # Token i (in sorted order) is kept iff the mass of the tokens ranked above it is < top_p:
        # the smallest prefix whose mass reaches top_p. The top token is always kept.
        keep_V = (mass_before_V < cfg.top_p) | (rank_V == 0)
        sorted_V = jnp.where(keep_V, sorted_V, -jnp.inf)
    return jnp.min(jnp.where(jnp.isfinite(sorted_V), sorted_V, jnp.inf), axis=-1, keepdims=True)


def process_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Log-probs ``log q(v)`` of the processed distribution over the last axis, in float32.

    ``q ∝ softmax(z / T)`` restricted to the tokens kept by top-k, then top-p (smallest set whose
    renormalized mass is >= p, Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration"), then min-p (``q(v) >= min_p · max_u q(u)``, Nguyen et al. 2024, "Turning Up
    the Heat: Min-p Sampling"); removed tokens get ``-inf``. With ``T == 0`` returns the
    unprocessed ``log_softmax(z)`` (see the module docstring).
    """
    x = logits.astype(jnp.float32)
    if cfg.greedy:
        return jax.nn.log_softmax(x, axis=-1)
    x = x / cfg.temperature
    if cfg.top_k > 0 or cfg.top_p < 1.0:
        x = jnp.where(x >= _truncation_threshold(x, cfg), x, -jnp.inf)
    logq = jax.nn.log_softmax(x, axis=-1)
    if cfg.min_p > 0.0:
        cutoff = jnp.max(logq, axis=-1, keepdims=True) + jnp.log(cfg.min_p)
        logq = jax.nn.log_softmax(jnp.where(logq >= cutoff, logq, -jnp.inf), axis=-1)
    return logq


def row_keys(rng: jax.Array, n: int) -> jax.Array:
    """One independent key per row: ``fold_in(rng, row)``, so a row's draws do not depend on B."""
    return jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(n, dtype=jnp.uint32))


def sample(
    rng: jax.Array, logits_BV: jax.Array, cfg: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row; returns ``(tokens_B int32, logp_B float32)``.

    ``logp_B`` is the token's log-prob under ``process_logits`` (unprocessed softmax when greedy).
    Row b uses the key ``fold_in(rng, b)``.
    """
    return sample_with_keys(row_keys(rng, logits_BV.shape[0]), logits_BV, cfg)


def token_keys(rng: jax.Array, token_B: jax.Array, row_B: jax.Array) -> jax.Array:
    """``fold_in(fold_in(rng, token), row)`` per row: the key of token index ``token_B[b]`` of
    request ``row_B[b]``, the key ``sample`` gives row b at decode step ``token``."""
    step = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, token_B.astype(jnp.uint32))
    return jax.vmap(jax.random.fold_in)(step, row_B.astype(jnp.uint32))


def sample_with_keys(
    keys_B: jax.Array, logits_BV: jax.Array, cfg: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """``sample`` with one given key per row (unused when greedy)."""
    logq_BV = process_logits(logits_BV, cfg)
    if cfg.greedy:
        tokens_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    else:
        tokens_B = jax.vmap(jax.random.categorical)(keys_B, logq_BV).astype(jnp.int32)
    logp_B = jnp.take_along_axis(logq_BV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, logp_B


def token_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """``log q(tokens_BT[b, t])`` under ``process_logits(logits_BTV[b, t])`` (float32 [B, T]).

    ``logits_BTV[:, t]`` must be the logits that predicted ``tokens_BT[:, t]`` (callers shift).
    A token outside the truncated support gets ``-inf``.
    """
    logq_BTV = process_logits(logits_BTV, cfg)
    return jnp.take_along_axis(logq_BTV, tokens_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]
