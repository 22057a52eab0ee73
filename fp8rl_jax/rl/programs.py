"""Every compiled program of a run, jitted here and only here (DESIGN.md §2, docs/SCALING.md §6).

``build_programs`` jits, from the model, rollout and RL configs, the optimizer and (on a mesh)
the ``ProgramShardings`` that ``train.placement`` returns, the programs the trainer and the
planner run: the rollout and train programs of a step (train state donated), greedy held-out
generation, DAPO's generation-batch rollout and row selection, the per-batch key fold and the
step-0 KV-scale calibration. ``jit_steps`` is the rollout and train pair alone,
``make_fused_step`` the whole step as one program (rewards that are JAX functions),
``calibrate_program`` the step-0 KV scales and ``sft_program`` the supervised warm-start
update. Without shardings each program runs where its inputs are (one device); with them its
inputs and outputs have those shardings, so the state keeps its layout from step to step and
nothing reshards or recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from fp8rl_jax.generation import (
    ComputeDtype,
    KVScales,
    PinParams,
    Prompts,
    RolloutConfig,
    SamplingConfig,
    calibrate_initial_kv_scales,
    rollout,
)
from fp8rl_jax.models import ModelConfig
from fp8rl_jax.rl.dapo import select_rows
from fp8rl_jax.rl.sft import sft_step
from fp8rl_jax.rl.state import RLConfig, RolloutBatch, StepConfig, TrainState
from fp8rl_jax.rl.step import rollout_fn, rollout_step, train_fn
from fp8rl_jax.rl.update import train_step


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """Where a step's rollout and train programs' inputs and outputs live on a mesh
    (``train.sharding.step_shardings`` builds it).

    Each field is a pytree of ``jax.sharding.Sharding`` shaped like the value it places.
    """

    state: TrainState  # the train state, in and out of both programs (kept between steps)
    prompts: Prompts  # the rollout's prompts
    batch: RolloutBatch  # the rollout's output, the train program's input
    rewards: Any  # rewards_B
    metrics: Any  # the train metrics (replicated: every process can read them)
    pin_rollout_params: PinParams | None = None  # the quantized weights' rollout layout


@dataclasses.dataclass(frozen=True)
class ProgramShardings:
    """Where every program of a run places its inputs and outputs on a mesh
    (``train.sharding.program_shardings`` builds it, ``train.placement.OnMesh`` returns it)."""

    step: StepShardings  # rollout + train; the row selection writes ``step.batch``
    eval_prompts: Prompts  # the held-out prompts, split over rows
    eval_tokens: Any  # eval tokens_BT, split over rows
    gen: StepShardings | None = None  # DAPO generation batches of another row count, else None


class Steps(NamedTuple):
    """The jitted rollout and train programs, each compiled once (at its first call)."""

    rollout: Callable[[TrainState, Prompts], RolloutBatch]
    train: Callable[[TrainState, RolloutBatch, jax.Array], tuple[TrainState, dict]]


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted programs of a run, each compiled at its first call (``build_programs``)."""

    rollout: Callable[[TrainState, Prompts], RolloutBatch]  # steps 1-4
    train: Callable[[TrainState, RolloutBatch, jax.Array], tuple[TrainState, dict]]  # 5-7, donated
    eval: Callable[[dict, Prompts, KVScales | None], jax.Array]  # greedy tokens_BT
    gen_rollout: Callable[[TrainState, Prompts], RolloutBatch]  # DAPO generation batches
    select_rows: Callable[..., RolloutBatch]  # ``rl.dapo.select_rows`` into the train batch
    fold_key: Callable[[jax.Array, Any], jax.Array]  # fold_in, placed like the state's key
    calibrate: Callable[[dict, Prompts], KVScales | None]  # step-0 static KV scales


def eval_fn(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, pin: PinParams | None = None):
    """Un-jitted ``eval_generate(params, prompts, kv_scales) -> tokens_BT``: greedy rollout."""
    greedy = SamplingConfig(temperature=0.0)

    def eval_generate(params, prompts, kv_scales):
        ro, _ = rollout(
            params, prompts, model_cfg, rollout_cfg, jax.random.key(0), kv_scales,
            sampling=greedy, pin=pin,
        )  # fmt: skip
        return ro.tokens_BT

    return eval_generate


def _jit_rollout(model_cfg, rollout_cfg, rl_cfg, s: StepShardings | None):
    if s is None:
        return jax.jit(rollout_fn(model_cfg, rollout_cfg, rl_cfg))
    ro = rollout_fn(model_cfg, rollout_cfg, rl_cfg, pin_rollout_params=s.pin_rollout_params)
    return jax.jit(ro, in_shardings=(s.state, s.prompts), out_shardings=s.batch)


