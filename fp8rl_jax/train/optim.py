"""The optimizer shared by RL and SFT: clip by global norm, AdamW, warmup + constant/cosine."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

import jax.numpy as jnp
import optax

from fp8rl_jax.fields import check_choices

Schedule = Literal["constant", "cosine"]
SCHEDULES = typing.get_args(Schedule)
MomentDtype = Literal["float32", "bfloat16"]
MOMENT_DTYPES = typing.get_args(MomentDtype)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping (the paper's recipe: lr 1e-6, wd 0.1, clip 1.0)."""

    lr: float = 1e-6  # peak learning rate
    weight_decay: float = 0.1  # decoupled (AdamW) weight decay
    grad_clip: float = 1.0  # clip by global norm; 0 disables
    b1: float = 0.9  # Adam beta1
    b2: float = 0.999  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    warmup_steps: int = 0  # linear warmup from 0 (optimizer updates)
    schedule: Schedule = "constant"  # after warmup: constant | cosine
    decay_steps: int = 0  # cosine: updates until lr reaches end_lr_frac * lr
    end_lr_frac: float = 0.0  # cosine: final lr as a fraction of lr
    # Adam's first moment (mu) stored in this dtype, its math in f32: "bfloat16" halves mu's bytes
    # (2 B/param: Qwen3-30B-A3B's 7.1 GiB per GPU on 8). The second moment stays f32: with
    # b2 = 0.999 each step changes nu by 0.1%, under BF16's half-ulp (0.2%), so a BF16 nu would
    # stop decaying (DeepSeek-V3 keeps both in BF16 at b2 = 0.95, arXiv 2412.19437 §3.3.2).
    mu_dtype: MomentDtype = "float32"

    def __post_init__(self):
        check_choices(self)
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"OptimConfig.lr must be finite and > 0, got {self.lr}")
        if self.grad_clip < 0 or self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("OptimConfig.grad_clip, warmup_steps and weight_decay must be >= 0")
        if self.schedule == "cosine" and self.decay_steps <= 0:
            raise ValueError("OptimConfig.decay_steps must be > 0 with schedule='cosine'")


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, cfg.decay_steps, alpha=cfg.end_lr_frac)
    else:
        after = optax.constant_schedule(cfg.lr)
    if cfg.warmup_steps == 0:
        return after
    warm = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` then AdamW with the configured schedule (``mu`` in
    ``cfg.mu_dtype``; float32 leaves optax's default, the params' dtype)."""
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    parts.append(
        optax.adamw(
            learning_rate_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mu_dtype=None if cfg.mu_dtype == "float32" else jnp.dtype(cfg.mu_dtype),
        )
    )
    return optax.chain(*parts)
