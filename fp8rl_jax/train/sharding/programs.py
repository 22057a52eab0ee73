"""The programs on a mesh: the ``rl.ProgramShardings`` that ``rl.build_programs`` jits them with.

The rollout program takes the train state as training shards it (FSDP + TP) and the prompts
split over the batch axes; it pins the FP8 weights to the rollout layout right after
quantization (so XLA gathers them once per step, not once per token) and returns a
``RolloutBatch`` split over the batch axes. The train program takes that batch and the rewards
and returns the state in the shardings it came in with and replicated metrics. Greedy eval
takes the params and KV scales as trained and the held-out prompts split over rows; DAPO's
generation batches, when their row count differs, get the step's shardings at their row count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.generation import Prompts, RolloutConfig
from fp8rl_jax.models import ModelConfig
from fp8rl_jax.rl import ProgramShardings, RLConfig, StepShardings, TrainState, rollout_fn
from fp8rl_jax.train.sharding.specs import (
    batch_shardings,
    replicated,
    rollout_params_constraint,
    train_state_shardings,
)


def abstract_prompts(n_rows: int, prompt_len: int) -> Prompts:
    """``ShapeDtypeStruct`` prompts of a batch of ``n_rows`` left-padded to ``prompt_len``."""
    return Prompts(
        jax.ShapeDtypeStruct((n_rows, prompt_len), jnp.int32),
        jax.ShapeDtypeStruct((n_rows,), jnp.int32),
    )


def rows_sharding(n_rows: int, mesh):
    """The sharding of a per-row vector (rewards_B, eval tokens) of ``n_rows``."""
    return batch_shardings(jax.ShapeDtypeStruct((n_rows,), jnp.float32), mesh)


def step_shardings(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    mesh,
    state: TrainState,
    prompts: Prompts,
) -> StepShardings:
    """Shardings of both RL programs for ``state`` and ``prompts`` (concrete or abstract)."""
    abstract_batch = jax.eval_shape(rollout_fn(model_cfg, rollout_cfg, rl_cfg), state, prompts)
    return StepShardings(
        state=train_state_shardings(state, model_cfg, mesh),
        prompts=batch_shardings(prompts, mesh),
        batch=batch_shardings(abstract_batch, mesh),
        rewards=rows_sharding(prompts.tokens_BP.shape[0], mesh),
        metrics=replicated(mesh),
        pin_rollout_params=rollout_params_constraint(model_cfg, mesh),
    )


def program_shardings(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    mesh,
    state: TrainState,
    prompt_len: int,
    rows: tuple[int, int, int],
) -> ProgramShardings:
    """Shardings of every program; ``rows``: (step, DAPO generation, eval) batch row counts."""
    step_rows, gen_rows, eval_rows = rows

    def at(n_rows):
        prompts = abstract_prompts(n_rows, prompt_len)
        return step_shardings(model_cfg, rollout_cfg, rl_cfg, mesh, state, prompts)

    return ProgramShardings(
        step=at(step_rows),
        eval_prompts=batch_shardings(abstract_prompts(eval_rows, prompt_len), mesh),
        eval_tokens=rows_sharding(eval_rows, mesh),
        gen=None if gen_rows == step_rows else at(gen_rows),
    )
