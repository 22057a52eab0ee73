"""Load-time checks of an experiment against what it runs on: devices, data, checkpoints.

The config dataclasses check what they can alone (``__post_init__``); these need the devices,
the task's data or the run directory, and raise ``ConfigError`` naming the field.
"""

from __future__ import annotations

import jax

from fp8rl_jax.tasks import Task
from fp8rl_jax.train.config import ConfigError
from fp8rl_jax.train.experiment import Experiment
from fp8rl_jax.train.run_dir import CONFIG_FILE, config_changes, read_config


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
