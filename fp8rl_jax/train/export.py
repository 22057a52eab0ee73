"""Export a run's trained policy as a Hugging Face checkpoint (servable by vLLM / SGLang)."""

from __future__ import annotations

import os

import jax.numpy as jnp

from fp8rl_jax.generation import cast_floats, rollout_weights
from fp8rl_jax.models import ModelConfig, save_fp8_checkpoint, save_hf_checkpoint
from fp8rl_jax.models.hf import ExportDirError
from fp8rl_jax.train.checkpoint import CheckpointManager
from fp8rl_jax.train.experiment import Experiment
from fp8rl_jax.train.setup import abstract_train_state, build_task


def _model_config(exp: Experiment) -> ModelConfig:
    if exp.model.hf_checkpoint:
        return ModelConfig.from_hf_config(exp.model.hf_checkpoint)
    _, tokenizer = build_task(exp.task, exp.model.hf_checkpoint)
    return exp.model.tiny_config(tokenizer.vocab_size)


def export_hf(
    exp: Experiment,
    out_dir: str,
    *,
    dtype=jnp.bfloat16,
    fmt: str = "bf16",
    overwrite: bool = False,
    unservable: str = "error",
) -> int:
    """Writes the params of ``exp``'s newest readable checkpoint to ``out_dir`` in the HF layout.

    Only shapes are built to restore (no weights are loaded from the base checkpoint); the base
    checkpoint's tokenizer and generation files are copied along. ``out_dir`` must be new, empty
    or a previous export unless ``overwrite`` (``models.hf.dir``); the run directory is always
    refused. The checkpoints are only read, the newest that verifies under a reader lease that a
    running trainer's clean-up respects (``train.lease``), so it may run beside training.
    Returns the step.
    ``fmt="fp8"`` writes the rollout policy instead: the weights quantized by ``exp.rollout``'s
    recipe, as the rollout runs them, in the block-FP8 layout vLLM serves (``models.hf.fp8``);
    ``unservable``: what to do with weights vLLM/SGLang would load wrong (``models.hf.serving``).
    The tokenizer and generation files come from the checkpoint, then ``task.tokenizer_path``.
    """
    if fmt not in ("bf16", "fp8"):
        raise ValueError(f"export_hf: fmt must be 'bf16' or 'fp8', got {fmt!r}")
    if fmt == "fp8" and exp.rollout.quant is None:
        raise ValueError("export_hf: fmt='fp8' needs rollout.quant (the run's FP8 recipe)")
    ckpt_dir = os.path.join(exp.trainer.run_dir, "checkpoints")
    _check_out_dir(out_dir, exp.trainer.run_dir)
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"export_hf: no checkpoint under {ckpt_dir}")
    cfg = _model_config(exp)
    with CheckpointManager(ckpt_dir, read_only=True) as ckpt:  # reads under a reader lease
        restored = ckpt.restore_latest(abstract_train_state(exp, cfg))
    if restored is None:
        raise FileNotFoundError(f"export_hf: no checkpoint under {ckpt_dir}")
    info = {"run_dir": os.path.abspath(exp.trainer.run_dir), "step": int(restored.step)}
    extra = [d for d in (exp.model.hf_checkpoint, exp.task.tokenizer_path) if d]
    if fmt == "fp8":
        weights, _ = rollout_weights(restored.state.params, exp.rollout)
        save_fp8_checkpoint(
            out_dir, cfg, weights, extra_files_from=extra, overwrite=overwrite, info=info,
            unservable=unservable,
        )  # fmt: skip
        return int(restored.step)
    save_hf_checkpoint(
        out_dir, cfg, cast_floats(restored.state.params, dtype), extra_files_from=extra,
        overwrite=overwrite, info=info,
    )  # fmt: skip
    return int(restored.step)


def _check_out_dir(out_dir: str, run_dir: str) -> None:
    """The run directory, anything above it and its checkpoints are never an export target."""
    out, run = os.path.realpath(out_dir), os.path.realpath(run_dir)
    ckpts = os.path.join(run, "checkpoints")
    inside = (out + os.sep).startswith(ckpts + os.sep)
    if inside or (run + os.sep).startswith(out.rstrip(os.sep) + os.sep):
        raise ExportDirError(
            f"--out={out_dir} is (or holds) the run directory {run_dir} or its checkpoints; "
            f"export to a directory of its own, e.g. --out={os.path.join(run_dir, 'hf')}"
        )
