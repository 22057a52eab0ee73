"""Supervised warm start on task demonstrations, so that RL begins from a non-zero reward."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fp8rl_jax.fields import check_choices
from fp8rl_jax.generation import ComputeDtype, cast_floats
from fp8rl_jax.models import ModelConfig, forward
from fp8rl_jax.rl import masked_mean
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
    """``(optimizer, step(params, opt_state, tokens, seg, pos, target) -> (p, o, loss))``."""
    optimizer = make_optimizer(cfg.optim)

    def loss_fn(params, tokens_BT, seg_BT, pos_BT, target_BT):
        out = forward(
            cast_floats(params, cfg.compute_dtype),
            tokens_BT,
            model_cfg,
            positions_BT=pos_BT,
            segment_ids_BT=seg_BT,
        )
        logp_BTV = jax.nn.log_softmax(out.logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
        nll_BT = -jnp.take_along_axis(logp_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0]
        return masked_mean(nll_BT, target_BT[:, 1:])

    @jax.jit
    def step(params, opt_state, tokens_BT, seg_BT, pos_BT, target_BT):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BT, seg_BT, pos_BT, target_BT)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return optimizer, step


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
