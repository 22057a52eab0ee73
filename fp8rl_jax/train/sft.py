"""Supervised warm start on task demonstrations, so that RL begins from a non-zero reward."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax

from fp8rl_jax.fields import check_choices
from fp8rl_jax.generation import ComputeDtype, cast_floats
from fp8rl_jax.models import ModelConfig
from fp8rl_jax.rl import sft_program
from fp8rl_jax.tasks.batch import DemonstrationBatch
from fp8rl_jax.train.optim import OptimConfig, make_optimizer


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Cross-entropy on demonstrations (completion tokens only)."""

    steps: int = 0  # optimizer updates; 0 skips the warm start
    batch_size: int = 64  # demonstrations per update
    # A tiny model from scratch takes a large lr; b2 0.99 adapts the second moment faster.
    optim: OptimConfig = OptimConfig(lr=3e-3, weight_decay=0.0, b2=0.99, warmup_steps=20)
    compute_dtype: ComputeDtype = "float32"  # forward dtype during SFT

    def __post_init__(self):
        check_choices(self)
        if self.steps < 0 or self.batch_size < 1:
            raise ValueError("SFTConfig.steps must be >= 0 and batch_size >= 1")


def demo_sequences(batch: DemonstrationBatch):
    """Concatenates left-padded prompts and right-padded completions into one sequence.

    Returns ``tokens_BT, segment_ids_BT, positions_BT, target_mask_BT`` where ``target_mask``
    marks the tokens whose prediction is trained (the completion, EOS included).
    """
    tokens = np.concatenate([batch.prompt_tokens_BP, batch.completion_tokens_BT], axis=1)
    P = batch.prompt_tokens_BP.shape[1]
    prompt_valid = np.arange(P)[None, :] >= P - batch.prompt_lens_B[:, None]
    seg = np.concatenate([prompt_valid, batch.completion_mask_BT], axis=1).astype(np.int32)
    pos = np.maximum(np.cumsum(seg, axis=1) - 1, 0).astype(np.int32)
    target = np.concatenate([np.zeros_like(prompt_valid), batch.completion_mask_BT], axis=1)
    return tokens.astype(np.int32), seg, pos, target.astype(np.float32)


def make_sft_step(
    model_cfg: ModelConfig, cfg: SFTConfig
) -> tuple[optax.GradientTransformation, Callable]:
    """``(optimizer, step(params, opt_state, tokens, seg, pos, target) -> (p, o, loss))``; the
    step is ``rl.sft_program`` (``rl.sft_step`` jitted)."""
    optimizer = make_optimizer(cfg.optim)
    return optimizer, sft_program(model_cfg, cfg.compute_dtype, optimizer)


def sft_warm_start(params, model_cfg: ModelConfig, cfg: SFTConfig, make_batch, progress=None):
    """Runs ``cfg.steps`` SFT updates; ``make_batch(step) -> DemonstrationBatch``.

    Returns the trained FP32 params and the list of per-step losses.
    """
    params = cast_floats(params, jnp.float32)
    if cfg.steps == 0:
        return params, []
    optimizer, step = make_sft_step(model_cfg, cfg)
    opt_state = optimizer.init(params)
    losses = []
    for i in range(cfg.steps):
        arrays = demo_sequences(make_batch(i))
        params, opt_state, loss = step(params, opt_state, *arrays)
        losses.append(loss)
        if progress is not None:
            progress(i, loss)
    return params, [float(x) for x in losses]
