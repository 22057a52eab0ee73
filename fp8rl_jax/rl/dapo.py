"""DAPO's data-side recipe: overlong reward shaping, truncation masking, dynamic-sampling pieces.

DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476) adds to GRPO: clip-higher (``LossConfig.clip_high``), token-mean loss,
*overlong reward shaping* (a length penalty over the last ``L_cache`` tokens of the budget, eq.
13) with *overlong filtering* (truncated responses leave the loss), and *dynamic sampling* (groups
whose rewards are all equal carry no GRPO signal: drop them and sample more prompts until the
batch is full). The shaping runs inside the train program (``shape_rewards``); the sampling loop
runs on the host (``train.dynamic_sampling``) and assembles a fixed-size batch with
``select_rows``, so the train program always sees the same shapes and compiles once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.fields import is_batched


@dataclasses.dataclass(frozen=True)
class DAPOConfig:
    """DAPO's dynamic sampling and overlong shaping; all off by default (plain GRPO)."""

    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, sample more
    max_num_gen_batches: int = 10  # cap on generation batches per step (then: mask the rest)
    gen_prompts: int = 0  # prompts per generation batch (veRL gen_batch_size); 0 = train batch's
    overlong_buffer: int = 0  # L_cache (tokens): length-penalty window before the budget; 0 = off
    overlong_penalty_factor: float = 1.0  # scale of the eq. 13 penalty (veRL's penalty_factor)
    mask_truncated: bool = False  # overlong filtering: responses cut at the budget leave the loss

    def __post_init__(self):
        if self.max_num_gen_batches < 1:
            raise ValueError(
                f"DAPOConfig.max_num_gen_batches must be >= 1, got {self.max_num_gen_batches}"
            )
        if self.gen_prompts < 0:
            raise ValueError(f"DAPOConfig.gen_prompts must be >= 0, got {self.gen_prompts}")
        if self.overlong_buffer < 0:
            raise ValueError(f"DAPOConfig.overlong_buffer must be >= 0, got {self.overlong_buffer}")
        if self.overlong_penalty_factor < 0.0:
            raise ValueError(
                "DAPOConfig.overlong_penalty_factor must be >= 0, "
                f"got {self.overlong_penalty_factor}"
            )


def overlong_penalty(response_lens_B, max_len: int, buffer_len: int, factor: float = 1.0):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), times ``factor``.

    With ``L_max = max_len`` and ``L_cache = buffer_len``:
        R(y) = 0                               if |y| <= L_max − L_cache
             = ((L_max − L_cache) − |y|)/L_cache  if L_max − L_cache < |y| <= L_max
             = −1                              if |y| > L_max
    ``buffer_len = 0`` turns it off (all zeros). Returns float32 [B], <= 0.
    """
    lens_B = jnp.asarray(response_lens_B, jnp.float32)
    if buffer_len <= 0:
        return jnp.zeros_like(lens_B)
    if buffer_len > max_len:
        raise ValueError(f"overlong_penalty: buffer_len {buffer_len} exceeds max_len {max_len}")
    expected = float(max_len - buffer_len)
    penalty_B = jnp.clip((expected - lens_B) / float(buffer_len), -1.0, 0.0)
    return factor * penalty_B


def truncated_rows(tokens_BT, response_mask_BT, max_new_tokens: int, stop_ids: Sequence[int]):
    """bool [B]: the response used its whole budget without ending on a stop token.

    The last response slot is the last column of a rollout (T = P + A), so a row is truncated
    iff its response length is A and that column holds no stop token.
    """
    lens_B = jnp.sum(response_mask_BT > 0, axis=1)
    last_B = tokens_BT[:, -1]
    full_B = lens_B >= max_new_tokens
    if not stop_ids:
        return full_B
    return full_B & ~jnp.isin(last_B, jnp.asarray(tuple(stop_ids), jnp.int32))


def shape_rewards(batch, rewards_B, cfg: DAPOConfig, max_new_tokens: int, stop_ids):
    """``(rewards_B + penalty_B, keep_BT, metrics)``: eq. 13 and (optionally) overlong filtering.

    ``keep_BT`` is the batch's keep mask with truncated rows zeroed when ``mask_truncated``.
    Metrics: ``truncated_frac`` (rows cut at the budget) and ``overlong_penalty_mean``.
    """
    lens_B = jnp.sum(batch.response_mask_BT > 0, axis=1)
    penalty_B = overlong_penalty(
        lens_B, max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty_factor
    )
    truncated_B = truncated_rows(batch.tokens_BT, batch.response_mask_BT, max_new_tokens, stop_ids)
    keep_BT = batch.keep_BT
    if cfg.mask_truncated:
        keep_BT = keep_BT * (~truncated_B).astype(keep_BT.dtype)[:, None]
    metrics = {
        "truncated_frac": jnp.mean(truncated_B.astype(jnp.float32)),
        "overlong_penalty_mean": jnp.mean(penalty_B),
    }
    return rewards_B + penalty_B, keep_BT, metrics


def informative_groups(rewards_B: np.ndarray, group_size: int, atol: float = 1e-6) -> np.ndarray:
    """bool [Q]: the groups whose rewards are not all equal (DAPO's dynamic-sampling filter)."""
    r_QG = np.asarray(rewards_B, np.float64).reshape(-1, group_size)
    return np.ptp(r_QG, axis=1) > atol


def select_rows(buffer, new, take_B, valid_B):
    """A [B]-row batch: slot b holds ``new``'s row ``take_B[b]`` if it is >= 0, else ``buffer``'s.

    ``buffer``: a ``RolloutBatch`` of B rows, or None (then every ``take_B`` must be >= 0);
    ``new``: a ``RolloutBatch`` of any number of rows (a generation batch may be larger than the
    train batch); ``take_B`` int32 [B]; ``valid_B`` float32 [B]: 0 on slots left unfilled (their
    ``keep_BT`` is zeroed, so they leave the loss). Per-row (``batched()``) fields are gathered;
    ``qkv_amax`` is the elementwise max of both (the next KV scales cover every rollout of the
    step); ``metrics`` are ``buffer``'s (``new``'s without one). Jitted by the caller; all shapes
    are static.
    """
    use_B = take_B >= 0
    src_B = jnp.maximum(take_B, 0)
    base = new if buffer is None else buffer

    def pick(b, n):
        if buffer is None:
            return n[src_B]
        return jnp.where(use_B.reshape((-1,) + (1,) * (b.ndim - 1)), n[src_B], b)

    fields = {}
    for f in dataclasses.fields(base):
        b, n = getattr(base, f.name), getattr(new, f.name)
        if b is None or not (is_batched(base, f.name) or f.name == "qkv_amax"):
            continue
        if is_batched(base, f.name):
            fields[f.name] = pick(b, n)
        elif buffer is not None:
            fields[f.name] = jax.tree.map(jnp.maximum, b, n)
    keep_BT = fields["keep_BT"] * valid_B.astype(fields["keep_BT"].dtype)[:, None]
    return dataclasses.replace(base, **{**fields, "keep_BT": keep_BT})