def _jit_train(model_cfg, rollout_cfg, rl_cfg, optimizer, s: StepShardings | None):
    fn = train_fn(model_cfg, rollout_cfg, rl_cfg, optimizer)
    if s is None:
        return jax.jit(fn, donate_argnums=(0,))
    return jax.jit(
        fn,
        in_shardings=(s.state, s.batch, s.rewards),
        out_shardings=(s.state, s.metrics),
        donate_argnums=(0,),
    )


def jit_steps(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    optimizer: optax.GradientTransformation,
    *,
    shardings: StepShardings | None = None,
) -> Steps:
    """The rollout and train programs; the train state is donated.

    With ``shardings`` inputs and outputs have those shardings: the new state keeps the old
    one's, so the next step neither reshards nor recompiles, and the FP8 weights are pinned to
    their rollout layout.
    """
    return Steps(
        _jit_rollout(model_cfg, rollout_cfg, rl_cfg, shardings),
        _jit_train(model_cfg, rollout_cfg, rl_cfg, optimizer, shardings),
    )


def build_programs(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    optimizer: optax.GradientTransformation,
    shardings: ProgramShardings | None = None,
) -> Programs:
    """Every program of a run: on one device (``shardings=None``) or with a mesh's shardings."""
    s = shardings
    step = None if s is None else s.step
    rollout_p = _jit_rollout(model_cfg, rollout_cfg, rl_cfg, step)
    gen = rollout_p
    if s is not None and s.gen is not None:  # DAPO generation batches of another row count
        gen = _jit_rollout(model_cfg, rollout_cfg, rl_cfg, s.gen)
    if s is None:
        eval_p = jax.jit(eval_fn(model_cfg, rollout_cfg))
        select = jax.jit(select_rows)
        fold = jax.jit(jax.random.fold_in)
    else:
        pin = step.pin_rollout_params
        eval_in = (step.state.params, s.eval_prompts, step.state.kv_scales)
        eval_p = jax.jit(
            eval_fn(model_cfg, rollout_cfg, pin), in_shardings=eval_in, out_shardings=s.eval_tokens
        )
        select = jax.jit(select_rows, out_shardings=step.batch)  # the train program's layout
        fold = jax.jit(jax.random.fold_in, out_shardings=step.state.rng)
    return Programs(
        rollout=rollout_p,
        train=_jit_train(model_cfg, rollout_cfg, rl_cfg, optimizer, step),
        eval=eval_p,
        gen_rollout=gen,
        select_rows=select,
        fold_key=fold,
        calibrate=calibrate_program(model_cfg, rollout_cfg),
    )


def calibrate_program(model_cfg: ModelConfig, rollout_cfg: RolloutConfig) -> Callable:
    """``calibrate(params, prompts) -> KVScales | None``: the step-0 KV scales (§4.5), jitted
    without shardings (each process computes them on its first device, then they are placed)."""
    return jax.jit(
        functools.partial(calibrate_initial_kv_scales, model_cfg=model_cfg, rollout_cfg=rollout_cfg)
    )


def sft_program(model_cfg: ModelConfig, compute_dtype: ComputeDtype,
                optimizer: optax.GradientTransformation) -> Callable:  # fmt: skip
    """``step(params, opt_state, tokens, seg, pos, target) -> (params', opt_state', loss)``."""
    return jax.jit(
        functools.partial(
            sft_step, model_cfg=model_cfg, compute_dtype=compute_dtype, optimizer=optimizer
        )
    )


RewardFn = Callable[[jax.Array, jax.Array, object], jax.Array]


def make_fused_step(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    optimizer: optax.GradientTransformation,
    reward_fn: RewardFn,
) -> Callable[[TrainState, Prompts, object], tuple[TrainState, RolloutBatch, dict]]:
    """Steps 1-7 as one jitted program, for rewards that are JAX functions (DESIGN.md §2).

    ``reward_fn(tokens_BT, response_mask_BT, prompt_data) -> rewards_B`` runs in-graph between
    the rollout and the update; ``prompt_data`` is any pytree of per-row arrays (targets, ...).
    Returns ``fused_step(state, prompts, prompt_data) -> (state', batch, metrics)``, state
    donated; ``metrics`` holds the rollout and the train metrics.
    """
    cfg = StepConfig(model_cfg, rollout_cfg, rl_cfg)

    def fused_step(state: TrainState, prompts: Prompts, prompt_data):
        batch = rollout_step(state, prompts, cfg)
        rewards_B = reward_fn(batch.tokens_BT, batch.response_mask_BT, prompt_data)
        new_state, train_metrics = train_step(state, batch, rewards_B, cfg, optimizer)
        return new_state, batch, {**batch.metrics, **train_metrics}

    return jax.jit(fused_step, donate_argnums=(0,))
