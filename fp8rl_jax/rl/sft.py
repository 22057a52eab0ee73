"""The supervised warm-start update: next-token cross-entropy on demonstration completions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fp8rl_jax.generation import ComputeDtype, cast_floats
from fp8rl_jax.models import ModelConfig, forward
from fp8rl_jax.rl.losses import masked_mean


def sft_loss(params, tokens_BT, seg_BT, pos_BT, target_BT, *, model_cfg: ModelConfig,
             compute_dtype: ComputeDtype) -> jax.Array:  # fmt: skip
    """Mean NLL of the tokens ``target_BT`` marks, each predicted from the tokens before it."""
    out = forward(
        cast_floats(params, compute_dtype),
        tokens_BT,
        model_cfg,
        positions_BT=pos_BT,
        segment_ids_BT=seg_BT,
    )
    logp_BTV = jax.nn.log_softmax(out.logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0]
    return masked_mean(nll_BT, target_BT[:, 1:])


def sft_step(params, opt_state, tokens_BT, seg_BT, pos_BT, target_BT, *, model_cfg: ModelConfig,
             compute_dtype: ComputeDtype, optimizer: optax.GradientTransformation):  # fmt: skip
    """One optax update on ``sft_loss``: ``(params', opt_state', loss)``."""
    loss, grads = jax.value_and_grad(sft_loss)(
        params, tokens_BT, seg_BT, pos_BT, target_BT, model_cfg=model_cfg,
        compute_dtype=compute_dtype,
    )  # fmt: skip
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
