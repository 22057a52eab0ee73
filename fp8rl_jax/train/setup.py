"""Builds the task, tokenizer, model config, initial weights, abstract state and programs of an
experiment (the trainer, the planner and the export build them here)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8rl_jax.generation import Prompts, calibrate_initial_kv_scales
from fp8rl_jax.models import (
    ModelConfig,
    checkpoint_stop_token_ids,
    init_weights,
    load_hf_checkpoint,
    load_tokenizer,
)
from fp8rl_jax.rl import Programs, TrainState, build_programs, init_train_state
from fp8rl_jax.tasks import CharTokenizer, DataFields, MathDataset, get_task, make_chat_prompt_fn
from fp8rl_jax.train.experiment import Experiment, ModelSpec, TaskSpec
from fp8rl_jax.train.optim import make_optimizer


def build_task(spec: TaskSpec, hf_checkpoint: str = ""):
    """``(task, tokenizer)``: a built-in task with the character tokenizer, or math from a JSONL
    or parquet file + HF.

    An empty ``tokenizer_path`` means the HF checkpoint's own tokenizer when there is one.
    """
    tokenizer_path = spec.tokenizer_path or hf_checkpoint
    if spec.name == "math":
        if not spec.jsonl_path or not tokenizer_path:
            raise ValueError(
                "task.name='math' needs task.jsonl_path and an HF tokenizer "
                "(task.tokenizer_path or model.hf_checkpoint)"
            )
        tokenizer = load_tokenizer(tokenizer_path)

        fields = DataFields(
            prompt=spec.question_key,
            ground_truth=spec.answer_key,
            data_source=spec.data_source_key,
            extra_info=spec.extra_info_key,
        )

        def dataset(path):
            return MathDataset(path, data_format=spec.data_format, fields=fields)

        task = get_task(
            "math",
            train=dataset(spec.jsonl_path),
            eval=dataset(spec.eval_jsonl_path) if spec.eval_jsonl_path else None,
            eval_fraction=spec.eval_fraction,
            prompt_fn=make_chat_prompt_fn(tokenizer),
            format_reward=spec.format_reward,
            verifier=spec.verifier,
            native_reward=spec.native_reward,
        )
        return task, tokenizer
    kwargs = {"seed": spec.seed, "format_reward": spec.format_reward}
    if spec.name in ("addition", "multiplication"):
        kwargs["digits"] = spec.digits
    elif spec.name == "chain":
        kwargs |= dict(
            min_steps=spec.min_steps,
            max_steps=spec.max_steps,
            max_stride=spec.max_stride,
            partial_credit=spec.partial_credit,
        )
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else CharTokenizer()
    return get_task(spec.name, **kwargs), tokenizer


def build_model(spec: ModelSpec, tokenizer, rng) -> tuple[ModelConfig, dict]:
    """An HF checkpoint (its config wins) or a tiny random model sized to the tokenizer."""
    if spec.hf_checkpoint:
        cfg, weights = load_hf_checkpoint(spec.hf_checkpoint, dtype=jnp.float32)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(
                f"tokenizer vocab {tokenizer.vocab_size} exceeds the model's {cfg.vocab_size}"
            )
        return cfg, weights
    cfg = spec.tiny_config(tokenizer.vocab_size)
    weights = init_weights(cfg, rng, jnp.float32)
    # init_weights draws the embedding with std 1 (HF-parity tests); for training from scratch
    # std 1/sqrt(D) keeps the initial (tied) logits O(1), so SFT starts near log(V) loss.
    weights["embed"] = weights["embed"] / cfg.hidden_size**0.5
    return cfg, weights


def abstract_train_state(exp: Experiment, model_cfg: ModelConfig, params=None) -> TrainState:
    """The structure, shapes and dtypes (``jax.ShapeDtypeStruct``s) of ``exp``'s train state: the
    restore target of the trainer's resume and of the export. Nothing is computed or loaded.

    ``params``: the policy weights (arrays or shapes); default, the shapes ``init_weights``
    gives ``model_cfg``. The static KV scales, when the rollout has them, are traced from a
    one-token prompt: their shape is [L, K] whatever the prompts.
    """
    optimizer = make_optimizer(exp.optim)

    def build(params):
        one_token = Prompts(jnp.ones((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
        kv_scales = calibrate_initial_kv_scales(params, one_token, model_cfg, exp.rollout)
        return init_train_state(params, optimizer, jax.random.key(0), kv_scales, rl_cfg=exp.rl)

    if params is None:
        params = jax.eval_shape(lambda: init_weights(model_cfg, jax.random.key(0), jnp.float32))
    return jax.eval_shape(build, params)


def run_programs(exp: Experiment, model_cfg: ModelConfig, placement, optimizer) -> Programs:
    """Every jitted program of ``exp``'s run (``rl.build_programs``) with the shardings of
    ``placement`` (``train.placement``: none on one device)."""
    return build_programs(model_cfg, exp.rollout, exp.rl, optimizer, placement.shardings(exp))


def resolve_stop_tokens(exp: Experiment, tokenizer) -> Experiment:
    """``exp`` with ``rollout.stop_token_ids`` filled from the HF checkpoint when left empty.

    Non-empty ``rollout.stop_token_ids`` is an override and wins. Empty, with an HF checkpoint:
    its ``generation_config.json`` (or ``config.json``) EOS ids plus the tokenizer's EOS
    (``models.checkpoint_stop_token_ids``). Without a checkpoint, empty stays empty.
    """
    if exp.rollout.stop_token_ids or not exp.model.hf_checkpoint:
        return exp
    ids = checkpoint_stop_token_ids(exp.model.hf_checkpoint, tokenizer)
    if not ids:
        raise ValueError(
            f"{exp.model.hf_checkpoint}: no eos_token_id in generation_config.json or "
            "config.json and the tokenizer has no EOS; pass --config.rollout.stop_token_ids"
        )
    return dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, stop_token_ids=ids))


__all__ = [
    "abstract_train_state",
    "build_model",
    "build_task",
    "resolve_stop_tokens",
    "run_programs",
]
