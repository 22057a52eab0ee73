"""Load-time checks of an experiment against what it runs on: devices, data, checkpoints.

The config dataclasses check what they can alone (``__post_init__``); these need the devices,
the task's data or the run directory, and raise ``ConfigError`` naming the field.
"""

from __future__ import annotations

import logging
import math

import jax

from fp8rl_jax.models.rows import BATCH_AXES, dividing_axes
from fp8rl_jax.tasks import Task
from fp8rl_jax.train.config import ConfigError
from fp8rl_jax.train.experiment import Experiment
from fp8rl_jax.train.run_dir import CONFIG_FILE, config_changes, read_config
from fp8rl_jax.train.sharding.mesh import MESH_AXES


def device_summary() -> str:
    """One line: the devices this process's jax runs on, e.g. ``8 x NVIDIA H100 (gpu)``."""
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    where = f", {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return f"{len(devices)} x {'/'.join(kinds)} ({jax.default_backend()}{where})"


_SETUP_HINT = (
    "jax found only CPU devices: is it installed for the accelerator? "
    "(bash scripts/setup.sh detects it; --accel=cuda12|cuda13|tpu asks for one)"
)


def check_devices(exp: Experiment) -> None:
    """The mesh must use every device: ``mesh.data=2`` on one device is an error, not ignored.

    A config meant for accelerators (``trainer.allow_cpu=False``, the real-model recipes, or a
    mesh over several devices) that finds only CPUs says so, with how to set jax up.
    """
    on_cpu = jax.default_backend() == "cpu"
    try:
        exp.mesh.axis_sizes(jax.device_count())
    except ValueError as e:
        hint = f"; {_SETUP_HINT}" if on_cpu else ""
        raise ConfigError(f"config.mesh: {e}{hint}") from None
    if on_cpu and not exp.trainer.allow_cpu:
        raise ConfigError(
            "config.trainer.allow_cpu=False: this config is meant for GPUs/TPUs, but "
            f"{_SETUP_HINT}. To run it on the CPU anyway: --config.trainer.allow_cpu=True"
        )
    for line in row_split_warnings(exp, jax.device_count()):
        logging.warning("%s", line)


def row_split_warnings(exp: Experiment, num_devices: int) -> list[str]:
    """One line per batch whose rows do not split over every device of the mesh's batch axes
    (``data x fsdp x expert``): its rows then split over the longest dividing prefix of those
    axes only (``models.rows``) and each row is computed on several devices, with that many
    times the activations and FLOPs per device. [] when every batch splits evenly.
    """
    sizes = dict(zip(MESH_AXES, exp.mesh.axis_sizes(num_devices), strict=True))
    devices = math.prod(sizes[a] for a in BATCH_AXES)
    rows = exp.trainer.prompts_per_step * exp.rl.group_size
    parts = exp.rl.num_minibatches * exp.rl.grad_accum
    micro = rows // parts
    advice = _micro_batch_advice(rows, devices, exp.rl.num_minibatches, exp.rl.grad_accum)
    batches = [
        (micro, "a loss micro-batch", f"rl.grad_accum={exp.rl.grad_accum}", advice),
        (rows, "a rollout", f"trainer.prompts_per_step x rl.group_size = {rows}", ""),
    ]
    score = exp.rl.score_micro_batch
    if 0 < score < rows:
        batches.append((score, "a scoring micro-batch", f"rl.score_micro_batch={score}", ""))
    out = []
    for n, what, field, fix in batches:
        covered = math.prod(sizes[a] for a in dividing_axes(sizes, n))
        if covered < devices:
            out.append(
                f"config.{field}: {what} of {n} rows splits over {covered} of the {devices} "
                f"devices of mesh data x fsdp x expert, so each row is computed on "
                f"{devices // covered} devices ({devices // covered}x its activations and FLOPs)"
                + (f"; {fix}" if fix else f"; make it a multiple of {devices}")
            )
    return out


def _micro_batch_advice(rows: int, devices: int, minibatches: int, grad_accum: int) -> str:
    """The largest ``rl.grad_accum`` below today's whose micro-batches split over every
    device."""
    fits = [
        g
        for g in range(1, grad_accum)
        if rows % (minibatches * g) == 0 and (rows // (minibatches * g)) % devices == 0
    ]
    if not fits:
        return f"make the rows per micro-batch a multiple of {devices}"
    g = max(fits)
    return f"rl.grad_accum={g} gives micro-batches of {rows // (minibatches * g)} rows"


def check_eval_size(exp: Experiment, task: Task) -> None:
    """A finite eval split must hold ``trainer.eval_size`` problems (no repeats in the mean)."""
    n = task.num_examples("eval")
    if n is not None and exp.trainer.eval_size > n:
        source = exp.task.eval_jsonl_path or (
            f"the {exp.task.eval_fraction:g} held out of {exp.task.jsonl_path}"
        )
        raise ConfigError(
            f"config.trainer.eval_size={exp.trainer.eval_size} is more than the {n} problems of "
            f"the eval split ({source}): evaluation would repeat problems; set it to at most {n}"
        )


class ResumeError(RuntimeError):
    """The run directory's checkpoints do not fit the experiment."""


def resume_error(run_dir: str, config: dict, error: Exception) -> ResumeError:
    """One line: which fields differ from the run's ``config.json`` (the likely cause)."""
    old = read_config(run_dir)
    changes = config_changes(old, config) if old is not None else []
    first = str(error).splitlines()[0]
    if not changes:
        return ResumeError(f"{first} (details: rerun with --verbose)")
    shown = "; ".join(changes[:6]) + ("; ..." if len(changes) > 6 else "")
    return ResumeError(
        f"the checkpoints in {run_dir} do not fit this config, which differs from the run's "
        f"{CONFIG_FILE} in: {shown}. Rerun with the original config, or choose another "
        f"trainer.run_dir ({CONFIG_FILE} and the checkpoints are left as they were)"
    )
